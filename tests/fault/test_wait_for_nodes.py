"""Fewer ranks than stages: without ``--wait-for-nodes`` the survivors are re-pipelined
onto fewer stages inside their processes and go on; with it, the job keeps its state in
memory and waits for joiners to refill every stage, then goes on as if nothing had
happened; a wait that runs out goes on with fewer stages, or (``--no-shorten-after-wait``)
writes a checkpoint from memory and stops the job naming how to resume."""

from __future__ import annotations

import pytest

from elaswave.bus.schema import WaitingForNodes
from elaswave.runtime.core.compare import compare_runs, load_params, loss_rel_diff, param_rel_diff
from tests.runs import Run, await_logged, background_job, elaswave, train

pytestmark = pytest.mark.timeout(300)

JOB = ("--device", "emulated", "--dp", "1", "--pp", "2", "--steps", "10",
       "--global-batch", "16", "--micro-batch", "2")  # fmt: skip


@pytest.fixture(scope="module")
def ref(runs_dir) -> Run:
    return train(runs_dir / "wait_ref", *JOB)


@pytest.mark.long  # a joiner ending a wait: the elaswave-scale case covers it by default
def test_a_pipeline_short_of_a_rank_waits_for_a_joiner_and_matches_the_fault_free_run(
    runs_dir, ref
):
    """dp 1 x pp 2 loses rank 1 (all of stage 1) in step 3: one rank is left for two
    stages. The job waits; the joiner it schedules (join@5, started at once while the
    job waits) takes stage 1, rebuilt from rank 0's host snapshot of rank 1's shard, and
    every step matches the fault-free run; replay reproduces the plan (``train``)."""
    run = train(runs_dir / "wait_join", *JOB, "--wait-for-nodes", "60",
                "--fault", "kill:1@3:backward", "--fault", "join@5")  # fmt: skip
    s = run.summary
    assert s.steps_completed == 10
    (rec,) = s.recoveries
    assert rec.kind == "fail-stop" and rec.ranks == (1,)
    assert [st.ranks for st in rec.plan.stages] == [(0,), (2,)]
    assert 0 <= rec.waited_s < 60
    assert "core.waiting_for_nodes" in run.proc.stderr
    diff = compare_runs(run.out, ref.out)
    assert diff.loss_rel <= 1e-4, f"losses differ by {diff.loss_rel:.2e}"
    assert diff.param_rel <= 1e-4, f"parameters differ by {diff.param_rel:.2e}"


@pytest.mark.long  # the wait that runs out re-pipelines the same way, by default
def test_without_a_wait_the_survivor_runs_every_layer_and_matches_the_fault_free_run(runs_dir, ref):
    """The same loss without ``--wait-for-nodes``: the pipeline shortens to one stage
    (rank 0 takes layers 3-5 from its host snapshot of rank 1, blocking) and goes on;
    a joiner later widens it. Every step matches the fault-free run; replay reproduces
    both plans (``train``)."""
    run = train(runs_dir / "shorter", *JOB, "--fault", "kill:1@3:backward",
                "--fault", "join@6")  # fmt: skip
    s = run.summary
    assert s.steps_completed == 10
    shorten, join = s.recoveries
    assert [st.ranks for st in shorten.plan.stages] == [(0,)]
    assert shorten.migration.decision.mode == "blocking"
    assert "the pipeline becomes 1 stages" in shorten.reason
    assert join.kind == "join" and [st.ranks for st in join.plan.stages] == [(0, 2)]
    diff = compare_runs(run.out, ref.out)
    assert diff.loss_rel <= 1e-4, f"losses differ by {diff.loss_rel:.2e}"
    assert diff.param_rel <= 1e-4, f"parameters differ by {diff.param_rel:.2e}"


@pytest.mark.long  # the two-stage case covers it by default
def test_a_three_stage_pipeline_left_with_two_ranks_is_re_pipelined(runs_dir):
    """dp 1 x pp 3 loses its middle stage: the two survivors are re-pipelined (the
    planner prices every shorter pipeline) and the run matches its fault-free twin."""
    job = ("--device", "emulated", "--dp", "1", "--pp", "3", "--steps", "10",
           "--global-batch", "8", "--micro-batch", "2")  # fmt: skip
    twin = train(runs_dir / "pp3_ref", *job)
    run = train(runs_dir / "pp3_shorter", *job, "--fault", "kill:1@3:backward")
    (rec,) = run.summary.recoveries
    assert len(rec.plan.stages) < 3
    assert sorted(r for st in rec.plan.stages for r in st.ranks) == [0, 2]
    diff = compare_runs(run.out, twin.out)
    assert diff.loss_rel <= 1e-4, f"losses differ by {diff.loss_rel:.2e}"
    assert diff.param_rel <= 1e-4, f"parameters differ by {diff.param_rel:.2e}"


def test_a_wait_that_runs_out_goes_on_with_fewer_stages(runs_dir, ref):
    """No joiner comes: when the 2 s wait runs out, rank 0 takes stage 1's layers from
    the snapshot it holds, as a job that does not wait would have at once, and the run
    ends as the fault-free one does; the record says the change waited."""
    run = train(runs_dir / "wait_shorten", *JOB, "--wait-for-nodes", "2",
                "--fault", "kill:1@5:backward")  # fmt: skip
    (rec,) = run.summary.recoveries
    assert rec.waited_s is not None and rec.waited_s >= 2.0
    assert [tuple(s.ranks) for s in rec.plan.stages] == [(0,)]
    assert run.summary.steps_completed == 10
    diff = compare_runs(run.out, ref.out)
    assert diff.loss_rel <= 1e-4 and diff.param_rel <= 1e-4, diff


@pytest.mark.long  # --no-shorten-after-wait; the Core's side: tests/unit/test_protocol.py
def test_a_wait_that_runs_out_writes_a_checkpoint_from_memory_that_resumes_on_another_layout(
    runs_dir, ref
):
    """No joiner comes, the job asks to stop rather than shorten its pipeline, and it
    never wrote a periodic checkpoint: when the wait runs out, rank 0 writes its own
    shard at the step it rolls back to (step 3: it committed step 4 and keeps the one
    before) and rank 1's from the host snapshot it holds; the job stops (non-zero, no
    hang) naming the command that resumes it. Resumed as dp 2 x pp 1, it ends as the
    fault-free run does."""
    out = runs_dir / "wait_out"
    proc = elaswave("train", "--out", str(out), *JOB, "--wait-for-nodes", "2",
                    "--no-shorten-after-wait", "--fault", "kill:1@5:backward",
                    timeout=120)  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "waited 2 s for 1 more rank to fill every stage" in proc.stderr
    assert "stage 1 (layers 3-5) lost all its ranks [1]" in proc.stderr
    assert "it wrote a checkpoint of step 3 from the state in memory" in proc.stderr
    assert f"resume with --resume {out}" in proc.stderr
    layout = ["--dp", "2", "--pp", "1"]
    resumed = train(runs_dir / "wait_out_resumed", "--resume", str(out), *JOB[:2], *layout,
                    *JOB[6:])  # fmt: skip
    s = resumed.summary
    assert s.first_step == 4 and s.steps_completed == 10
    assert loss_rel_diff(s.loss, ref.summary.loss[4:]) <= 1e-5
    assert param_rel_diff(load_params(resumed.out), load_params(ref.out)) <= 1e-5


@pytest.mark.long  # joins while waiting: this module's join@STEP case; scale: test_elastic.py
def test_a_waiting_job_takes_a_worker_added_by_elaswave_scale(runs_dir, ref):
    """No joiner is scheduled: the job waits until an operator adds one with ``elaswave
    scale``, which reports it joined; the run then matches the fault-free one."""
    out = runs_dir / "wait_scale"
    with background_job(out, *JOB, "--wait-for-nodes", "120",
                        "--fault", "kill:1@3:backward") as job:  # fmt: skip
        await_logged(out, job, WaitingForNodes)
        scale = elaswave("scale", str(out), "--add", "1", "--timeout", "120", timeout=150)
        assert scale.returncode == 0, scale.stderr
        assert "ranks [2] joined at step" in scale.stdout
        _, stderr = job.communicate(timeout=200)
        assert job.returncode == 0, stderr
    diff = compare_runs(out, ref.out)
    assert diff.loss_rel <= 1e-4, f"losses differ by {diff.loss_rel:.2e}"
    assert diff.param_rel <= 1e-4, f"parameters differ by {diff.param_rel:.2e}"
