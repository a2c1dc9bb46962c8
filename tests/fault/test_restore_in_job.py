"""State lost, a checkpoint on disk: the running job restores it and trains on.

dp2 x pp2 with one snapshot copy: killing an owner and the holder of its snapshot in the
same step loses the owner's shard. With ``--checkpoint-every 2`` the survivors (and
the plan they form) load the newest complete checkpoint inside their running
processes, train the steps after it again, and the run matches the fault-free one; no
process is started again and no person acts.
"""

from __future__ import annotations

import pytest

from elaswave.fabric.placement import place_snapshots_across
from tests.fault.recovery import JOB, STEPS, check_recovered
from tests.runs import train

pytestmark = pytest.mark.timeout(300)


def test_an_owner_and_its_holder_lost_together_restore_the_checkpoint_inside_the_job(
    runs_dir, reference
):
    (holder,) = place_snapshots_across([[0, 1], [2, 3]], 1, 1).holders_of(0)
    faults = ("--fault", "kill:0@4:backward", "--fault", f"kill:{holder}@4:backward")
    run = train(runs_dir / "restored", "--dp", "2", "--pp", "2", *JOB, "--checkpoint-every",
                "2", *faults)  # fmt: skip
    check_recovered(run, reference(2, 2), world=4, failed=[sorted([0, holder])])
    (record,) = run.summary.recoveries
    assert record.restored and record.committed_step in (1, 3), record
    assert record.step == record.committed_step + 1
    assert f"restored from the checkpoint of step {record.committed_step}" in record.reason
    assert run.summary.steps_completed == STEPS


def test_a_failure_while_a_plan_is_applied_is_answered_from_the_checkpoint(runs_dir):
    """The issue's reproduction of a failure in the apply window: rank 0 is killed in
    step 3's forward, and rank 4 while the survivors apply the plan that answers it.
    The plan becomes current torn (the survivors caught mid-apply report so), and the
    change that rank 4's loss starts restores the checkpoint inside the job; the run
    matches the fault-free one, and replay reproduces both plans."""
    from elaswave.runtime.core.compare import compare_runs

    job = ("--dp", "3", "--pp", "2", "--global-batch", "12", "--steps", "8",
           "--checkpoint-every", "2")  # fmt: skip
    run = train(runs_dir / "torn", *job, "--fault", "kill:0@3:forward", "--fault",
                "kill:4@3:apply")  # fmt: skip
    twin = train(runs_dir / "torn_twin", *job)
    first, second = run.summary.recoveries
    assert first.torn and list(first.ranks) == [0] and not first.restored
    assert second.restored and list(second.ranks) == [4] and second.committed_step == 1
    assert "their state is not whole" in second.reason
    assert run.summary.steps_completed == 8
    diff = compare_runs(run.out, twin.out)
    assert diff.loss_rel <= 1e-4 and diff.param_rel <= 1e-4, diff
    assert second.mttr_s < 20, "a creation abandoned by the torn apply held the store"
