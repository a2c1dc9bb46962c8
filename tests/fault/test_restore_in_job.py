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
