"""Delivery on top of PUB/SUB: sequence tracking, a sender's history, injected faults.

ZeroMQ PUB/SUB drops messages at a high-water mark and before a subscription arrives,
and nothing tells the receiver. ElasWave numbers every event per (sender, topic)
(:class:`~elaswave.bus.schema.Event` ``seq``) and treats :data:`RELIABLE_TOPICS` as must-
deliver:

- a receiver keeps a :class:`SeqTracker` per client: a number it has seen is a duplicate
  (dropped), a number above the highest seen opens a gap, a number inside a gap fills it
  (a reordered message is delivered, late);
- a sender's last numbers travel in its periodic :class:`~elaswave.bus.schema.Beacon`, so
  a lost *last* message is noticed too;
- a worker starts counting the Core's numbers where the Core's log stands when it
  connects (:meth:`~elaswave.bus.client.BusClient.connect`), not at the first one it
  happens to receive: a lost announcement is then never taken for one sent before it;
- workers fetch what they miss from the Core's log (:mod:`elaswave.bus.logservice`); the
  Core, which has no log above it, asks the sender to publish again from its
  :class:`SentHistory` (:class:`~elaswave.bus.schema.ResendRequest`).

:class:`BusFaults` is the fault-injecting transport the tests run the whole protocol
under: it drops, duplicates, reorders and delays what a client receives.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import random
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from elaswave.bus.schema import Topic

RELIABLE_TOPICS: frozenset[Topic] = frozenset(set(Topic) - {Topic.HEALTH})
"""Topics whose lost messages are fetched again: plans and their protocol, workers
starting and finishing, scale requests, and the step metrics that end an MTTR and make
the loss curve. Health is periodic (heartbeats): a lost one is counted, and the next one
replaces it."""


HISTORY = 4096
"""Messages per reliable topic a sender keeps for resending."""

FLUSH_WINDOW = 512
"""A client's latest messages per topic that :meth:`~elaswave.bus.client.BusClient.flush`
makes sure the Core's log holds before the client exits."""

MAX_GAP = 10_000
"""Most missing numbers tracked per (sender, topic); older ones are given up (logged)."""


class SeqTracker:
    """What a receiver has seen of every (sender, topic), and what it is missing.

    The first evidence of a (sender, topic) sets where its numbering starts for this
    receiver: a beacon (its advertised number is the start) or a message (the one before
    it is). ``from_start`` receivers (the Core, which starts before every other process)
    expect every sender from 1. A client with the Core's log advertises the Core's
    numbers from the log before it subscribes, so that its first evidence of the Core
    never comes after a lost message of the Core's.
    """

    def __init__(self, *, from_start: bool = False, tracked: Collection[str] | None = None) -> None:
        """``tracked``: the topics whose missing numbers are kept (None: the reliable
        ones). On the others a lost message is replaced by the next, and a late one is
        dropped as a duplicate: a restarted Core reading its log back kept every
        heartbeat left out of it as missing, 10000 a rank, never asked for."""
        self._from_start = from_start
        reliable = (t.value for t in RELIABLE_TOPICS)
        self._tracked = frozenset(reliable if tracked is None else tracked)
        self._high: dict[tuple[str, str], int] = {}
        self._missing: dict[tuple[str, str], dict[int, float]] = {}
        """(sender, topic) -> missing seq -> monotonic time it was first missed."""
        self._nonces: dict[str, str] = {}
        self.given_up = 0
        """Missing numbers abandoned because a gap grew past :data:`MAX_GAP`."""
        self.filled = 0
        """Missing numbers that arrived later (reordered, fetched or resent)."""

    def accept(self, sender: str, topic: str, seq: int) -> bool:
        """Record ``seq``; False when it was seen before (a duplicate)."""
        key = (sender, topic)
        high = self._high.get(key)
        if high is None:
            high = 0 if self._from_start else seq - 1
        if seq > high:
            self._open(key, high + 1, seq)
            self._high[key] = seq
            return True
        self._high[key] = high
        missing = self._missing.get(key)
        if missing is not None and seq in missing:
            del missing[seq]
            self.filled += 1
            return True
        return False

    def advertise(self, sender: str, topic: str, last: int) -> None:
        """``sender`` says its last ``seq`` on ``topic`` is ``last``."""
        key = (sender, topic)
        high = self._high.get(key)
        if high is None:
            if self._from_start:
                self._open(key, 1, last + 1)
            self._high[key] = last
        elif last > high:
            self._open(key, high + 1, last + 1)
            self._high[key] = last

    def restarted(self, sender: str, nonce: str) -> None:
        """A hello with a new ``nonce``: ``sender`` is a new process; count it from 1."""
        if self._nonces.get(sender, nonce) != nonce:
            for key in [k for k in self._high if k[0] == sender]:
                self._high[key] = 0
                self._missing.pop(key, None)
        self._nonces[sender] = nonce

    def forget(self, sender: str) -> None:
        """``sender`` is gone (its process exited): stop waiting for what it never sent
        or can no longer send again. Its numbers stay known, so late copies are dropped."""
        for key in [k for k in self._missing if k[0] == sender]:
            del self._missing[key]

    def open(self, topics: Collection[str]) -> bool:
        """Whether a number on ``topics`` is missing."""
        return any(missing for key, missing in self._missing.items() if key[1] in topics)

    def missing(
        self, topics: Iterable[str], *, older_than: float = 0.0
    ) -> dict[tuple[str, str], list[int]]:
        """Missing numbers on ``topics`` first missed at least ``older_than`` s ago."""
        wanted, now = set(topics), time.monotonic()
        gaps = {}
        for key, missing in self._missing.items():
            if key[1] in wanted:
                due = sorted(s for s, at in missing.items() if now - at >= older_than)
                if due:
                    gaps[key] = due
        return gaps

    def export(self) -> list[tuple[str, str, int, list[int]]]:
        """What it has seen: (sender, topic, highest number, missing numbers) of each
        (sender, topic) with a number seen or missing, as plain data (a restarted Core's
        restore point)."""
        seen = [
            (sender, topic, high, sorted(self._missing.get((sender, topic), ())))
            for (sender, topic), high in self._high.items()
        ]
        return [entry for entry in seen if entry[2] or entry[3]]

    @property
    def nonces(self) -> dict[str, str]:
        """Each sender's process, by the nonce of the hello it was last heard by."""
        return dict(self._nonces)

    def load(
        self, seen: Iterable[tuple[str, str, int, list[int]]], nonces: Mapping[str, str]
    ) -> None:
        """Take in what :meth:`export` and :attr:`nonces` gave (the missing numbers
        missed from now)."""
        self._nonces.update(nonces)
        now = time.monotonic()
        for sender, topic, high, missing in seen:
            self._high[(sender, topic)] = high
            if missing:
                self._missing[(sender, topic)] = dict.fromkeys(missing, now)

    def _open(self, key: tuple[str, str], start: int, stop: int) -> None:
        if start >= stop or key[1] not in self._tracked:
            return
        missing = self._missing.setdefault(key, {})
        now = time.monotonic()
        for seq in range(max(start, stop - MAX_GAP), stop):
            missing[seq] = now
        self.given_up += max(0, (stop - MAX_GAP) - start)
        while len(missing) > MAX_GAP:
            del missing[next(iter(missing))]  # the oldest: numbers are missed in order
            self.given_up += 1


class SentHistory:
    """A sender's last :data:`HISTORY` encoded messages per reliable topic."""

    def __init__(self, size: int = HISTORY) -> None:
        self._size = size
        self._sent: dict[str, collections.OrderedDict[int, list[bytes]]] = {}

    def add(self, topic: str, seq: int, frames: list[bytes]) -> None:
        sent = self._sent.setdefault(topic, collections.OrderedDict())
        sent[seq] = frames
        while len(sent) > self._size:
            sent.popitem(last=False)

    def get(self, topic: str, seqs: Iterable[int]) -> list[list[bytes]]:
        sent = self._sent.get(topic)
        if sent is None:
            return []
        return [sent[s] for s in seqs if s in sent]

    def recent(self, count: int) -> dict[str, list[int]]:
        """The last ``count`` numbers kept per topic."""
        return {topic: list(sent)[-count:] for topic, sent in self._sent.items() if sent}


@dataclass(frozen=True)
class BusFaults:
    """Faults a client injects into what it receives, for testing the protocol.

    Args:
        drop: probability that a message is discarded.
        duplicate: probability that a message is delivered twice.
        reorder: probability that a message is held back behind the next one.
        delay_s: every message is delivered after a uniform 0..``delay_s`` second wait.
        seed: the random stream (each client mixes in its own name).
    """

    drop: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    delay_s: float = 0.0
    seed: int = 0

    _NAMES = ("drop", "dup", "reorder", "delay", "seed")

    def __post_init__(self) -> None:
        for name in ("drop", "duplicate", "reorder"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"bus fault {name}={value!r}: must be a probability in [0, 1)")
            if not 0.0 <= value < 1.0:
                raise ValueError(f"bus fault {name}={value!r}: must be a probability in [0, 1)")
        if not 0.0 <= self.delay_s <= 5.0:
            raise ValueError(f"bus fault delay={self.delay_s!r}: must be 0 to 5 seconds")

    @property
    def active(self) -> bool:
        return bool(self.drop or self.duplicate or self.reorder or self.delay_s)

    @classmethod
    def parse(cls, text: str) -> BusFaults:
        """Read ``drop=P,dup=P,reorder=P,delay=SECONDS,seed=N`` (any subset, "" = none)."""
        values: dict[str, float] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, sep, raw = item.partition("=")
            if not sep or name not in cls._NAMES:
                raise ValueError(
                    f"bus fault {item!r}: expected NAME=VALUE with NAME one of "
                    f"{', '.join(cls._NAMES)} (e.g. drop=0.05,dup=0.02,reorder=0.05,delay=0.01)"
                )
            if name in values:
                raise ValueError(f"bus fault {name!r} given twice in {text!r}")
            try:
                values[name] = int(raw) if name == "seed" else float(raw)
            except ValueError:
                raise ValueError(f"bus fault {item!r}: {raw!r} is not a number") from None
        return cls(
            drop=values.get("drop", 0.0),
            duplicate=values.get("dup", 0.0),
            reorder=values.get("reorder", 0.0),
            delay_s=values.get("delay", 0.0),
            seed=int(values.get("seed", 0)),
        )

    def injector(self, name: str) -> FaultyLink:
        return FaultyLink(self, random.Random(f"{self.seed}/{name}"))


class FaultyLink:
    """Applies :class:`BusFaults` to a stream of received messages."""

    def __init__(self, faults: BusFaults, rng: random.Random) -> None:
        self.faults = faults
        self._rng = rng
        self._held: list[list[bytes]] = []
        self._due: list[tuple[float, int, list[bytes]]] = []
        self._order = itertools.count()
        self.counts = {"dropped": 0, "duplicated": 0, "reordered": 0, "delayed": 0}

    def feed(self, frames: list[bytes]) -> None:
        """Take one message off the socket."""
        f, rng = self.faults, self._rng
        if rng.random() < f.drop:
            self.counts["dropped"] += 1
            return
        copies = 2 if rng.random() < f.duplicate else 1
        self.counts["duplicated"] += copies - 1
        out = [frames] * copies
        if rng.random() < f.reorder:
            self.counts["reordered"] += 1
            self._held.extend(out)  # released after the next message
            return
        out, self._held = out + self._held, []
        for message in out:
            wait = rng.uniform(0.0, f.delay_s) if f.delay_s else 0.0
            self.counts["delayed"] += wait > 0
            heapq.heappush(self._due, (time.monotonic() + wait, next(self._order), message))

    def ready(self) -> list[list[bytes]]:
        """Messages whose delivery time has come, in delivery order."""
        now, out = time.monotonic(), []
        while self._due and self._due[0][0] <= now:
            out.append(heapq.heappop(self._due)[2])
        return out

    def next_due(self) -> float | None:
        """Seconds until the next held message is due (None: nothing held)."""
        if self._due:
            return max(0.0, self._due[0][0] - time.monotonic())
        return 0.05 if self._held else None

    def flush_held(self) -> None:
        """Release reordered messages that no later message has overtaken yet."""
        for message in self._held:
            heapq.heappush(self._due, (time.monotonic(), next(self._order), message))
        self._held = []
