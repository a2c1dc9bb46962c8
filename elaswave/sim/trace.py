"""Elastic-event traces for the simulator: published spot traces, and generated ones.

Two forms, one for people and one for the simulator:

* **Published** (:class:`NodeEvent`): what the public spot-instance traces (Bamboo,
  Oobleck) publish, one CSV line ``time_ms,add|remove,NODE`` per event, extended with
  ``time_ms,slow,NODE,FACTOR`` for a fail-slow node (its devices compute ``FACTOR``
  times slower from then on; ``FACTOR`` 1 ends it). The cluster starts **empty**: ``add``
  brings a node when it arrives, ``remove`` takes it away. Node ids are names
  (``node17``, ``i-0abc``; letters, digits and ``_.:-``), not slots; an id that left may
  arrive again. Blank lines and ``#`` comments are ignored, and a first line
  ``time_ms,event,node`` is a header.
* **Slots** (:class:`TraceEvent`): the job has ``num_slots`` node slots, all full at
  time 0, and events name a slot. :func:`to_slots` maps a published trace onto them:
  the job starts at the first moment the cluster fills every slot, later arrivals wait
  as spares and take the slot of a node that leaves (see :func:`to_slots`).

Everything here is pure: a bad trace raises :class:`TraceError` naming the line (or the
event) and what would be valid, before any simulation starts. The generators
(:func:`poisson_failures`, :func:`periodic_failures`, :func:`spot_trace`) return the
published form, deterministic per seed, so that :func:`format_trace` can write them and
:func:`parse_trace` read them back.
"""

from __future__ import annotations

import enum
import heapq
import math
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

NODE_ID = re.compile(r"[A-Za-z0-9_.:-]+")
HEADER = ("time_ms", "event", "node")
MS_PER_HOUR = 3_600_000


class TraceError(ValueError):
    """A trace that cannot be simulated; the message names the line."""


class EventKind(enum.StrEnum):
    ADD = "add"
    REMOVE = "remove"
    SLOW = "slow"


@dataclass(frozen=True)
class NodeEvent:
    """One line of a published trace: a node (by id) arrives, leaves or slows down."""

    time_ms: float
    kind: EventKind
    node: str
    factor: float = 1.0
    """Compute slowdown of the node's devices (SLOW events only)."""


@dataclass(frozen=True)
class TraceEvent:
    """One event as the simulator sees it: ``node`` is the job's node slot."""

    time_ms: float
    kind: EventKind
    node: int
    factor: float = 1.0
    """Compute slowdown of the node's devices (SLOW events only)."""


@dataclass(frozen=True)
class SlotTrace:
    """A published trace mapped onto a job's node slots (see :func:`to_slots`)."""

    events: tuple[TraceEvent, ...]
    """Slot events, in ms after the start; every slot is full at time 0."""
    num_slots: int
    start_ms: float
    """Trace time at which the cluster first filled every slot: the job's time 0."""
    end_ms: float
    """Trace time of the trace's last event."""
    spares: tuple[tuple[float, int], ...]
    """(ms after the start, spare nodes from then on), from (0, spares at the start)."""
    published: tuple[NodeEvent, ...]
    """The trace this was mapped from, whole (events before the start included)."""

    def of_slot(self, slot: int) -> tuple[TraceEvent, ...]:
        """The events of one slot, in time order."""
        return tuple(e for e in self.events if e.node == slot)

    def filled_fraction(self, end_s: float) -> float:
        """Time-averaged fraction of the slots filled over [0, ``end_s``] s after the start."""
        return filled_fraction(self.events, self.num_slots, end_s)


def filled_fraction(events: Iterable[TraceEvent], num_slots: int, end_s: float) -> float:
    """Time-averaged fraction of ``num_slots`` slots filled over [0, ``end_s``] s, from
    slot events in time order that start with every slot full.

    A node counts from the moment the trace brings it: the process start that the
    simulator adds before its ranks join is recovery time, not missing capacity.
    """
    if end_s <= 0:
        return 1.0
    filled, t, area = num_slots, 0.0, 0.0
    for e in events:
        at = min(e.time_ms / 1000, end_s)
        area += filled * (at - t)
        t = at
        filled += {EventKind.REMOVE: -1, EventKind.ADD: 1}.get(e.kind, 0)
    area += filled * (end_s - t)
    return area / (num_slots * end_s)


# -- the published form ---------------------------------------------------------------


def _ms(time_ms: float) -> str:
    """``time_ms`` as written in a trace: whole milliseconds without a fraction."""
    t = float(time_ms)
    return str(int(t)) if t.is_integer() and abs(t) < 2**53 else repr(t)


def format_event(e: NodeEvent) -> str:
    """The CSV line of one published event."""
    line = f"{_ms(e.time_ms)},{e.kind.value},{e.node}"
    return line + f",{e.factor!r}" if e.kind is EventKind.SLOW else line


def format_trace(events: Iterable[NodeEvent]) -> str:
    """The CSV form of ``events``, with its header (:func:`parse_trace` reads it back)."""
    return "\n".join([",".join(HEADER), *map(format_event, events)]) + "\n"


def _refusal(e: NodeEvent, present: Mapping[str, object], left: set[str]) -> str | None:
    """Why ``e`` cannot happen to a cluster of ``present`` nodes, or None if it can."""
    if e.kind is EventKind.ADD:
        if e.node in present:
            return f"{e.node} is already in the cluster; remove it first, or add a new node id"
        return None
    if e.node in present:
        return None
    if e.node in left:
        return f"{e.node} is not in the cluster (it was removed earlier); add it again first"
    return (
        f"{e.node} is not in the cluster: traces start from an empty cluster; "
        f"add every node first (0,add,{e.node})"
    )


def _apply(e: NodeEvent, present: dict[str, None], left: set[str]) -> None:
    if e.kind is EventKind.ADD:
        present[e.node] = None
        left.discard(e.node)
    elif e.kind is EventKind.REMOVE:
        del present[e.node]
        left.add(e.node)


def _parse_line(fields: list[str]) -> NodeEvent:
    """One event from a line's fields; ValueError says what is wrong with them."""
    if len(fields) not in (3, 4):
        raise ValueError("expected time_ms,add|remove,NODE or time_ms,slow,NODE,FACTOR")
    try:
        time_ms = float(fields[0])
    except ValueError:
        raise ValueError(f"time {fields[0]!r} is not a number of ms") from None
    if not math.isfinite(time_ms) or time_ms < 0:
        raise ValueError(f"time {fields[0]} must be a finite number >= 0")
    try:
        kind = EventKind(fields[1])
    except ValueError:
        valid = ", ".join(k.value for k in EventKind)
        raise ValueError(f"unknown event {fields[1]!r}; valid: {valid}") from None
    if not NODE_ID.fullmatch(fields[2]):
        raise ValueError(
            f"node id {fields[2]!r}: use letters, digits and _.:- (e.g. node17, i-0abc)"
        )
    factor = 1.0
    if kind is EventKind.SLOW:
        if len(fields) != 4:
            raise ValueError("a slow event needs a factor: time_ms,slow,NODE,FACTOR")
        try:
            factor = float(fields[3])
        except ValueError:
            raise ValueError(f"factor {fields[3]!r} is not a number") from None
        if not (math.isfinite(factor) and factor >= 1.0):
            raise ValueError(f"factor {fields[3]} must be >= 1 (1 ends a slowdown)")
    elif len(fields) == 4:
        raise ValueError("only slow events take a factor")
    return NodeEvent(time_ms, kind, fields[2], factor)


def parse_trace(text: str, *, source: str = "trace") -> tuple[NodeEvent, ...]:
    """Parse a published CSV trace; the cluster starts empty.

    Raises TraceError, as ``source:LINE: 'the line': what is wrong``, for a malformed
    line, an unknown event, a bad node id or factor, a time going backwards, adding a
    node that is in the cluster, or removing or slowing one that is not.
    """
    events: list[NodeEvent] = []
    present: dict[str, None] = {}
    left: set[str] = set()
    last = -math.inf
    header_ok = True  # a header is the first line that is not blank or a comment
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = [f.strip() for f in line.split(",")]
        if header_ok and tuple(fields[:3]) == HEADER and len(fields) <= 4:
            header_ok = False
            continue
        header_ok = False
        where = f"{source}:{lineno}: {raw.strip()!r}"
        try:
            e = _parse_line(fields)
        except ValueError as exc:
            raise TraceError(f"{where}: {exc}") from None
        if e.time_ms < last:
            raise TraceError(f"{where}: time goes backwards ({e.time_ms:g} ms after {last:g} ms)")
        why = _refusal(e, present, left)
        if why is not None:
            raise TraceError(f"{where}: {why}")
        _apply(e, present, left)
        events.append(e)
        last = e.time_ms
    return tuple(events)


# -- onto the job's node slots --------------------------------------------------------


class _Slots:
    """The mutable state of :func:`to_slots`'s single pass (never escapes it)."""

    def __init__(self, num_slots: int) -> None:
        self.empty = list(range(num_slots))  # a heap: the lowest empty slot first
        self.slot_of: dict[str, int] = {}
        self.spares: dict[str, None] = {}  # insertion order: first come, first seated
        self.slow: dict[str, float] = {}  # a node's factor, remembered until it is seated
        self.slot_factor: dict[int, float] = {}  # the factor the simulator holds per slot
        self.out: list[TraceEvent] = []
        self.start: float | None = None
        """Trace time at which every slot was first full; None before."""
        self.most, self.most_at = 0, 0.0  # most nodes seated before the start, and when
        self.spare_counts: list[tuple[float, int]] = []
        """(ms after the start, spare nodes from then on)."""

    def seat(self, node: str, at: float | None) -> None:
        """Put ``node`` in the lowest empty slot; ``at`` None: before the start."""
        slot = heapq.heappop(self.empty)
        self.slot_of[node] = slot
        if at is not None:
            self.out.append(TraceEvent(at, EventKind.ADD, slot))
            self.set_factor(slot, self.slow.get(node, 1.0), at)

    def set_factor(self, slot: int, factor: float, at: float) -> None:
        """Tell the simulator the slot's factor when it changes (a new node resets it)."""
        if self.slot_factor.get(slot, 1.0) != factor:
            self.out.append(TraceEvent(at, EventKind.SLOW, slot, factor))
            self.slot_factor[slot] = factor

    def leave(self, node: str) -> int | None:
        """Take ``node`` away; its slot, or None for a spare."""
        self.slow.pop(node, None)
        if node in self.spares:
            del self.spares[node]
            return None
        slot = self.slot_of.pop(node)
        heapq.heappush(self.empty, slot)
        return slot

    def fill(self, e: NodeEvent) -> None:
        """An event before the start: filling the slots, no spares yet, nothing emitted
        (a seated node's slowdown is emitted at 0 once every slot is full)."""
        if e.kind is EventKind.ADD:
            self.seat(e.node, None)
            if len(self.slot_of) > self.most:
                self.most, self.most_at = len(self.slot_of), e.time_ms
            if not self.empty:
                self.start = e.time_ms
                self.spare_counts.append((0.0, 0))
                for node, seated in sorted(self.slot_of.items(), key=lambda kv: kv[1]):
                    self.set_factor(seated, self.slow.pop(node, 1.0), 0.0)
        elif e.kind is EventKind.REMOVE:
            self.leave(e.node)
        else:
            self.slow[e.node] = e.factor

    def follow(self, e: NodeEvent, at: float) -> None:
        """An event ``at`` ms after the start, as :func:`to_slots` describes."""
        before = len(self.spares)
        if e.kind is EventKind.ADD:
            if self.empty:
                self.seat(e.node, at)
            else:
                self.spares[e.node] = None
        elif e.kind is EventKind.REMOVE:
            slot = self.leave(e.node)
            if slot is not None:
                self.out.append(TraceEvent(at, EventKind.REMOVE, slot))
                if self.spares:
                    spare = next(iter(self.spares))
                    del self.spares[spare]
                    self.seat(spare, at)
        elif e.node in self.slot_of:
            self.set_factor(self.slot_of[e.node], e.factor, at)
        else:
            self.slow[e.node] = e.factor
        if len(self.spares) != before:
            self.spare_counts.append((at, len(self.spares)))


def to_slots(events: Sequence[NodeEvent], num_slots: int, *, source: str = "trace") -> SlotTrace:
    """Map a published trace onto a job of ``num_slots`` node slots.

    Arriving nodes fill empty slots, lowest first. The job starts at the first moment
    every slot is full; that trace time becomes time 0 and the events before it are
    consumed (a slowdown of a seated node carries over as a SLOW at 0). After the start:
    a node arriving while every slot is full is a spare (first come, first seated);
    removing a seated node empties its slot (REMOVE) and the oldest spare, if any, takes
    it at once (ADD at the same time: the simulator adds the process start); removing a
    spare changes nothing the job sees; an arrival while a slot is empty takes the
    lowest one (ADD). A slowdown of a seated node is a SLOW of its slot; one of a spare
    is remembered and emitted when it takes a slot, and a node taking a slow node's
    slot resets it (SLOW 1). Raises TraceError if ``events`` are not a valid published
    trace or never fill every slot at once.
    """
    if num_slots < 1:
        raise ValueError(f"num_slots = {num_slots}: must be at least 1")
    st = _Slots(num_slots)
    present: dict[str, None] = {}
    left: set[str] = set()
    last = -math.inf
    for i, e in enumerate(events, start=1):
        why = _refusal(e, present, left)
        if e.time_ms < last:
            why = f"time goes backwards ({e.time_ms:g} ms after {last:g} ms)"
        if why is not None:
            raise TraceError(f"{source}: event {i} {format_event(e)!r}: {why}")
        _apply(e, present, left)
        last = e.time_ms
        if st.start is None:
            st.fill(e)
        else:
            st.follow(e, e.time_ms - st.start)
    if st.start is None:
        most, most_at = st.most, st.most_at
        at_most = f"at most {most}, first at {_ms(most_at)} ms" if most else "it adds no node"
        raise TraceError(
            f"{source}: the trace never has {num_slots} nodes at once for the job's "
            f"{num_slots} node slots ({at_most}): use a smaller job (--dp/--pp/--tp) "
            "or a longer trace"
        )
    return SlotTrace(
        events=tuple(st.out),
        num_slots=num_slots,
        start_ms=st.start,
        end_ms=last,
        spares=tuple(st.spare_counts),
        published=tuple(events),
    )


def slot_trace(text: str, *, num_slots: int, source: str = "trace") -> SlotTrace:
    """:func:`parse_trace` then :func:`to_slots`: a CSV trace as the simulator runs it."""
    return to_slots(parse_trace(text, source=source), num_slots, source=source)


# -- generated traces -----------------------------------------------------------------


def full_start(num_nodes: int) -> tuple[NodeEvent, ...]:
    """``node0`` .. ``nodeN-1`` arriving at time 0: a job whose nodes are all there."""
    return tuple(NodeEvent(0.0, EventKind.ADD, f"node{n}") for n in range(num_nodes))


def poisson_failures(
    *,
    num_nodes: int,
    devices_per_node: int,
    mtbf_hours: float,
    duration_ms: float,
    seed: int = 0,
    repair_ms: float | None = None,
) -> tuple[NodeEvent, ...]:
    """``num_nodes`` nodes at time 0, then removals from device failures with an MTBF.

    Each device fails after an exponential time with mean ``mtbf_hours``; a failure
    removes the device's node (the node's other devices go with it). With
    ``repair_ms`` the node (same id) is added back that long after. Deterministic per
    ``seed``.
    """
    if mtbf_hours <= 0 or duration_ms <= 0 or devices_per_node < 1 or num_nodes < 1:
        raise ValueError(
            f"mtbf_hours = {mtbf_hours}, duration_ms = {duration_ms}, devices_per_node = "
            f"{devices_per_node}, num_nodes = {num_nodes}: all must be positive"
        )
    rng = random.Random(seed)
    rate_per_ms = num_nodes * devices_per_node / (mtbf_hours * MS_PER_HOUR)
    events = list(full_start(num_nodes))
    present = set(range(num_nodes))
    back: dict[int, float] = {}
    t = 0.0
    while True:
        t += rng.expovariate(rate_per_ms)
        for node, at in sorted(back.items(), key=lambda kv: kv[1]):
            if at <= min(t, duration_ms):
                events.append(NodeEvent(at, EventKind.ADD, f"node{node}"))
                present.add(node)
                del back[node]
        if t >= duration_ms:
            break
        node = rng.randrange(num_nodes)  # the failed device's node, uniformly
        if node not in present:
            continue  # a device of a node already out of the job
        present.discard(node)
        events.append(NodeEvent(t, EventKind.REMOVE, f"node{node}"))
        if repair_ms is not None:
            back[node] = t + repair_ms
    return tuple(sorted(events, key=lambda e: e.time_ms))


def periodic_failures(
    *, num_nodes: int, interval_ms: float, count: int, first_ms: float | None = None
) -> tuple[NodeEvent, ...]:
    """``num_nodes`` nodes at time 0, then ``count`` removals every ``interval_ms``, the
    last nodes first."""
    if interval_ms <= 0 or not 0 <= count <= num_nodes - 1:
        raise ValueError(
            f"interval_ms = {interval_ms}, count = {count}: need interval > 0 and "
            f"0 <= count <= {num_nodes - 1} (one node must survive)"
        )
    start = interval_ms if first_ms is None else first_ms
    return full_start(num_nodes) + tuple(
        NodeEvent(start + i * interval_ms, EventKind.REMOVE, f"node{num_nodes - 1 - i}")
        for i in range(count)
    )


def _check(name: str, value: float, low: float, high: float, *, open_low: bool = False) -> None:
    """ValueError naming ``name`` unless ``value`` is in [low, high] ((low, high])."""
    above = low < value if open_low else low <= value
    if not (math.isfinite(value) and above and value <= high):
        raise ValueError(
            f"{name} = {value!r}: must be in {'(' if open_low else '['}{low:g}, {high:g}]"
        )


def spot_trace(
    *,
    capacity: int,
    hours: float,
    seed: int = 0,
    arrive_s: float = 300.0,
    bursts_per_hour: float = 0.5,
    burst_mean: float | None = None,
    burst_s: float = 30.0,
    replace_s: float = 600.0,
    dip: float = 0.2,
    trough_hour: float = 14.0,
) -> tuple[NodeEvent, ...]:
    """A spot cluster that targets ``capacity`` nodes, for ``hours``, in published form.

    The model, every draw from one ``random.Random(seed)``:

    * The cluster starts empty; ``capacity`` nodes arrive at uniform times within the
      first ``arrive_s`` seconds.
    * The provider's spare capacity follows the day: it can grant at most
      ``capacity * (1 - dip * (1 + cos(2 pi (h - trough_hour) / 24)) / 2)`` nodes at
      hour ``h`` of the day (trace time 0 is midnight), ``capacity`` at the peak and
      ``(1 - dip) * capacity`` at ``trough_hour``.
    * Preemptions come in bursts, a Poisson process of ``bursts_per_hour``: a burst
      reclaims a geometric number of nodes (mean ``burst_mean``, by default 5% of
      ``capacity``, at least 1), or the nodes above what the provider can grant if that
      is more, chosen uniformly among the present ones and removed at uniform times
      within ``burst_s`` seconds.
    * Each reclaimed node asks for a replacement after an exponential delay of mean
      ``replace_s``; a new node (a new id: ids are never reused) arrives then if the
      provider can grant one, and otherwise the request waits another such delay.

    Deterministic per ``seed``; sized for 10^2 .. 10^4 nodes.
    """
    if capacity < 1:
        raise ValueError(f"capacity = {capacity}: must be at least 1 node")
    _check("hours", hours, 0.0, 1e6, open_low=True)
    for name, value in (("arrive_s", arrive_s), ("burst_s", burst_s), ("replace_s", replace_s)):
        _check(name, value, 0.0, 1e9)
    _check("bursts_per_hour", bursts_per_hour, 0.0, 1e6)
    _check("dip", dip, 0.0, 0.99)
    _check("trough_hour", trough_hour, 0.0, 24.0)
    mean = max(1.0, capacity / 20) if burst_mean is None else burst_mean
    _check("burst_mean", mean, 1.0, float(capacity))
    spot = _SpotCluster(
        capacity=capacity,
        end_ms=hours * MS_PER_HOUR,
        rng=random.Random(seed),
        bursts_per_hour=bursts_per_hour,
        burst_mean=mean,
        burst_s=burst_s,
        replace_s=replace_s,
        dip=dip,
        trough_hour=trough_hour,
    )
    arrivals = sorted(spot.rng.uniform(0, arrive_s * 1000) for _ in range(capacity))
    for n, t_ms in enumerate(arrivals):
        spot.push(t_ms, "arrive", f"node{n}")
    if bursts_per_hour > 0:
        spot.push(spot.rng.expovariate(bursts_per_hour / MS_PER_HOUR), "burst")
    return spot.play()


@dataclass(kw_only=True)
class _SpotCluster:
    """The provider and the cluster of :func:`spot_trace`, played out in time order
    from one queue of pending actions (mutable; never escapes it)."""

    capacity: int
    end_ms: float
    """Actions after this are never queued."""
    rng: random.Random
    bursts_per_hour: float
    burst_mean: float
    burst_s: float
    replace_s: float
    dip: float
    trough_hour: float
    queue: list[tuple[float, int, str, str]] = field(default_factory=list)
    """(ms, order, action, node), a heap."""
    order: int = 0

    def push(self, t_ms: float, action: str, node: str = "") -> None:
        if t_ms <= self.end_ms:
            heapq.heappush(self.queue, (t_ms, self.order, action, node))
            self.order += 1

    def grantable(self, t_ms: float) -> int:
        """Nodes the provider can grant at ``t_ms``."""
        phase = 2 * math.pi * (t_ms / MS_PER_HOUR - self.trough_hour) / 24
        return self.capacity - round(self.capacity * self.dip * (1 + math.cos(phase)) / 2)

    def burst_size(self, t_ms: float, present: int) -> int:
        p = 1 / self.burst_mean
        drawn = 1 if p >= 1 else 1 + int(math.log(1 - self.rng.random()) / math.log(1 - p))
        return min(present, max(drawn, present - self.grantable(t_ms)))

    def ask_later(self, t_ms: float) -> None:
        """A replacement request, after an exponential delay."""
        self.push(t_ms + self.rng.expovariate(1 / max(self.replace_s * 1000, 1e-9)), "request")

    def play(self) -> tuple[NodeEvent, ...]:
        """Every queued action and those they queue, in time order: the trace."""
        next_id = self.capacity
        present: dict[str, None] = {}
        doomed: set[str] = set()
        out: list[NodeEvent] = []
        while self.queue:
            t_ms, _, action, node = heapq.heappop(self.queue)
            if action == "arrive":
                present[node] = None
                out.append(NodeEvent(t_ms, EventKind.ADD, node))
            elif action == "burst":
                self.push(t_ms + self.rng.expovariate(self.bursts_per_hour / MS_PER_HOUR), "burst")
                alive = [n for n in present if n not in doomed]
                for victim in self.rng.sample(alive, self.burst_size(t_ms, len(alive))):
                    doomed.add(victim)
                    self.push(t_ms + self.rng.uniform(0, self.burst_s * 1000), "remove", victim)
            elif action == "remove":
                del present[node]
                doomed.discard(node)
                out.append(NodeEvent(t_ms, EventKind.REMOVE, node))
                self.ask_later(t_ms)
            elif len(present) < self.grantable(t_ms):  # a replacement request, granted
                self.push(t_ms, "arrive", f"node{next_id}")
                next_id += 1
            else:  # not granted now: ask again later
                self.ask_later(t_ms)
        return tuple(out)
