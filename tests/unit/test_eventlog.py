"""Event log: records survive a round trip, bad ones are reported, never raised."""

from __future__ import annotations

import math
import time
from pathlib import Path

import msgpack
import pytest

from elaswave.bus.codec import encode
from elaswave.bus.eventlog import EventLogWriter, LogRecord, format_record, read_event_log
from elaswave.bus.schema import Heartbeat, RecoveryStarted, StepCompleted, WorkerStarted

pytestmark = pytest.mark.timeout(30)

T0 = 1_795_356_181.123  # 2026-11-22T14:03:01.123Z


def _events() -> list:
    return [
        WorkerStarted(sender="rank3", seq=1, rank=3, stage=1, replica=1, pid=1234, host="node-a"),
        StepCompleted(sender="rank3", seq=2, rank=3, step=0, loss=2.5, step_time_s=0.1, samples=8),
        RecoveryStarted(sender="core", seq=1, generation=2, step=1, kind="fail", ranks=[3, 4],
                        reason="rank 3 exited"),
        Heartbeat(sender="rank3", seq=3, rank=3, step=1),
    ]  # fmt: skip


BAD_FRAMES = [b"metrics", b"\xc1 not msgpack"]


def _write_log(path: Path) -> list[list[bytes]]:
    messages = [encode(event) for event in _events()]
    messages.insert(2, BAD_FRAMES)
    with EventLogWriter(path) as log:
        for index, frames in enumerate(messages):
            log.append(frames, t=T0 + index)
        assert log.num_records == len(messages)
    return messages


def test_records_round_trip_with_bad_one_reported(tmp_path: Path) -> None:
    path = tmp_path / "events.msgpack"
    messages = _write_log(path)
    records = list(read_event_log(path))
    assert [r.frames for r in records] == messages
    assert [r.t for r in records] == [T0 + i for i in range(len(messages))]
    bad = records[2]
    assert bad.event is None
    assert bad.error is not None
    assert "undecodable msgpack" in bad.error
    good = [r for i, r in enumerate(records) if i != 2]
    assert [r.event for r in good] == _events()
    assert all(r.error is None for r in good)


def test_writer_appends_and_never_truncates(tmp_path: Path) -> None:
    path = tmp_path / "events.msgpack"
    _write_log(path)
    with EventLogWriter(path) as log:
        log.append(encode(_events()[0]))
    records = list(read_event_log(path))
    assert len(records) == len(_events()) + 2
    assert records[-1].event == _events()[0]
    assert abs(records[-1].t - time.time()) < 60  # t defaults to the wall clock


def test_append_after_close_raises(tmp_path: Path) -> None:
    log = EventLogWriter(tmp_path / "events.msgpack")
    log.close()
    log.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        log.append(encode(_events()[0]))


@pytest.mark.parametrize("cut", [1, 5, 20])
def test_truncated_tail_is_an_error_record(tmp_path: Path, cut: int) -> None:
    path = tmp_path / "events.msgpack"
    messages = _write_log(path)
    data = path.read_bytes()
    path.write_bytes(data[:-cut])
    records = list(read_event_log(path))
    assert [r.frames for r in records[:-1]] == messages[:-1]
    tail = records[-1]
    assert tail.event is None
    assert tail.error is not None
    assert "truncated final record" in tail.error
    assert math.isnan(tail.t)


def test_record_that_is_not_a_map_is_reported_and_reading_goes_on(tmp_path: Path) -> None:
    path = tmp_path / "events.msgpack"
    event = _events()[0]
    path.write_bytes(
        msgpack.packb([1, 2])
        + msgpack.packb({"t": "yesterday", "frames": []})
        + msgpack.packb({"t": T0, "frames": encode(event)})
    )
    records = list(read_event_log(path))
    assert len(records) == 3
    assert "is a list, not a map" in (records[0].error or "")
    assert "numeric 't'" in (records[1].error or "")
    assert records[2].event == event


def test_corrupt_bytes_stop_reading_with_an_error(tmp_path: Path) -> None:
    path = tmp_path / "events.msgpack"
    path.write_bytes(msgpack.packb({"t": T0, "frames": encode(_events()[0])}) + b"\xc1\xc1")
    records = list(read_event_log(path))
    assert records[0].event == _events()[0]
    assert len(records) == 2
    assert "corrupt event log at byte" in (records[1].error or "")


def test_empty_log_reads_as_nothing(tmp_path: Path) -> None:
    path = tmp_path / "events.msgpack"
    EventLogWriter(path).close()
    assert list(read_event_log(path)) == []


def test_format_record_lines(tmp_path: Path) -> None:
    path = tmp_path / "events.msgpack"
    _write_log(path)
    lines = [format_record(r) for r in read_event_log(path)]
    assert lines[0] == (
        "2026-11-22T14:03:01.123Z  lifecycle  worker_started  rank3#1 gen=0  "
        "rank=3 stage=1 replica=1 pid=1234 host=node-a"
    )
    assert lines[1].endswith("rank=3 step=0 loss=2.5 step_time_s=0.1 samples=8")
    assert lines[2].startswith("2026-11-22T14:03:03.123Z  metrics  INVALID: undecodable msgpack")
    assert lines[3] == (
        "2026-11-22T14:03:04.123Z  recovery  recovery_started  core#1 gen=2  "
        "step=1 kind=fail ranks=[3,4] reason='rank 3 exited'"
    )
    assert all("\n" not in line for line in lines)


def test_format_unreadable_record() -> None:
    record = LogRecord(t=math.nan, frames=[], event=None, error="truncated final record")
    assert format_record(record).endswith("?  INVALID: truncated final record")
