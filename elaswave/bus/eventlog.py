"""Append-only log of every message the bus delivered, for replay and for people.

The log stores what arrived, not what it meant: each record is the raw multipart frames
plus the wall-clock time they were received, so that invalid messages are kept too and
replaying the log feeds planners exactly the bytes they saw. A record is one msgpack
map, written with a single ``write`` and flushed at once::

    {"t": <receive time, seconds since the epoch>, "frames": [<bytes>, ...]}

The file is opened in append mode, so a crash loses at most the record being written;
:func:`read_event_log` reports such a truncated tail as an error record instead of
failing. :func:`format_record` renders one record as a line a person can grep.

Example::

    with EventLogWriter(run_dir / "events.msgpack") as log:
        message = await client.recv_raw()
        log.append(message.frames)

    for record in read_event_log(run_dir / "events.msgpack"):
        logger.info("event", line=format_record(record))
"""

from __future__ import annotations

import heapq
import math
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import MISSING, Field, dataclass, fields
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import msgpack
import structlog

from elaswave.bus.codec import decode
from elaswave.bus.schema import Event, SchemaError

logger = structlog.get_logger(__name__)

_BASE_FIELDS = frozenset(f.name for f in fields(Event))
_READ_CHUNK = 1 << 16


@dataclass(frozen=True, kw_only=True)
class LogRecord:
    """One record read back from an event log.

    Attributes:
        t: receive wall time in seconds since the epoch (``nan`` when the record itself
            is unreadable).
        frames: the raw multipart frames as received (empty when unreadable).
        event: the decoded event, or ``None`` when the frames are not a valid event.
        error: why the record or its frames could not be decoded; ``None`` when valid.
    """

    t: float
    frames: list[bytes]
    event: Event | None
    error: str | None


class EventLogWriter:
    """Append records to an event log file (created if missing, never truncated).

    Args:
        path: the log file.
        fsync: also ``os.fsync`` after each record (survives power loss, costs a disk
            round trip per record); flushing to the OS already survives a process crash.
    """

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = False) -> None:
        self.path = Path(path)
        self._fsync = fsync
        self._file = self.path.open("ab")
        self.num_records = 0
        self.position = self._file.tell()
        """The log's length in bytes: where the next record starts (a record's position
        is the length of the log once it is written, :meth:`append`)."""

    def append(self, frames: Sequence[bytes], t: float | None = None) -> int:
        """Append one message's frames, received at ``t`` (default: now); returns the
        record's position: the log's length in bytes once it is written."""
        if self._file.closed:
            raise ValueError(f"event log {self.path} is closed")
        record = {
            "t": time.time() if t is None else float(t),
            "frames": [bytes(frame) for frame in frames],
        }
        self._file.write(msgpack.packb(record, use_bin_type=True))
        self._file.flush()
        if self._fsync:
            os.fsync(self._file.fileno())
        self.num_records += 1
        self.position = self._file.tell()
        return self.position

    def close(self) -> None:
        """Flush and close the file. Idempotent."""
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def read_event_log(path: str | os.PathLike[str]) -> Iterator[LogRecord]:
    """Yield every record of an event log, in file order.

    Never raises for bad content: a record whose frames fail to decode has ``error`` set;
    a record that is not a ``{"t", "frames"}`` map, or bytes that are not msgpack at all,
    yield an error record (reading stops at the latter, since record boundaries are lost);
    a truncated final record is reported as an error record.
    """
    with Path(path).open("rb") as file:
        unpacker = msgpack.Unpacker(file, raw=False, use_list=True, read_size=_READ_CHUNK)
        offset = 0
        while True:
            try:
                obj = unpacker.unpack()
            except msgpack.OutOfData:
                break
            except Exception as exc:  # msgpack raises several types on corrupt input
                yield _unreadable(f"corrupt event log at byte {offset}: {type(exc).__name__}")
                return
            yield _to_record(obj, offset)
            offset = unpacker.tell()
        size = os.fstat(file.fileno()).st_size
    if offset < size:
        yield _unreadable(
            f"truncated final record at byte {offset} ({size - offset} of its bytes present)"
        )


def merge_by_time(*logs: Iterable[LogRecord]) -> Iterator[LogRecord]:
    """The records of several logs (each in receive order) in one receive order; an
    unreadable record (no time) stays after the record its log had before it."""
    keyed = [_keyed(log, index) for index, log in enumerate(logs)]
    for _key, record in heapq.merge(*keyed, key=lambda item: item[0]):
        yield record


def _keyed(log: Iterable[LogRecord], index: int) -> Iterator[tuple[tuple[float, int], LogRecord]]:
    last = -math.inf
    for record in log:
        if math.isfinite(record.t):
            last = max(last, record.t)
        yield (last, index), record


def _unreadable(error: str) -> LogRecord:
    return LogRecord(t=math.nan, frames=[], event=None, error=error)


def _to_record(obj: Any, offset: int) -> LogRecord:
    if not isinstance(obj, dict):
        return _unreadable(f"log record at byte {offset} is a {type(obj).__name__}, not a map")
    t, frames = obj.get("t"), obj.get("frames")
    if not (type(t) is int or type(t) is float) or not isinstance(frames, list):
        return _unreadable(f"log record at byte {offset} lacks a numeric 't' or a 'frames' list")
    if not all(type(frame) is bytes for frame in frames):
        return _unreadable(f"log record at byte {offset} has non-bytes frames")
    try:
        event = decode(frames)
    except SchemaError as exc:
        return LogRecord(t=float(t), frames=frames, event=None, error=str(exc))
    return LogRecord(t=float(t), frames=frames, event=event, error=None)


# --------------------------------------------------------------------------- formatting


def format_record(record: LogRecord) -> str:
    """Render a record as one line, for example::

    2026-11-22T14:03:01.123Z  lifecycle  worker_started  rank3#1 gen=0  rank=3 stage=1 ...
    2026-11-22T14:03:01.125Z  metrics  INVALID: undecodable msgpack payload (...)

    Fields with a default that hold it (most often fields appended to a schema that the
    sender did not need) are left out.
    """
    stamp = _format_time(record.t)
    event = record.event
    if event is None:
        topic = _topic_of(record.frames)
        return f"{stamp}  {topic}  INVALID: {record.error}"
    body = " ".join(
        f"{f.name}={_format_value(getattr(event, f.name))}"
        for f in fields(event)
        if f.name not in _BASE_FIELDS and not _at_default(f, getattr(event, f.name))
    )
    return (
        f"{stamp}  {event.TOPIC.value}  {event.KIND.value}  "
        f"{event.sender}#{event.seq} gen={event.generation}  {body}"
    )


def _at_default(field: Field[Any], value: object) -> bool:
    if field.default is not MISSING:
        return bool(value == field.default)
    if field.default_factory is not MISSING:
        return bool(value == field.default_factory())
    return False


def _format_time(t: float) -> str:
    if not math.isfinite(t):
        return "-" * len("2026-11-22T14:03:01.123Z")
    moment = datetime.fromtimestamp(t, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def _topic_of(frames: list[bytes]) -> str:
    if not frames:
        return "?"
    try:
        return frames[0].decode()
    except UnicodeDecodeError:
        return repr(frames[0])


def _format_value(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, str):
        return value if value and not any(c.isspace() or c == "=" for c in value) else repr(value)
    if isinstance(value, list):
        return "[" + ",".join(_format_value(item) for item in value) + "]"
    return str(value)
