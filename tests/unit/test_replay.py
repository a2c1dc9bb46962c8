"""Replay: a run's recovery plans recomputed from its event log.

Every training run of the fault and e2e suites is replayed by ``tests.runs.train`` (each
plan must come out byte for byte). These tests give replay logs it must not accept:
a planner that changed since the run, a tampered announcement, a missing report, and
inputs that are not a run.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from elaswave.bus.codec import encode
from elaswave.bus.eventlog import EventLogWriter
from elaswave.bus.schema import FailureDetected, PlanCommit, RecoveryPlan, RecoveryReady
from elaswave.engine import rebalance as rebalance_module
from elaswave.engine.plan_inputs import decode
from elaswave.engine.recovery import plan_digest
from elaswave.engine.replan import plan_fail_stop
from elaswave.runtime.core.replay import replay_run
from elaswave.runtime.job.config import Endpoints, JobConfig, JobSpec
from elaswave.runtime.job.inputs import announced_rebalancing, decide_migration
from elaswave.runtime.job.sections import ElasticConfig, LayoutConfig, ScheduleConfig
from tests.runs import elaswave

CFG = JobConfig(
    layout=LayoutConfig(dp=3, pp=2),
    schedule=ScheduleConfig(global_batch=24, micro_batch=1, pipeline_schedule="1f1b"),
    elastic=ElasticConfig(rebalance="migrate"),
)
"""A job whose plan after losing rank 1 takes rotation blocks of 2 under 1F1B (pinned:
the default, auto, would plan other lists and other blocks)."""


def _announce(plan, failed: list[int], step: int, policy: str = "migrate"):
    """The events a Core logs for one fail-stop: detection, reports, the plan."""
    survivors = sorted(set(plan.ranks) - set(failed))
    draft = RecoveryPlan(sender="core", generation=plan.generation + 1, failed=failed,
                         committed_step=0, plan_digest="", reason="", policy=policy)  # fmt: skip
    decision = plan_fail_stop(
        plan, failed, dict.fromkeys(survivors, step), ranks_per_node=1, snapshots=True,
        rebalancing=announced_rebalancing(CFG, decode(draft)),
    )  # fmt: skip
    detected = FailureDetected(
        sender="core", generation=plan.generation, ranks=failed, source="process-exit"
    )
    reports = [
        RecoveryReady(sender=f"rank{r}", generation=plan.generation, rank=r, committed_step=step)
        for r in survivors
    ]
    announced = dataclasses.replace(
        draft, committed_step=decision.committed_step, plan_digest=plan_digest(decision.plan),
        reason=decision.reason,
        migration=str(decide_migration(CFG, plan, decision.plan, (), ()).mode),
    )  # fmt: skip
    events = [detected, *reports, announced]
    return events, decision.plan


def _run_dir(tmp_path: Path, events, config: JobConfig = CFG) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    JobSpec(run_id="test", config=config, endpoints=Endpoints(store_host="127.0.0.1",
            store_port=1, bus_publish="tcp://127.0.0.1:1", bus_subscribe="tcp://127.0.0.1:2"),
    ).write(tmp_path)  # fmt: skip
    with EventLogWriter(tmp_path / "events.log") as log:
        for seq, event in enumerate(events, 1):
            log.append(encode(dataclasses.replace(event, seq=seq, time=1.0 + seq)))
    return tmp_path


def _two_failures():
    first, plan = _announce(CFG.plan(), [1], 2)
    second, _ = _announce(plan, [4], 3)
    return first + second


def test_a_consistent_log_replays_every_plan(tmp_path):
    result = replay_run(_run_dir(tmp_path, _two_failures()))
    assert [p.generation for p in result.plans] == [1, 2] and result.diverged is None
    assert all(p.digest == p.replayed_digest for p in result.plans)
    # The first plan rotates in blocks: replay reproduces the block choice too.
    assert _announce(CFG.plan(), [1], 2)[1].stages[0].block == 2
    proc = elaswave("replay", str(tmp_path), timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "generation 1, fail-stop of ranks [1]: plan" in proc.stdout
    assert "2 plan(s) reproduced byte for byte" in proc.stdout


def test_a_planner_that_changed_since_the_run_diverges_at_its_first_plan(tmp_path, monkeypatch):
    run_dir = _run_dir(tmp_path, _two_failures())
    monkeypatch.setattr(rebalance_module, "ROTATION_BLOCKS", (1,))  # the planner changed
    result = replay_run(run_dir)
    bad = result.diverged
    assert bad is not None and bad.generation == 1 and len(result.plans) == 1
    assert any(p.startswith("plan digest: announced") for p in bad.problems), bad.problems
    assert "failure_detected" in (bad.cause or "") and "ranks=[1]" in (bad.cause or "")
    assert "recovery_plan" in bad.event


def test_a_tampered_announcement_is_named_with_its_cause(tmp_path):
    events = _two_failures()
    events[-1] = dataclasses.replace(events[-1], committed_step=1, plan_digest="0" * 16)
    proc = elaswave("replay", str(_run_dir(tmp_path, events)), timeout=60)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "generation 1, fail-stop of ranks [1]: plan" in proc.stdout
    assert "generation 2, fail-stop of ranks [4]: DIVERGES" in proc.stdout
    assert f"plan digest: announced {'0' * 16}, replayed" in proc.stdout
    assert "committed step: announced 1, replayed 3" in proc.stdout
    assert "caused by:" in proc.stdout and "ranks=[4]" in proc.stdout
    assert "the plan of generation 2 diverges (1 reproduced before it)" in proc.stderr


def test_a_migration_mode_other_than_the_decided_one_diverges(tmp_path):
    """The Core decides once how layers move and announces it; workers follow it, so
    replay checks it like the plan itself."""
    events = _two_failures()
    first = next(e for e in events if isinstance(e, RecoveryPlan))
    assert first.migration == "none", first  # no layer moves in this change
    events[events.index(first)] = dataclasses.replace(first, migration="nonblocking")
    bad = replay_run(_run_dir(tmp_path, events)).diverged
    assert bad is not None and bad.generation == 1
    assert bad.problems == ("migration: announced 'nonblocking', replayed 'none'",)


def test_a_plan_not_from_the_core_is_skipped_and_named(tmp_path):
    events = _two_failures()
    forged = dataclasses.replace(events[-1], sender="rank2", plan_digest="f" * 16)
    events.insert(len(events) - 1, forged)  # before the Core's own announcement
    result = replay_run(_run_dir(tmp_path, events))
    assert result.diverged is None and [p.generation for p in result.plans] == [1, 2]
    (skipped,) = result.ignored
    assert "rank2" in skipped and "f" * 16 in skipped


def test_a_missing_report_is_an_input_problem_not_a_crash(tmp_path):
    events = [e for e in _two_failures() if not (isinstance(e, RecoveryReady) and e.rank == 2)]
    result = replay_run(_run_dir(tmp_path, events))
    bad = result.diverged
    assert bad is not None and bad.generation == 1 and bad.replayed_digest is None
    assert "no committed step reported by surviving ranks [2]" in bad.problems[0]


def test_a_run_on_a_keyed_bus_replays_where_its_keys_are_not(tmp_path):
    """Replay reads the job's config, not its bus keys: a run directory copied to a host
    without the keys still replays."""
    keyed = dataclasses.replace(CFG, network=dataclasses.replace(
        CFG.network, bus_host="192.0.2.2", bus_keys=str(tmp_path / "absent")))  # fmt: skip
    result = replay_run(_run_dir(tmp_path / "run", _two_failures(), keyed))
    assert [p.generation for p in result.plans] == [1, 2] and result.diverged is None


def test_a_log_without_recoveries_has_nothing_to_replay(tmp_path):
    proc = elaswave("replay", str(_run_dir(tmp_path, [])), timeout=60)
    assert proc.returncode == 0 and "holds no recovery plan" in proc.stdout


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda d: None, "has no job.json: not a run directory"),
        (lambda d: (d / "job.json").write_text("{}"), "does not describe a job"),
        (lambda d: (d / "job.json").write_text("not json"), "does not describe a job"),
        (
            lambda d: (d / "job.json").write_text(
                '{"run_id": "x", "config": {"model": {"source": 5}}, "endpoints": {}}'
            ),
            "does not describe a job (AttributeError",
        ),
    ],
)
def test_not_a_run_is_one_clear_error(tmp_path, setup, message):
    setup(tmp_path)
    if message.startswith("does not") or (tmp_path / "job.json").exists():
        (tmp_path / "events.log").write_bytes(b"")
    proc = elaswave("replay", str(tmp_path), timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert message in proc.stderr, proc.stderr


def _superseded(committed_attempt: int):
    """Generation 1 announced for [1], superseded by [1, 3] (rank 3 died before it
    acknowledged), attempt 1 committed (or, to tamper, attempt 0); then generation 2,
    planned by the Core from attempt 1, for rank 4."""
    first, _ = _announce(CFG.plan(), [1], 2)
    widened, plan = _announce(CFG.plan(), [1, 3], 2)
    superseding = dataclasses.replace(widened[-1], attempt=1)
    digest = (superseding if committed_attempt else first[-1]).plan_digest
    commit = PlanCommit(sender="core", generation=1, attempt=committed_attempt, plan_digest=digest)
    second, _ = _announce(plan, [4], 3)
    return [*first, superseding, commit, *second]


def test_a_superseded_plan_is_replayed_and_the_next_builds_on_the_committed_one(tmp_path):
    result = replay_run(_run_dir(tmp_path, _superseded(committed_attempt=1)))
    assert result.diverged is None, result.diverged
    assert [(p.generation, p.attempt) for p in result.plans] == [(1, 0), (1, 1), (2, 0)]
    proc = elaswave("replay", str(tmp_path), timeout=60)
    assert "generation 1 (attempt 1), fail-stop of ranks [1, 3]: plan" in proc.stdout


def test_a_commit_of_the_wrong_attempt_makes_the_next_generation_diverge(tmp_path):
    result = replay_run(_run_dir(tmp_path, _superseded(committed_attempt=0)))
    bad = result.diverged
    assert bad is not None and (bad.generation, bad.attempt) == (2, 0)
