"""A log that keeps its newest records only: segments of a bounded size, the oldest dropped.

The Core's event log (:mod:`elaswave.bus.eventlog`) keeps every record it is given for
the run's life, since restore, replay and the summary read it back. The liveness and
timing chatter (every rank's heartbeats and step timings, every node agent's heartbeats)
is read back by none of them and was most of a steady job's log (1.2 GB a day at 64
ranks and a step a second); a person debugging a recovery wants its recent past. It goes
to a rolling log instead: a directory of numbered segments in the event log's record
format, a new one begun when the current one holds ``segment_bytes`` and, at each start
(a restarted Core never appends to a segment its predecessor may have cut short), the
oldest removed so that the directory stays within ``keep_bytes``::

    RUN_DIR/health/000000.log  000001.log  ...  000041.log  (the newest last)

Example::

    with RollingLogWriter(run_dir / "health", keep_bytes=256 << 20) as log:
        log.append(message.frames)

    for record in read_rolling_log(run_dir / "health"):
        print(format_record(record))
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

import structlog

from elaswave.bus.eventlog import EventLogWriter, LogRecord, read_event_log

logger = structlog.get_logger(__name__)

SEGMENT_NAME = re.compile(r"^(\d{6,})\.log$")
"""A segment's file name: its number (six digits or more), oldest first."""
MIN_KEEP_BYTES = 1 << 20
"""The least a rolling log may keep."""
SEGMENTS = 8
"""A segment is this fraction of what the log keeps: once full, the log holds 3/4 of
its bound at least (a closed segment passes its size by part of a record) and at most
all of it and one record."""


def segments(directory: Path) -> list[Path]:
    """The log's segments, oldest first (other files in the directory are not its)."""
    if not directory.is_dir():
        return []
    numbered = [
        (int(match[1]), path)
        for path in directory.iterdir()
        if (match := SEGMENT_NAME.match(path.name)) is not None and path.is_file()
    ]
    return [path for _, path in sorted(numbered)]


def removed(directory: str | os.PathLike[str]) -> int:
    """How many of the log's oldest segments were removed to keep its bound (segments
    are numbered from 0, and a writer continues the numbering)."""
    kept = segments(Path(directory))
    return _number(kept[0]) if kept else 0


def read_rolling_log(directory: str | os.PathLike[str]) -> Iterator[LogRecord]:
    """Every record the log keeps, oldest first (:func:`~elaswave.bus.eventlog.read_event_log`
    on each segment: a segment cut short by a crash yields an error record at its end).
    A segment removed while it is read (the writer keeps the log within its bound) is
    skipped."""
    for path in segments(Path(directory)):
        try:
            yield from read_event_log(path)
        except FileNotFoundError:
            continue


class RollingLogWriter:
    """Append records to a rolling log, keeping it within ``keep_bytes``.

    Args:
        directory: the log's directory (created if missing).
        keep_bytes: the most the segments may hold together (at least
            :data:`MIN_KEEP_BYTES`).
        segment_bytes: the size at which a segment is closed and the next begun
            (default and at most: ``keep_bytes`` / :data:`SEGMENTS`).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep_bytes: int,
        segment_bytes: int | None = None,
    ) -> None:
        if keep_bytes < MIN_KEEP_BYTES:
            raise ValueError(
                f"a rolling log keeping {keep_bytes} bytes: it must keep at least {MIN_KEEP_BYTES}"
            )
        self.directory = Path(directory)
        self.keep_bytes = keep_bytes
        most = keep_bytes // SEGMENTS
        self.segment_bytes = min(segment_bytes or most, most)
        self.removed = 0
        """Segments removed to keep the bound."""
        self.directory.mkdir(parents=True, exist_ok=True)
        existing = segments(self.directory)
        self._number = _number(existing[-1]) + 1 if existing else 0
        self._writer = self._open()

    def _open(self) -> EventLogWriter:
        """Begin segment ``self._number``, the older ones pruned to leave room for it."""
        current = self.directory / f"{self._number:06d}.log"
        self._prune(current)
        return EventLogWriter(current)

    def append(self, frames: Sequence[bytes], t: float | None = None) -> None:
        """Append one message's frames, received at ``t`` (default: now)."""
        self._writer.append(frames, t)
        if self._writer.position >= self.segment_bytes:
            self._writer.close()
            self._number += 1
            self._writer = self._open()

    def _prune(self, current: Path) -> None:
        """Remove the oldest segments until they and a whole ``current`` one fit within
        the bound."""
        older = [p for p in segments(self.directory) if p != current]
        sizes = [_size(p) for p in older]
        while older and sum(sizes) + self.segment_bytes > self.keep_bytes:
            path = older.pop(0)
            sizes.pop(0)
            try:
                path.unlink()
            except FileNotFoundError:
                continue
            except OSError as exc:  # logged and kept: the job goes on
                logger.warning("rolling_log.remove_failed", path=str(path), error=str(exc))
                return
            self.removed += 1

    def close(self) -> None:
        """Flush and close the current segment. Idempotent."""
        self._writer.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _number(path: Path) -> int:
    match = SEGMENT_NAME.match(path.name)
    assert match is not None, path
    return int(match[1])


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0
