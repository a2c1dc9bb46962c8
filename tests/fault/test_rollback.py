"""A failure while a plan is applied: the plan is taken back, and the job trains on.

Every participant keeps what it committed before it applies a plan. When one dies in
the apply window, the Core takes the plan back and plans again from the layout before
it with every rank lost; the members roll back to what they kept (those whose apply
finished, and those it tore), and the run matches the fault-free one. No checkpoint, no
process started again; replay reproduces every plan, the taken-back one included.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from elaswave.bus.eventlog import read_event_log
from elaswave.bus.schema import WorkerStarted
from elaswave.runtime.core.compare import compare_runs
from tests.runs import Run, train

pytestmark = pytest.mark.timeout(300)

WINDOW = ("--dp", "3", "--pp", "2", "--global-batch", "12", "--steps", "8")
"""The issue's reproduction: rank 0 killed in step 3's forward, rank 4 as the survivors
apply the plan that answers it."""
FAULTS = ("--fault", "kill:0@3:forward", "--fault", "kill:4@3:apply")


def _matches(run: Run, twin: Run, world: int) -> None:
    assert run.summary.steps_completed == twin.summary.steps_completed
    diff = compare_runs(run.out, twin.out)
    assert diff.loss_rel <= 1e-4 and diff.param_rel <= 1e-4, diff
    started = [
        rec.event.rank
        for rec in read_event_log(run.out / "events.log")
        if isinstance(rec.event, WorkerStarted)
    ]
    assert sorted(started) == list(range(world)), "a process was started again"


@pytest.mark.parametrize(
    "checkpoints",
    [(), pytest.param(("--checkpoint-every", "2"), marks=pytest.mark.long)],
    ids=["none", "ck2"],
)
def test_a_failure_while_a_plan_is_applied_rolls_the_plan_back(runs_dir, checkpoints):
    """Without a checkpoint the job used to stop here ("a failure in that window is not
    recovered"); with one it restored it. Now both roll back in memory: the first
    change is recorded rolled back, the second answers ranks 0 and 4 together from the
    dp3 x pp2 layout, after the same committed step, and restores nothing."""
    run = train(runs_dir / "rolled", *WINDOW, *checkpoints, *FAULTS)
    twin = train(runs_dir / "twin", *WINDOW, *checkpoints)
    first, second = run.summary.recoveries
    assert first.rolled_back and list(first.ranks) == [0]
    assert not second.rolled_back and not second.restored
    assert list(second.ranks) == [0, 4] and second.committed_step == first.committed_step
    assert second.generation == first.generation + 1
    _matches(run, twin, world=6)
    assert second.mttr_s < 20, "a creation abandoned by the torn apply held the store"


@pytest.mark.long
def test_a_join_torn_by_a_failure_is_rolled_back_and_the_joiner_added_again(runs_dir):
    """Rank 3 dies as the members apply the plan that adds joiner 4 (whenever the join
    comes: rank 3 is killed at the first apply after step 3). The plan is taken back:
    the members go on from dp2 x pp2 without rank 3, and the joiner, which kept
    nothing, is added by a join after it, with a plan numbered from the store's."""
    job = ("--dp", "2", "--pp", "2", "--steps", "12", "--global-batch", "8",
           "--micro-batch", "2", "--ranks-per-node", "1")  # fmt: skip
    kills = [f"kill:3@{s}:apply" for s in range(4, 12)]
    _joined_again(runs_dir / "join", job, "join@3", kills, failed=3, joiner=4)


def _joined_again(
    out: Path, job: tuple[str, ...], join: str, kills: list[str], *, failed: int, joiner: int
) -> None:
    """A join taken back by the failure of ``failed`` (one of ``kills`` fires at the
    first apply after the join), then ``failed`` answered without ``joiner``, which a
    join after it adds; the run matches its twin."""
    faults = [a for fault in (join, *kills) for a in ("--fault", fault)]
    run = train(out, *job, *faults)
    twin = train(out.with_name(out.name + "_twin"), *job)
    first, second, third = run.summary.recoveries
    assert first.kind == "join" and first.rolled_back and list(first.joined) == [joiner]
    assert second.kind == "fail-stop" and list(second.ranks) == [failed] and not second.joined
    assert third.kind == "join" and list(third.joined) == [joiner] and not third.rolled_back
    _matches(run, twin, world=joiner + 1)


def test_a_joiner_whose_own_apply_finished_goes_back_to_wait_when_its_plan_is_taken_back(
    runs_dir,
):
    """Rank 1 dies at the end of its apply of the plan that adds joiner 4, before it
    reports it applied (whenever the join comes). The joiner's own apply finished, so
    it was training under that plan when the Core took it back; it used to die of it
    ("the Core rolls back the plan of generation 1, and rank 4 kept nothing from before
    it": chaos seed 57721 with two copies and checkpoints, case 135, where rank 0's
    report of its apply went down with its node). It now drops what it built and is
    added by a join after the failure's change, and the run matches its twin."""
    job = ("--dp", "4", "--pp", "1", "--steps", "10", "--global-batch", "8",
           "--micro-batch", "1", "--ranks-per-node", "1")  # fmt: skip
    kills = [f"kill:1@{s}:applied" for s in range(3, 9)]
    _joined_again(runs_dir / "joined_back", job, "join@2", kills, failed=1, joiner=4)


# long: restore in the job: test_restore_in_job.py; the Core's side: tests/unit/test_protocol.py
@pytest.mark.long
def test_a_joiner_left_alone_by_a_torn_join_restores_the_checkpoint_inside_the_job(runs_dir):
    """The job's only rank dies as it applies the plan that adds joiner 1 (at the first
    apply after step 3). No member is left to roll back to, and the joiner holds no
    state: with a checkpoint, the joiner takes it in the change that answers the loss
    (no process started again), and the run matches its fault-free twin (chaos seed
    57721, case 187, stopped)."""
    job = ("--dp", "1", "--pp", "1", "--steps", "10", "--global-batch", "4",
           "--micro-batch", "2", "--checkpoint-every", "2")  # fmt: skip
    kills = [a for s in range(4, 10) for a in ("--fault", f"kill:0@{s}:apply")]
    run = train(runs_dir / "alone", *job, "--fault", "join@3", *kills)
    twin = train(runs_dir / "alone_twin", *job)
    first, second = run.summary.recoveries
    assert first.kind == "join" and first.rolled_back and list(first.joined) == [1]
    assert second.kind == "fail-stop" and list(second.ranks) == [0] and second.restored
    assert list(second.joined) == [1], second
    _matches(run, twin, world=2)
