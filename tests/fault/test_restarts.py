"""``--max-restarts K``: a worker killed on a host that is still up is started again,
as a joiner on the device it freed, while the others train on; at most K times a job.
A job of one replica, whose failure leaves a stage without a rank, waits for its
restart (``--wait-for-nodes``) and goes on as if nothing had happened."""

from __future__ import annotations

import time

import pytest

from elaswave.bus.eventlog import read_event_log
from elaswave.bus.schema import ScaleRequest, WorkerFinished, WorkerStarted
from elaswave.runtime.core.compare import compare_runs
from tests.runs import train

pytestmark = pytest.mark.timeout(300)

JOB = ("--dp", "2", "--pp", "2", "--steps", "10", "--global-batch", "8", "--micro-batch", "1")


def _events(run, kind: type) -> list:
    return [rec.event for rec in read_event_log(run.out / "events.log")
            if isinstance(rec.event, kind)]  # fmt: skip


def test_a_worker_killed_on_a_live_host_is_started_again_up_to_max_restarts(runs_dir):
    """dp2 x pp2 with one restart: rank 1 killed in step 3 comes back as rank 4 on its
    device (local rank 1), joining stage 0 at the next boundary; rank 2 killed in step 6
    is past the budget and its stage goes on with one rank. Every step matches the
    fault-free run (joins and losses keep the global batch)."""
    ref = train(runs_dir / "restarts_ref", *JOB)
    run = train(runs_dir / "restarts", *JOB, "--max-restarts", "1",
                "--fault", "kill:1@3:backward", "--fault", "kill:2@6:forward")  # fmt: skip
    s = run.summary
    assert s.steps_completed == 10
    assert [(r.kind, r.ranks) for r in s.recoveries] == [
        ("fail-stop", (1,)), ("join", (4,)), ("fail-stop", (2,))
    ]  # fmt: skip
    assert [st.ranks for st in s.recoveries[1].plan.stages] == [(0, 4), (2, 3)]
    (offer,) = _events(run, ScaleRequest)
    assert offer.reason == (
        "restart 1 of 1: rank 1 failed (signal SIGKILL) on node 0, which is up; its "
        "device is offered again"
    )
    started = {e.rank: e.local_rank for e in _events(run, WorkerStarted)}
    assert started[4] == 1  # the device rank 1 freed
    diff = compare_runs(run.out, ref.out)
    assert diff.loss_rel <= 1e-4, f"losses differ by {diff.loss_rel:.2e}"
    assert diff.param_rel <= 1e-4, f"parameters differ by {diff.param_rel:.2e}"


def test_a_single_replica_pipeline_waits_for_its_restarted_worker(runs_dir):
    """dp1 x pp2: rank 1, all of stage 1, killed in step 3. With a restart and a wait
    for nodes the job keeps its state in memory, the restarted worker takes stage 1
    (from rank 0's host snapshot of its shard) in the same change, and every step
    matches the fault-free run."""
    job = ("--dp", "1", "--pp", "2", "--steps", "8", "--global-batch", "4",
           "--micro-batch", "1")  # fmt: skip
    ref = train(runs_dir / "restart_pipe_ref", *job)
    run = train(runs_dir / "restart_pipe", *job, "--max-restarts", "1", "--wait-for-nodes",
                "60", "--fault", "kill:1@3:backward")  # fmt: skip
    (rec,) = run.summary.recoveries
    assert rec.kind == "fail-stop" and rec.ranks == (1,)
    assert [st.ranks for st in rec.plan.stages] == [(0,), (2,)]
    diff = compare_runs(run.out, ref.out)
    assert diff.loss_rel <= 1e-4, f"losses differ by {diff.loss_rel:.2e}"
    assert diff.param_rel <= 1e-4, f"parameters differ by {diff.param_rel:.2e}"


def test_a_job_that_lost_every_worker_restarts_them_from_its_checkpoint(runs_dir):
    """dp1 x pp2 on one node of two ranks, the node's workers killed in step 5: no
    worker survives, and its state in memory is gone with them. With restarts and a
    checkpoint every 2 steps, the job waits for its restarted workers (without a wait
    for nodes: RESTART_WAIT_S at the most); the
    first restores the checkpoint of step 3 inside the job (on one stage), the second
    joins and the pipeline grows back to two stages. Every step matches the fault-free
    run, the steps redone from the checkpoint included."""
    job = ("--dp", "1", "--pp", "2", "--steps", "8", "--global-batch", "4",
           "--micro-batch", "1", "--ranks-per-node", "2", "--checkpoint-every", "2")  # fmt: skip
    ref = train(runs_dir / "restart_all_ref", *job)
    run = train(runs_dir / "restart_all", *job, "--max-restarts", "2",
                "--fault", "kill-node:0@5:backward")  # fmt: skip
    lost, *joins = run.summary.recoveries
    assert lost.kind == "fail-stop" and lost.ranks == (0, 1)
    assert "restored from the checkpoint of step 3 inside the job" in lost.reason
    assert [r.kind for r in joins] in (["join"], [])  # the second, unless both came at once
    assert [len(st.ranks) for st in (joins or [lost])[-1].plan.stages] in ([1, 1], [2])
    reasons = [e.reason for e in _events(run, ScaleRequest)]
    assert [r.split(":")[0] for r in reasons] == ["restart 1 of 2", "restart 2 of 2"]
    diff = compare_runs(run.out, ref.out)
    assert diff.loss_rel <= 1e-4, f"losses differ by {diff.loss_rel:.2e}"
    assert diff.param_rel <= 1e-4, f"parameters differ by {diff.param_rel:.2e}"


def test_a_restarted_worker_the_job_ended_without_leaves_without_a_restart(runs_dir):
    """dp2 x pp1 with two restarts, rank 1 killed in the last step: its restarted worker
    (rank 2) has no step boundary left to join at, so the Core asks it to leave when the
    job is over (SIGTERM), or it joined in time. Either way its exit is no failure: no
    second restart (chaos seed 48611, case 7: one was started, found no plan to join and
    failed after 60 s), every worker but the killed one finishes cleanly, and promptly."""
    job = ("--dp", "2", "--pp", "1", "--steps", "6", "--global-batch", "4",
           "--micro-batch", "1")  # fmt: skip
    began = time.monotonic()
    run = train(runs_dir / "restart_late", *job, "--max-restarts", "2",
                "--fault", "kill:1@5:forward")  # fmt: skip
    took = time.monotonic() - began
    assert run.summary.steps_completed == 6
    reasons = [e.reason for e in _events(run, ScaleRequest)]
    assert [r.split(":")[0] for r in reasons] == ["restart 1 of 2"]
    started = {e.rank for e in _events(run, WorkerStarted)}
    assert started == {0, 1, 2}
    failed = [e for e in _events(run, WorkerFinished) if not e.ok]
    assert failed == [], failed
    assert took < 45, f"the job took {took:.0f} s"  # a joiner waiting for a plan: 60 s
