"""The record of a change (summary.json's ``recoveries`` entries): written with exactly
the keys and values summary.json holds, in their order, and read back equal."""

from __future__ import annotations

import dataclasses
import json

import pytest

from elaswave.bus.schema import RecoveryKind
from elaswave.engine.migration import MigrationDecision, MigrationMode
from elaswave.engine.plan import initial_plan, plan_summary
from elaswave.engine.record import (
    MigrationRecord,
    PhaseTimes,
    PlannedRecovery,
    PlanSummary,
    RecoveryRecord,
    Streamed,
    record_from_json,
    record_to_json,
    recorded,
)
from elaswave.engine.schedule import Schedule

PLAN = initial_plan(num_layers=6, dp=2, pp=2, global_batch=8, micro_batch=1)


def sample_record(**changes: object) -> RecoveryRecord:
    """A recorded fail-stop of rank 1 (no layer moves)."""
    planned = PlannedRecovery(
        step=4,
        kind=RecoveryKind.FAIL_STOP,
        ranks=(1,),
        generation=1,
        committed_step=3,
        reason="stage 0: ranks [1] failed",
        superseded=0,
        migration=MigrationRecord(decision=MigrationDecision(mode=MigrationMode.NONE, layers=())),
        plan=PlanSummary.of(PLAN),
        joined=(),
    )
    times = PhaseTimes(detect=0.03, plan=0.02, ack=0.01, comm=0.001, remap=0.02, resume=0.03)
    record = recorded(
        planned, mttr_s=0.2, phases=times, bytes_moved=615936, params_s=0.01, communicators=5
    )
    return dataclasses.replace(record, **changes)


def test_a_record_is_written_exactly_as_summary_json_holds_it() -> None:
    doc = record_to_json(sample_record())
    assert doc == {
        "step": 4,
        "kind": "fail-stop",
        "ranks": [1],
        "generation": 1,
        "committed_step": 3,
        "reason": "stage 0: ranks [1] failed",
        "superseded": 0,
        "migration": {"mode": "none", "layers": []},
        "plan": json.loads(json.dumps(plan_summary(PLAN))),
        "joined": [],
        "mttr_s": 0.2,
        "phases": {
            "detect": 0.03,
            "plan": 0.02,
            "ack": 0.01,
            "comm": 0.001,
            "remap": 0.02,
            "resume": 0.03,
            "redo": None,
        },
        "bytes_moved": 615936,
        "params_s": 0.01,
        "communicators": 5,
    }
    assert list(doc) == [
        "step", "kind", "ranks", "generation", "committed_step", "reason", "superseded",
        "migration", "plan", "joined", "mttr_s", "phases", "bytes_moved", "params_s",
        "communicators",
    ]  # fmt: skip
    assert type(doc["kind"]) is str and type(doc["migration"]["mode"]) is str


def test_a_wait_and_a_streamed_migration_take_their_places() -> None:
    decision = MigrationDecision(mode=MigrationMode.NONBLOCKING, layers=(3,), early_micro_batches=0)
    streamed = Streamed(bytes_streamed=377856, waited_s=0.0012)
    record = sample_record(
        waited_s=0.04, migration=MigrationRecord(decision=decision, streamed=streamed)
    )
    doc = record_to_json(record)
    assert list(doc)[9:12] == ["joined", "waited_s", "mttr_s"]
    assert doc["migration"] == {
        "mode": "nonblocking",
        "layers": [3],
        "early_micro_batches": 0,
        "bytes_streamed": 377856,
        "waited_s": 0.0012,
    }
    blocking = MigrationDecision(mode=MigrationMode.BLOCKING, layers=(2, 3), why="asked")
    doc = record_to_json(sample_record(migration=MigrationRecord(decision=blocking)))
    assert doc["migration"] == {"mode": "blocking", "layers": [2, 3], "why": "asked"}


@pytest.mark.parametrize(
    "record",
    [
        sample_record(),
        sample_record(waited_s=1.5, joined=(4,), kind=RecoveryKind.JOIN),
        sample_record(phases=dataclasses.replace(sample_record().phases, redo=0.3), mttr_s=1),
        sample_record(
            migration=MigrationRecord(
                decision=MigrationDecision(
                    mode=MigrationMode.NONBLOCKING, layers=(3,), early_micro_batches=2
                ),
                streamed=Streamed(bytes_streamed=10, waited_s=0),
            )
        ),
    ],
)
def test_a_record_reads_back_equal(record: RecoveryRecord) -> None:
    doc = json.loads(json.dumps(record_to_json(record)))
    assert record_from_json(doc) == record
    assert json.dumps(record_to_json(record_from_json(doc))) == json.dumps(doc)


def test_a_plan_summary_is_the_plan_s_summary() -> None:
    plan = dataclasses.replace(
        PLAN, stages=(dataclasses.replace(PLAN.stages[0], mhz=1595.3125), *PLAN.stages[1:])
    )
    doc = record_to_json(sample_record(plan=PlanSummary.of(plan)))
    assert doc["plan"] == json.loads(json.dumps(plan_summary(plan)))


def test_a_plan_summary_carries_the_plan_s_schedule() -> None:
    plan = dataclasses.replace(PLAN, schedule=Schedule.ZB_COST)
    summary = PlanSummary.of(plan)
    assert summary.schedule is Schedule.ZB_COST
    doc = json.loads(json.dumps(record_to_json(sample_record(plan=summary))))
    assert doc["plan"]["schedule"] == "zb-cost"
    assert record_from_json(doc).plan.schedule is Schedule.ZB_COST
    del doc["plan"]["schedule"]  # a summary.json written before schedules were recorded
    assert record_from_json(doc).plan.schedule is None


def test_a_malformed_record_is_one_clear_error() -> None:
    doc = record_to_json(sample_record())
    with pytest.raises(ValueError, match="malformed recovery record"):
        record_from_json({k: v for k, v in doc.items() if k != "phases"})
    with pytest.raises(ValueError, match="malformed recovery record"):
        record_from_json({**doc, "mttr_s": "fast"})


def test_a_record_written_before_communicators_were_reported_reads_as_none_reported() -> None:
    doc = json.loads(json.dumps(record_to_json(sample_record())))
    del doc["communicators"]
    assert record_from_json(doc) == sample_record(communicators=0)
