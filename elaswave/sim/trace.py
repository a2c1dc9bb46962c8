"""Elastic-event traces for the simulator: read from CSV, or drawn from MTBF or a period.

A trace is a time-ordered tuple of :class:`TraceEvent`. The CSV form is the public
spot-instance traces' ``time_ms,add|remove,nodeN`` (one event per line), extended with
``time_ms,slow,nodeN,FACTOR`` for a fail-slow node (every device of the node computes
``FACTOR`` times slower from then on; ``FACTOR`` 1 ends it). Blank lines and ``#``
comments are ignored, and a first line ``time_ms,event,node`` is taken as a header.

Everything here is pure: a bad trace raises :class:`TraceError` naming the line and
what would be valid, before any simulation starts.
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass


class TraceError(ValueError):
    """A trace that cannot be simulated; the message names the line."""


class EventKind(enum.StrEnum):
    ADD = "add"
    REMOVE = "remove"
    SLOW = "slow"


@dataclass(frozen=True)
class TraceEvent:
    time_ms: float
    kind: EventKind
    node: int
    factor: float = 1.0
    """Compute slowdown of the node's devices (SLOW events only)."""


def _node(text: str, num_nodes: int) -> int | None:
    if not text.startswith("node") or not text[4:].isdigit():
        return None
    node = int(text[4:])
    return node if node < num_nodes else None


def parse_trace(text: str, *, num_nodes: int, source: str = "trace") -> tuple[TraceEvent, ...]:
    """Parse a CSV trace for a job of ``num_nodes`` nodes (``node0`` .. ``nodeN-1``).

    Raises TraceError for a malformed line, an unknown event, an unknown node, a time
    going backwards, removing a node that is not in the job or adding one that is.
    Every node starts in the job.
    """
    if num_nodes < 1:
        raise ValueError(f"num_nodes = {num_nodes}: must be at least 1")
    events: list[TraceEvent] = []
    present = set(range(num_nodes))
    last = -math.inf
    valid_nodes = f"node0 .. node{num_nodes - 1}"
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{lineno}: {raw.strip()!r}"
        fields = [f.strip() for f in line.split(",")]
        if lineno == 1 and fields[:3] == ["time_ms", "event", "node"]:
            continue
        if len(fields) not in (3, 4):
            raise TraceError(
                f"{where}: expected time_ms,add|remove,nodeN or time_ms,slow,nodeN,FACTOR"
            )
        try:
            time_ms = float(fields[0])
        except ValueError:
            raise TraceError(f"{where}: time {fields[0]!r} is not a number of ms") from None
        if not math.isfinite(time_ms) or time_ms < 0:
            raise TraceError(f"{where}: time {fields[0]} must be a finite number >= 0")
        if time_ms < last:
            raise TraceError(f"{where}: time goes backwards ({time_ms:g} ms after {last:g} ms)")
        try:
            kind = EventKind(fields[1])
        except ValueError:
            valid = ", ".join(k.value for k in EventKind)
            raise TraceError(f"{where}: unknown event {fields[1]!r}; valid: {valid}") from None
        node = _node(fields[2], num_nodes)
        if node is None:
            raise TraceError(f"{where}: unknown node {fields[2]!r}; valid: {valid_nodes}")
        factor = 1.0
        if kind is EventKind.SLOW:
            if len(fields) != 4:
                raise TraceError(f"{where}: a slow event needs a factor: time_ms,slow,nodeN,FACTOR")
            try:
                factor = float(fields[3])
            except ValueError:
                raise TraceError(f"{where}: factor {fields[3]!r} is not a number") from None
            if not (math.isfinite(factor) and factor >= 1.0):
                raise TraceError(f"{where}: factor {fields[3]} must be >= 1 (1 ends a slowdown)")
        elif len(fields) == 4:
            raise TraceError(f"{where}: only slow events take a factor")
        if kind is EventKind.REMOVE and node not in present:
            raise TraceError(f"{where}: node{node} is not in the job (already removed)")
        if kind is EventKind.ADD and node in present:
            raise TraceError(f"{where}: node{node} is already in the job")
        if kind is EventKind.REMOVE:
            present.discard(node)
        elif kind is EventKind.ADD:
            present.add(node)
        events.append(TraceEvent(time_ms, kind, node, factor))
        last = time_ms
    return tuple(events)


def format_trace(events: Iterable[TraceEvent]) -> str:
    """The CSV form of ``events`` (parse_trace reads it back)."""
    lines = []
    for e in events:
        line = f"{e.time_ms!r},{e.kind.value},node{e.node}"
        if e.kind is EventKind.SLOW:
            line += f",{e.factor!r}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def poisson_failures(
    *,
    num_nodes: int,
    devices_per_node: int,
    mtbf_hours: float,
    duration_ms: float,
    seed: int = 0,
    repair_ms: float | None = None,
) -> tuple[TraceEvent, ...]:
    """Node removals from independent device failures with a per-device MTBF.

    Each device fails after an exponential time with mean ``mtbf_hours``; a failure
    removes the device's node (the node's other devices go with it). With
    ``repair_ms`` the node is added back that long after. Deterministic per ``seed``.
    """
    if mtbf_hours <= 0 or duration_ms <= 0 or devices_per_node < 1 or num_nodes < 1:
        raise ValueError(
            f"mtbf_hours = {mtbf_hours}, duration_ms = {duration_ms}, devices_per_node = "
            f"{devices_per_node}, num_nodes = {num_nodes}: all must be positive"
        )
    rng = random.Random(seed)
    rate_per_ms = num_nodes * devices_per_node / (mtbf_hours * 3_600_000)
    events: list[TraceEvent] = []
    present = set(range(num_nodes))
    back: dict[int, float] = {}
    t = 0.0
    while True:
        t += rng.expovariate(rate_per_ms)
        for node, at in sorted(back.items(), key=lambda kv: kv[1]):
            if at <= min(t, duration_ms):
                events.append(TraceEvent(at, EventKind.ADD, node))
                present.add(node)
                del back[node]
        if t >= duration_ms:
            break
        node = rng.randrange(num_nodes)  # the failed device's node, uniformly
        if node not in present:
            continue  # a device of a node already out of the job
        present.discard(node)
        events.append(TraceEvent(t, EventKind.REMOVE, node))
        if repair_ms is not None:
            back[node] = t + repair_ms
    return tuple(sorted(events, key=lambda e: e.time_ms))


def periodic_failures(
    *, num_nodes: int, interval_ms: float, count: int, first_ms: float | None = None
) -> tuple[TraceEvent, ...]:
    """``count`` node removals every ``interval_ms``, the last nodes first."""
    if interval_ms <= 0 or not 0 <= count <= num_nodes - 1:
        raise ValueError(
            f"interval_ms = {interval_ms}, count = {count}: need interval > 0 and "
            f"0 <= count <= {num_nodes - 1} (one node must survive)"
        )
    start = interval_ms if first_ms is None else first_ms
    return tuple(
        TraceEvent(start + i * interval_ms, EventKind.REMOVE, num_nodes - 1 - i)
        for i in range(count)
    )
