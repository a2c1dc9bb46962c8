"""Pipelines that change their number of stages for speed, inside the running job.

A pipeline that losses shortened grows its stages back when joiners come and the cost
model prices the longer pipeline lower (move included); with ``--reform``, damaged
replicas become fewer, full stages when that prices lower. Both run on the machinery
every change uses (snapshots, the live remap, the dynamic communicator) and match their
fault-free twins; replay reproduces every plan (``train``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from elaswave.runtime.core.compare import compare_runs
from tests.runs import Run, train

pytestmark = pytest.mark.timeout(300)

SHORT_SAMPLES = '[model]\npreset = "tiny"\nseq_len = 8\n'
"""Samples of 8 tokens: the all-reduce outweighs the compute on the emulated device, so
that two stages price lower than one stage of three (tests/unit/test_reshape.py)."""

JOB = ("--device", "emulated", "--dp", "2", "--pp", "2", "--steps", "20",
       "--global-batch", "16", "--micro-batch", "1")  # fmt: skip
"""20 steps: the one-stage pipeline steps 0.235 s (simulated), so that the joiners
scheduled for step 5 are up before the job ends on a loaded host."""


def _config(runs_dir: Path) -> tuple[str, str]:
    path = runs_dir / "short_samples.toml"
    path.write_text(SHORT_SAMPLES)
    return ("--config", str(path))


def _matches(run: Run, twin: Run) -> None:
    diff = compare_runs(run.out, twin.out)
    assert diff.loss_rel <= 1e-4, f"losses differ by {diff.loss_rel:.2e}"
    assert diff.param_rel <= 1e-4, f"parameters differ by {diff.param_rel:.2e}"


def test_a_pipeline_shortened_to_one_stage_grows_back_when_joiners_make_it_faster(runs_dir):
    """dp2 x pp2 loses stage 1 in step 2 (rank 1 takes it), then rank 1 in step 4: rank
    0 runs every layer. Two joiners are scheduled for step 5; the first to arrive makes
    two stages, which price lower than one stage two wide, and takes the layers rank 0
    gives up (the second, if it arrives before the end, widens a stage). Every step
    matches the fault-free run."""
    config = _config(runs_dir)
    twin = train(runs_dir / "grow_ref", *JOB, *config)
    faults = ("kill:2@2:backward", "kill:3@2:backward", "kill:1@4:forward", "join@5", "join@5")
    run = train(runs_dir / "grow", *JOB, *config, *(a for f in faults for a in ("--fault", f)))
    s = run.summary
    assert s.steps_completed == 20
    shapes = [[st.ranks for st in rec.plan.stages] for rec in s.recoveries]
    assert shapes[:2] == [[(0,), (1,)], [(0,)]], shapes
    grew = s.recoveries[2]
    assert grew.kind == "join" and len(grew.plan.stages) == 2, shapes
    assert "priced lower than keeping 1" in grew.reason, grew.reason
    assert len(shapes[-1]) == 2 and {r for st in shapes[-1] for r in st} <= {0, 4, 5}, shapes
    _matches(run, twin)


@pytest.mark.long  # the same machinery: the growth case; the choice: tests/unit/test_reshape.py
def test_reform_turns_a_damaged_replica_into_one_stage_when_that_is_faster(runs_dir):
    """dp2 x pp2 with ``--reform`` loses rank 0 in step 3: with 32-token samples one
    stage three wide prices lower than stages of 1 and 2, so ranks 2 and 3 take the
    first layers too (rank 1 gives them from its device, the first stage's optimizer
    shard of rank 0 from its snapshot). The run matches the fault-free one."""
    job = (*JOB[:6], "--steps", "10", "--global-batch", "12", "--micro-batch", "2")
    twin = train(runs_dir / "reform_ref", *job)
    run = train(runs_dir / "reform", *job, "--reform", "--fault", "kill:0@3:backward")
    (rec,) = run.summary.recoveries
    assert [st.ranks for st in rec.plan.stages] == [(1, 2, 3)], rec.reason
    assert "priced lower than keeping 2" in rec.reason
    _matches(run, twin)
