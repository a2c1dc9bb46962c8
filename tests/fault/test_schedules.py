"""Zero-bubble schedules under faults: a rank killed in the input-gradient half (``I``,
the ``backward`` phase) or in the weight-gradient half (``W``, the ``weight`` phase) of
its first micro-batch is recovered inside the step, and the run matches the same run
without the fault (and the 1F1B run of the same job: the schedule changes the order of
the work, not its numbers). Replay reproduces every plan,
with its schedule (:func:`tests.runs.train` replays each run)."""

from __future__ import annotations

import json

import pytest

from elaswave.engine.schedule import max_in_flight
from elaswave.runtime.core.compare import compare_runs
from tests.runs import train

pytestmark = pytest.mark.timeout(300)

JOB = ("--dp", "2", "--pp", "2", "--steps", "6", "--global-batch", "8", "--micro-batch", "1")


ZB = ("--schedule", "zb-h1")
ONE_F_ONE_B = ("--schedule", "1f1b")


@pytest.fixture(scope="module")
def references(runs_dir):
    """The fault-free job under ZB-H1 and under 1F1B (equal parameters: the schedule
    changes the order of the work, not its numbers)."""
    zb = train(runs_dir / "schedules_zb", *JOB, *ZB)
    one = train(runs_dir / "schedules_1f1b", *JOB, *ONE_F_ONE_B)
    assert compare_runs(zb.out, one.out).param_rel == 0.0
    return zb, one


def test_1f1b_keeps_its_activation_bound_tight(references):
    """1F1B's recorded traces: every micro-batch forward and backward once, and the
    warm-up as deep as the pipeline allows (the activations it holds: P - stage)."""
    _, one = references
    for worker in one.workers():
        for trace in worker.traces:
            actions = [(op, mb) for op, mb in trace.actions]
            assert sorted(actions) == sorted((op, m) for op in "FB" for m in range(4))
            assert max_in_flight(actions) == min(2 - worker.stage, 4), worker.rank


@pytest.mark.parametrize(
    ("rank", "phase"),
    [(1, "weight"), pytest.param(2, "backward", marks=pytest.mark.long)],  # I: as 1F1B's B
)
def test_a_kill_in_either_half_of_a_split_backward_is_recovered(runs_dir, references, rank, phase):
    run = train(runs_dir / f"schedules_kill_{phase}", *JOB, *ZB,
                "--fault", f"kill:{rank}@3:{phase}")  # fmt: skip
    (recovery,) = run.summary.recoveries
    assert recovery.kind == "fail-stop" and list(recovery.ranks) == [rank]
    for ref in references:
        diff = compare_runs(run.out, ref.out)
        assert diff.loss_rel <= 1e-4 and diff.param_rel <= 1e-4, diff


# long: auto's choice: tests/unit/test_schedule*.py; a ZB-H1 recovery: the weight-half kill
@pytest.mark.long
def test_auto_plans_the_schedule_at_the_start_and_at_a_change(runs_dir):
    """``--schedule auto`` on an emulated device: the initial plan and the plan after a
    kill take the schedule the planner simulates faster (ZB-H1 on a pipeline: the
    workers' traces split every backward), workers agree with the Core, replay agrees
    with both, and the run matches 1F1B's numbers."""
    emulated = ("--device", "emulated")
    run = train(runs_dir / "schedules_auto", *JOB, *emulated, "--schedule", "auto",
                "--fault", "kill:1@3:forward")  # fmt: skip
    one = train(runs_dir / "schedules_1f1b_emulated", *JOB, *emulated, *ONE_F_ONE_B)
    assert len(run.summary.recoveries) == 1
    trace = json.loads((run.out / "workers" / "rank0.json").read_text())["traces"][0]
    assert {op for op, _ in trace["actions"]} == {"F", "I", "W"}
    # summary.json prices the final plan: the one after the change runs ZB-H1 too
    assert run.summary.predicted_step_s < one.summary.predicted_step_s
    diff = compare_runs(run.out, one.out)
    assert diff.loss_rel <= 1e-4 and diff.param_rel <= 1e-4, diff


def test_zb_cost_lists_run_and_a_kill_in_the_weight_half_is_recovered(runs_dir, references):
    """``--schedule zb-cost``: every rank runs the lists the plan's search gives
    (:func:`~elaswave.engine.steptime.plan_lists`: possibly more forwards in flight than
    ZB-H1 where memory holds them), rank 1 killed in a weight half is recovered, replay
    reproduces the plans, and the run matches the 1F1B and ZB-H1 runs."""
    run = train(runs_dir / "schedules_zb_cost", *JOB, "--schedule", "zb-cost",
                "--fault", "kill:1@3:weight")  # fmt: skip
    (recovery,) = run.summary.recoveries
    assert recovery.kind == "fail-stop" and list(recovery.ranks) == [1]
    trace = json.loads((run.out / "workers" / "rank2.json").read_text())["traces"][0]
    assert {op for op, _ in trace["actions"]} == {"F", "I", "W"}
    for ref in references:
        diff = compare_runs(run.out, ref.out)
        assert diff.loss_rel <= 1e-4 and diff.param_rel <= 1e-4, diff
