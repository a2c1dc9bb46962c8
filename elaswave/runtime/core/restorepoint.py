"""Restore points: what a restarted Core needs of its predecessor's event log up to a
position, in one file (RUN_DIR/core_restore.msgpack), so that it reads back only the log
after it.

A restarted Core rebuilds its state from the log: the numbers it has seen of every
sender (:class:`~elaswave.bus.reliable.SeqTracker`), the messages its log service keeps
(:class:`~elaswave.bus.logservice.LogIndex`), the ranks it watches, and the records the
supervisor reads again (:class:`Kept`: the Core's announcements, the workers' and the
run's ends, every scale request, and the protocol's events its persisted state has not
taken in; the fail-slow watch, which a restarted Core starts afresh, is given the step
timings among those). Read from the whole log that costs some 10 us a record: 43 s
after 9 hours of a 64-rank job at a step a second (scripts/bench_core_restore.py), while
the workers pause once the Core has been silent for ``core_outage_s`` (10 s by
default). The Core writes a point each time its log has grown by :data:`RESTORE_EVERY`
bytes, or by twice the last point's size if more, so a restart reads one point and at
most that much log: under 2 s at 64 ranks, at any length.

A point names the log's bytes just before its position (:data:`TAIL_BYTES`); a restarted
Core uses it only where the log holds those bytes there (the same log, not cut short
before it), and only if it holds every protocol event the persisted state has not taken
in (``pending_from``). Otherwise, or when the file is unreadable or of another version,
it reads the whole log, as without a point (and logs why).
"""

from __future__ import annotations

import collections
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from elaswave.bus.schema import (
    Event,
    FailureDetected,
    PauseRequest,
    PlanCommit,
    RecoveryPlan,
    RunFinished,
    ScaleRequest,
    WorkerFinished,
)
from elaswave.runtime.core.observe import takes

VERSION = 1
"""The restore point format this Core writes and reads."""

RESTORE_EVERY = 32 << 20
"""Bytes of event log between restore points (at least: twice the last point's size,
so that writing points costs at most half as many bytes as the log)."""

TAIL_BYTES = 64
"""Bytes of the log before a point's position that the point holds, to check it is of
the same log."""

RECENT_FRAMES = 64
"""Of each (sender, topic) of a process other than the Core, the messages whose frames a
point keeps for the log service (the newest; of the rest of the 1024 kept, their
numbers, which a sender's flush checks). Receivers ask for a gap within a second of it;
with every frame kept a point held 1024 metrics messages a rank: 218 MiB at 1000 ranks,
5 s to read back."""


@dataclass(frozen=True)
class Kept:
    """A log record a successor takes in again: its frames, arrival time and position."""

    frames: list[bytes]
    t: float
    position: int


@dataclass(frozen=True)
class RestorePoint:
    """The Core's state read back from its log up to ``position``."""

    position: int
    """The log's length in bytes that the point covers."""
    tail: bytes
    """The log's last :data:`TAIL_BYTES` bytes before ``position`` (fewer when shorter)."""
    records: int
    """The log's records up to ``position``."""
    seen: list[tuple[str, str, int, list[int]]]
    """The Core's tracker (:meth:`~elaswave.bus.reliable.SeqTracker.export`)."""
    nonces: dict[str, str]
    """Each sender's process as the tracker knows it (a later hello with another nonce
    is a new process, numbered from 1)."""
    index: list[tuple[str, str, list[int], list[tuple[int, list[bytes]]]]]
    """The log service's messages (:meth:`~elaswave.bus.logservice.LogIndex.export`)."""
    watched: list[tuple[int, list[str]]]
    """Each rank whose silence the Core times, and the senders that beat for it."""
    kept: list[Kept]
    """The records read again, in log order."""
    pending_from: int
    """Every protocol event after this position is in ``kept`` (the position the
    supervisor's persisted state had taken in when the point was taken)."""


def write_point(path: Path, point: RestorePoint) -> int:
    """Write ``point`` (atomically: a successor reads the last whole one); its size."""
    body = msgpack.packb(
        {
            "version": VERSION,
            "position": point.position,
            "tail": point.tail,
            "records": point.records,
            "seen": point.seen,
            "nonces": point.nonces,
            "index": point.index,
            "watched": point.watched,
            "kept": [[k.frames, k.t, k.position] for k in point.kept],
            "pending_from": point.pending_from,
        },
        use_bin_type=True,
    )
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(body)
    os.replace(tmp, path)
    return len(body)


def log_tail(log_path: Path, position: int) -> bytes:
    """The log's :data:`TAIL_BYTES` bytes before ``position`` (b"" past its end)."""
    with log_path.open("rb") as file:
        start = max(0, position - TAIL_BYTES)
        file.seek(start)
        tail = file.read(position - start)
    return tail if len(tail) == position - start else b""


def read_point(path: Path, log_path: Path, taken: int) -> tuple[RestorePoint | None, str]:
    """The point at ``path`` if a Core restoring from ``log_path`` with a persisted state
    that has taken in position ``taken`` can use it; else None and why not ("" when
    there is none)."""
    if not path.exists():
        return None, ""
    try:
        point = _parse(msgpack.unpackb(path.read_bytes(), raw=False, strict_map_key=False))
    except Exception as exc:  # any malformed content: the log is read whole instead
        return None, f"unreadable ({type(exc).__name__}: {exc})"
    if point is None:
        return None, "of another version"
    try:
        tail = log_tail(log_path, point.position)
    except OSError as exc:
        return None, f"the log is not readable ({exc})"
    if not point.tail or tail != point.tail:
        return None, f"the log does not hold the point's bytes before {point.position}"
    if taken < point.pending_from:
        return None, (
            f"the persisted state has taken in the log up to {taken}, and the point "
            f"holds the protocol's events after {point.pending_from} only"
        )
    return point, ""


def _parse(doc: Any) -> RestorePoint | None:
    """The point a decoded file holds; None for another version; raises if malformed."""
    if doc.get("version") != VERSION:
        return None
    position = doc["position"]
    if type(position) is not int or position <= 0:
        raise ValueError(f"position {position!r}")
    return RestorePoint(
        position=position,
        tail=bytes(doc["tail"]),
        records=int(doc["records"]),
        seen=[(str(s), str(t), int(h), [int(m) for m in miss]) for s, t, h, miss in doc["seen"]],
        nonces={str(sender): str(nonce) for sender, nonce in doc["nonces"].items()},
        index=[
            (
                str(s),
                str(t),
                [int(seq) for seq in numbers],
                [(int(seq), [bytes(f) for f in fr]) for seq, fr in framed],
            )
            for s, t, numbers, framed in doc["index"]
        ],
        watched=[(int(rank), [str(s) for s in senders]) for rank, senders in doc["watched"]],
        kept=[Kept([bytes(f) for f in fr], float(t), int(p)) for fr, t, p in doc["kept"]],
        pending_from=int(doc["pending_from"]),
    )


MAX_PENDING = 1 << 16
"""Protocol events :class:`Carried` holds that the supervisor's persisted state has not
taken in (it persists at least once a step); past this the oldest go, and a point
taken then serves only a successor whose state has taken them in."""

_ANNOUNCED = (FailureDetected, PauseRequest, RecoveryPlan, PlanCommit)


class Carried:
    """The records of the log a successor takes in again (:class:`Kept`), kept as the
    log grows: the Core's (``owner``'s) announcements, every scale request, the latest
    end of each worker and of the run, and the protocol's events after the position the
    supervisor's persisted state has taken in (:meth:`taken`)."""

    def __init__(self, owner: str, max_pending: int = MAX_PENDING) -> None:
        self._owner = owner
        self._max_pending = max_pending
        self._lasting: dict[int, Kept] = {}
        """position -> every record kept for good, or until a later one replaces it."""
        self._ends: dict[int | None, int] = {}
        """rank (None: the run) -> the position of its latest end in ``_lasting``."""
        self._pending: collections.deque[Kept] = collections.deque()
        self._taken = 0
        """The position the persisted state has taken in (:meth:`taken`)."""
        self._dropped = 0
        """The newest position dropped from ``_pending`` before it was taken in."""

    def add(self, event: Event, frames: Sequence[bytes], t: float, position: int) -> None:
        """Keep the record of ``event`` at ``position`` if a successor needs it."""
        record = Kept(list(frames), t, position)
        if takes(event) and position > self._taken:
            self._pending.append(record)
            if len(self._pending) > self._max_pending:
                self._dropped = self._pending.popleft().position
        if isinstance(event, WorkerFinished | RunFinished):
            key = event.rank if isinstance(event, WorkerFinished) else None
            if (old := self._ends.get(key)) is not None:
                del self._lasting[old]
            self._ends[key] = position
            self._lasting[position] = record
        elif isinstance(event, ScaleRequest) or (
            event.sender == self._owner and isinstance(event, _ANNOUNCED)
        ):
            self._lasting[position] = record

    def taken(self, position: int) -> None:
        """The persisted state has taken in the protocol's events up to ``position``."""
        self._taken = max(self._taken, position)
        while self._pending and self._pending[0].position <= position:
            self._pending.popleft()

    def records(self, taken: int) -> tuple[list[Kept], int]:
        """The records kept, in log order, and the position after which they hold
        every protocol event (``taken``, unless events after it were dropped)."""
        self.taken(taken)
        merged = {**self._lasting, **{k.position: k for k in self._pending}}
        return [merged[p] for p in sorted(merged)], max(taken, self._dropped)
