"""Which records ``elaswave events`` prints: --kind and --rank."""

from __future__ import annotations

import pytest

from elaswave.bus.codec import encode
from elaswave.bus.eventlog import EventLogWriter, LogRecord, read_event_log
from elaswave.bus.schema import (
    FailureDetected,
    Heartbeat,
    PlanCommit,
    RecoveryPlan,
    StepCompleted,
)
from elaswave.cli.main import main
from elaswave.runtime.core.runlog import RecordFilter, parse_kinds, parse_ranks

EVENTS = [
    Heartbeat(sender="rank3", seq=1, rank=3, step=1),
    Heartbeat(sender="rank3.1", seq=1, rank=3, step=1),  # a TP member of rank 3
    StepCompleted(sender="rank5", seq=1, rank=5, step=1, loss=1, step_time_s=1, samples=2),
    FailureDetected(sender="core", seq=1, ranks=[3, 7], source="process-exit"),
    RecoveryPlan(sender="core", seq=2, failed=[7], committed_step=1, plan_digest="d", reason="r"),
    PlanCommit(sender="core", seq=3, plan_digest="d"),
]


def _records(tmp_path) -> list[LogRecord]:
    with EventLogWriter(tmp_path / "events.log") as log:
        for event in EVENTS:
            log.append(encode(event), 1.0)
        log.append([b"metrics/rank3", b"\xc1"], 2.0)  # not a valid event
    return list(read_event_log(tmp_path / "events.log"))


def _kinds(records) -> list[str]:
    return [r.event.KIND.value if r.event else "invalid" for r in records]


def test_a_filter_picks_kinds_and_the_ranks_an_event_is_about(tmp_path) -> None:
    records = _records(tmp_path)
    assert len(list(filter(RecordFilter(), records))) == 7
    by_kind = RecordFilter(kinds=frozenset({"failure_detected", "plan_commit"}))
    assert _kinds(filter(by_kind, records)) == ["failure_detected", "plan_commit"]
    rank3 = RecordFilter(ranks=frozenset({3}))
    assert _kinds(filter(rank3, records)) == ["heartbeat", "heartbeat", "failure_detected"]
    rank7 = RecordFilter(ranks=frozenset({7}))
    assert _kinds(filter(rank7, records)) == ["failure_detected", "recovery_plan"]
    both = RecordFilter(kinds=frozenset({"recovery_plan"}), ranks=frozenset({3}))
    assert _kinds(filter(both, records)) == []


def test_bad_kinds_and_ranks_are_named() -> None:
    assert parse_kinds("recovery_plan, plan_commit") == {"recovery_plan", "plan_commit"}
    with pytest.raises(ValueError, match=r"'recovery' is not an event kind; valid kinds: "):
        parse_kinds("recovery,plan_commit")
    with pytest.raises(ValueError, match="no kind is not an event kind"):
        parse_kinds(",")
    assert parse_ranks("1, 5,9") == {1, 5, 9}
    with pytest.raises(ValueError, match="--rank 'rank1': expected ranks as integers"):
        parse_ranks("rank1")


def test_elaswave_events_prints_what_is_asked_and_names_a_bad_kind(tmp_path, capsys) -> None:
    _records(tmp_path)
    assert main(["events", str(tmp_path), "--rank", "7", "--kind", "recovery_plan"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "Z  " in line]
    assert len(lines) == 1 and "recovery_plan" in lines[0]
    assert main(["events", str(tmp_path), "--kind", "plans"]) == 2
    assert "elaswave: error: --kind 'plans': 'plans' is not an event kind" in (
        capsys.readouterr().err
    )
