"""The rolling log keeps its newest records within its bound, oldest first when read."""

from __future__ import annotations

import math

import pytest

from elaswave.bus.codec import encode
from elaswave.bus.eventlog import EventLogWriter, LogRecord, merge_by_time, read_event_log
from elaswave.bus.rolling import (
    MIN_KEEP_BYTES,
    SEGMENTS,
    RollingLogWriter,
    read_rolling_log,
    removed,
    segments,
)
from elaswave.bus.schema import StepTiming
from elaswave.cli.main import main


def _timing(step: int) -> list[bytes]:
    return encode(
        StepTiming(sender="rank0", rank=0, step=step, compute_s=1, expected_s=1, micro_batches=2)
    )


def _steps(records) -> list[int]:
    return [r.event.step for r in records]


def test_the_log_keeps_its_newest_records_within_its_bound(tmp_path) -> None:
    """Written far past its bound, the log holds at most ``keep_bytes`` (and a record),
    at least 3/4 of it, every record from the oldest kept to the newest, in order."""
    record = sum(map(len, _timing(0))) + 32  # the record's map around the frames
    with RollingLogWriter(tmp_path / "h", keep_bytes=MIN_KEEP_BYTES) as log:
        for step in range(30_000):
            log.append(_timing(step), t=float(step))
            held = sum(p.stat().st_size for p in segments(tmp_path / "h"))
            assert held <= MIN_KEEP_BYTES + record
        assert log.removed > 0
    assert held >= MIN_KEEP_BYTES * (SEGMENTS - 2) // SEGMENTS
    steps = _steps(read_rolling_log(tmp_path / "h"))
    assert steps == list(range(steps[0], 30_000))
    assert len(segments(tmp_path / "h")) <= SEGMENTS + 1


def test_a_new_writer_begins_a_segment_after_the_last(tmp_path) -> None:
    """A restarted Core never appends to a segment its predecessor may have cut short:
    a torn record stays the end of that segment, reported, and the records after it
    are read from the next."""
    with RollingLogWriter(tmp_path / "h", keep_bytes=MIN_KEEP_BYTES) as log:
        log.append(_timing(0), t=1.0)
        log.append(_timing(1), t=2.0)
    first = segments(tmp_path / "h")[-1]
    first.write_bytes(first.read_bytes()[:-5])  # the predecessor killed mid-record
    with RollingLogWriter(tmp_path / "h", keep_bytes=MIN_KEEP_BYTES) as log:
        log.append(_timing(2), t=3.0)
    assert [p.name for p in segments(tmp_path / "h")] == ["000000.log", "000001.log"]
    records = list(read_rolling_log(tmp_path / "h"))
    assert [r.event.step if r.event else None for r in records] == [0, None, 2]
    assert "truncated final record" in str(records[1].error)


def test_only_numbered_segments_are_the_logs(tmp_path) -> None:
    (tmp_path / "h").mkdir()
    (tmp_path / "h" / "notes.txt").write_text("mine")
    (tmp_path / "h" / "000009.log.tmp").write_text("x")
    with RollingLogWriter(tmp_path / "h", keep_bytes=MIN_KEEP_BYTES) as log:
        log.append(_timing(0))
    assert [p.name for p in segments(tmp_path / "h")] == ["000000.log"]
    assert (tmp_path / "h" / "notes.txt").exists()
    assert list(read_rolling_log(tmp_path / "missing")) == []


def test_a_bound_below_the_least_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match=f"must keep at least {MIN_KEEP_BYTES}"):
        RollingLogWriter(tmp_path / "h", keep_bytes=1000)


def test_logs_merge_in_receive_order_an_unreadable_record_after_its_predecessor(
    tmp_path,
) -> None:
    def record(t: float, step: int = -1) -> LogRecord:
        if math.isnan(t):
            return LogRecord(t=t, frames=[], event=None, error="torn")
        path = tmp_path / f"{step}.log"
        with EventLogWriter(path) as log:
            log.append(_timing(step), t)
        return next(read_event_log(path))

    events = [record(1.0, 1), record(4.0, 4), record(math.nan)]
    health = [record(2.0, 2), record(3.0, 3), record(5.0, 5)]
    merged = list(merge_by_time(events, health))
    assert [r.event.step if r.event else "torn" for r in merged] == [1, 2, 3, 4, "torn", 5]


def test_elaswave_events_says_when_the_health_log_dropped_its_oldest(tmp_path, capsys) -> None:
    EventLogWriter(tmp_path / "events.log").close()
    with RollingLogWriter(tmp_path / "health", keep_bytes=MIN_KEEP_BYTES) as log:
        log.append(_timing(0))
    assert main(["events", str(tmp_path)]) == 0
    assert "oldest segment" not in capsys.readouterr().err
    with RollingLogWriter(tmp_path / "health", keep_bytes=MIN_KEEP_BYTES) as log:
        for step in range(10_000):
            log.append(_timing(step))
        gone = log.removed
    assert gone > 0 and removed(tmp_path / "health") == gone
    assert main(["events", str(tmp_path)]) == 0
    assert f"health log's {gone} oldest segment(s) were removed" in capsys.readouterr().err
    assert main(["events", "--no-health", str(tmp_path)]) == 0
    assert "oldest segment" not in capsys.readouterr().err
