"""The control plane under faults: workers lost during a recovery, a lossy bus, a lost host.

Real processes throughout: SIGKILL and SIGSTOP at named points of a recovery, and every
process's bus receiving through the fault-injecting transport (drop, duplicate,
reorder, delay). Each case either continues and matches the fault-free run, or stops
with a message that says how to resume, and resumes to the fault-free result.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from elaswave.bus.eventlog import read_event_log
from elaswave.bus.schema import (
    Heartbeat,
    PlanCommit,
    RecoveryPlan,
    StepCompleted,
    WorkerStarted,
)
from elaswave.runtime.core.compare import compare_runs, load_params, loss_rel_diff, param_rel_diff
from elaswave.runtime.core.runlog import read_run_log
from tests.fault.recovery import JOB, STEPS, check_recovered
from tests.runs import Run, launch, train

DP4_PP2 = ("--dp", "4", "--pp", "2", *JOB)


def _announcements(run_dir) -> list[tuple[int, int, list[int]]]:
    return [
        (r.event.generation, r.event.attempt, r.event.failed)
        for r in read_event_log(run_dir / "events.log")
        if isinstance(r.event, RecoveryPlan)
    ]


def _resumes_to_the_reference(crashed, runs_dir, ref: Run, *, first_step: set[int]) -> None:
    """``crashed`` resumes from its latest complete checkpoint (one of ``first_step``
    minus one: a checkpoint is written in the background) and ends as ``ref`` did."""
    resumed = train(runs_dir / f"{crashed.name}_resumed", "--resume", str(crashed))
    s = resumed.summary
    assert s.first_step in first_step and s.steps_completed == STEPS, s.first_step
    first_step = s.first_step
    assert loss_rel_diff(s.loss, ref.summary.loss[first_step:]) <= 1e-5
    assert param_rel_diff(load_params(resumed.out), load_params(ref.out)) <= 1e-5


@pytest.mark.timeout(300)
def test_worker_killed_before_acknowledging_the_plan_is_planned_around(runs_dir, reference):
    """Rank 6 dies with the plan for rank 1's failure in hand, before acknowledging it:
    the Core supersedes that plan with one that also drops rank 6, and the only plan
    that runs is the committed one."""
    run = train(runs_dir / "kill_at_plan", *DP4_PP2,
                "--fault", "kill:1@3:backward", "--fault", "kill:6@3:plan")  # fmt: skip
    check_recovered(run, reference(4, 2), world=8, failed=[[1, 6]])
    (rec,) = run.summary.recoveries
    assert rec.superseded == 1
    assert _announcements(run.out) == [(1, 0, [1]), (1, 1, [1, 6])]
    commits = [r.event for r in read_event_log(run.out / "events.log")
               if isinstance(r.event, PlanCommit)]  # fmt: skip
    assert [(c.generation, c.attempt) for c in commits] == [(1, 1)]


@pytest.mark.timeout(300)
@pytest.mark.long
def test_silent_participant_is_fenced_at_the_ack_deadline(runs_dir, reference):
    """Rank 6 stops (SIGSTOP) with the plan in hand. Its heartbeat deadline is 30 s; the
    plan's acknowledgement deadline, 2 s, fences it first, and a superseding plan runs."""
    run = train(runs_dir / "hang_at_plan", *DP4_PP2,
                "--fault", "kill:1@3:backward", "--fault", "hang:6@3:plan",
                "--heartbeat-timeout", "30", "--plan-ack-timeout", "2")  # fmt: skip
    check_recovered(run, reference(4, 2), world=8, failed=[[1, 6]], fenced=True)
    (rec,) = run.summary.recoveries
    assert rec.superseded == 1
    assert 2.0 <= rec.phases.plan < 10.0, rec.phases  # the ack deadline, not 30 s
    assert _announcements(run.out) == [(1, 0, [1]), (1, 1, [1, 6])]


@pytest.mark.long
@pytest.mark.timeout(300)
def test_worker_killed_while_the_committed_plan_is_applied_is_rolled_back(runs_dir, reference):
    """After the commit, survivors exchange state with each other: a death there used
    to stop the job (resumably). The plan is now taken back, both failures are
    answered together from the layout before it, and the run matches the reference."""
    run = train(runs_dir / "kill_at_apply", *DP4_PP2, "--checkpoint-every", "2",
                "--fault", "kill:1@3:backward", "--fault", "kill:6@3:apply")  # fmt: skip
    first, second = run.summary.recoveries
    assert first.rolled_back and list(first.ranks) == [1]
    assert list(second.ranks) == [1, 6] and not second.rolled_back
    assert run.summary.steps_completed == reference(4, 2).summary.steps_completed
    diff = compare_runs(run.out, reference(4, 2).out)
    assert diff.loss_rel <= 1e-4 and diff.param_rel <= 1e-4, diff


@pytest.mark.timeout(300)
def test_recoveries_through_a_lossy_bus_match_the_fault_free_run(runs_dir, reference):
    """Every process receives through a transport that drops 10% of messages and
    duplicates, reorders and delays others; two sequential kills still recover, and the
    run matches the fault-free one."""
    run = train(runs_dir / "lossy_bus", *DP4_PP2,
                "--fault", "kill:1@2:backward", "--fault", "kill:6@4:forward",
                "--bus-faults", "drop=0.1,dup=0.1,reorder=0.1,delay=0.005,seed=1")  # fmt: skip
    check_recovered(run, reference(4, 2), world=8, failed=[[1], [6]])
    bus = run.summary.bus
    for counts in (bus.core, bus.workers):
        assert counts["injected_dropped"] > 0 and counts["injected_duplicated"] > 0
        assert counts["duplicates"] > 0 and counts["asked"] > 0, bus
    assert bus.workers["fetched"] > 0, bus  # from the Core's log service


def _worker_pids(out) -> list[int]:
    return [
        r.event.pid
        for r in read_event_log(out / "events.log")
        if isinstance(r.event, WorkerStarted)
    ]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead
        return f.read().split()[2] != "Z"


def _kill_core_when(out, proc: subprocess.Popen, ready, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready(list(read_run_log(out))):
        assert proc.poll() is None, out.with_suffix(".stderr").read_text()
        assert time.monotonic() < deadline, "the job never reached the kill point"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)


@pytest.mark.long
@pytest.mark.timeout(300)
@pytest.mark.parametrize("when", ["mid-step", "during-recovery"])
def test_job_host_killed_leaves_no_process_behind_and_resumes(runs_dir, reference, when):
    """The job host (the ``elaswave train`` process: it holds the store and is the
    parent of the workers and of the Core) is SIGKILLed in step 4, or while a
    recovery's plan is out. Nothing outlives it (workers and Core die with their
    parent), and the run resumes from its last checkpoint to the fault-free result.
    A lost Core alone is restarted: tests/fault/test_core_restart.py."""
    out = runs_dir / f"core_killed_{when}"
    faults = ("--fault", "kill:1@4:backward") if when == "during-recovery" else ()
    proc = launch(out, *DP4_PP2, "--checkpoint-every", "2", *faults)

    def ready(records) -> bool:
        events = [r.event for r in records]
        if when == "during-recovery":
            return any(isinstance(e, RecoveryPlan) for e in events)
        # Heartbeats are periodic: one of step 4 may never be sent before the job ends
        # (seen in scripts/test_long on 65682b4); every step completed is an event.
        return any(
            (isinstance(e, Heartbeat) and e.step >= 4)
            or (isinstance(e, StepCompleted) and e.step >= 3)
            for e in events
        )

    _kill_core_when(out, proc, ready)
    pids = _worker_pids(out)
    assert len(pids) == 8
    pids.append(int((out / "core.pid").read_text()))
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if _alive(p)], "a worker or the Core outlived the job host"
    _resumes_to_the_reference(out, runs_dir, reference(4, 2), first_step={2, 4})
