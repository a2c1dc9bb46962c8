"""A lost Core is started again and the job goes on: workers train through the outage.

The Core is a child process of the job host, which keeps the workers and the store.
These tests SIGKILL (or SIGSTOP) the real Core process at named points: in the middle
of a step, right after a recovery's plan is published, and right after its commit. Each run must end
as the fault-free run does, without a worker restarted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from elaswave.bus.eventlog import read_event_log
from elaswave.bus.schema import StepCompleted, StepTiming, WorkerStarted
from elaswave.fabric.checkpoint import step_complete
from elaswave.rundir import JOB as JOB_SPEC
from elaswave.runtime.core.compare import compare_runs, load_params, param_rel_diff
from elaswave.runtime.core.runlog import read_run_log
from elaswave.runtime.core.supervisor import CORE_FAULT_ENV, CORE_RESTORE_EVERY_ENV
from elaswave.runtime.job.config import JobSpec
from tests.fault.recovery import JOB, check_recovered
from tests.runs import Run, check_replay, launch, train

DP2_PP2 = ("--dp", "2", "--pp", "2")
DP4_PP2 = ("--dp", "4", "--pp", "2", *JOB)
LONGER = ("--steps", "60", "--global-batch", "16", "--micro-batch", "2")


@pytest.fixture(scope="module")
def longer_reference(runs_dir) -> Run:
    return train(runs_dir / "ref_core_2x2_60", *DP2_PP2, *LONGER)


def _signal_core_when(out, proc, ready, sig: signal.Signals, timeout_s: float = 120) -> int:
    """Send ``sig`` to the Core process once the event log satisfies ``ready``."""
    deadline = time.monotonic() + timeout_s
    while not (
        (out / "core.pid").exists()
        and (out / "events.log").exists()
        and ready([r.event for r in read_run_log(out)])
    ):
        assert proc.poll() is None, out.with_suffix(".stderr").read_text()
        assert time.monotonic() < deadline, "the job never reached the signal point"
        time.sleep(0.01)
    pid = int((out / "core.pid").read_text())
    os.kill(pid, sig)
    return pid


def _finished(out, proc, timeout_s: float = 240) -> Run:
    code = proc.wait(timeout_s)
    assert code == 0, out.with_suffix(".stderr").read_text()
    run = Run(out, subprocess.CompletedProcess(proc.args, code))
    check_replay(run)
    return run


def _log_records(path, event: str) -> list[dict]:
    docs = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{") and f'"{event}"' in line:
            doc = json.loads(line)
            if doc.get("event") == event:
                docs.append(doc)
    return docs


def _started_once(out, world: int) -> None:
    started = [
        r.event.rank
        for r in read_event_log(out / "events.log")
        if isinstance(r.event, WorkerStarted)
    ]
    assert sorted(started) == list(range(world)), "a worker was started again"


def _at_step(step: int):
    """Some worker is in ``step``: it reported the step before (heartbeats, which say the
    step a worker is in, are logged once in 5 s; step timings in the health log)."""
    return lambda events: any(isinstance(e, StepTiming) and e.step >= step - 1 for e in events)


def _checkpointed(out, step: int):
    """The checkpoint of ``step`` is complete on disk (every layer's pieces)."""

    def done(events) -> bool:
        if not (out / JOB_SPEC).is_file():  # written after the Core's log opens
            return False
        return step_complete(out, step, JobSpec.read(out).config.model.num_layers)

    return done


@pytest.mark.timeout(300)
@pytest.mark.parametrize("points", [False, True])
def test_core_killed_mid_step_is_restarted_while_the_workers_train_on(
    runs_dir, longer_reference, points
):
    """SIGKILL the Core in step 3; the host starts another 1 s later (a restart back-off),
    which binds the same endpoints and reads back the log (``points``: from a restore
    point the Core took every 2 kB of log, and the log after it). The workers train on
    meanwhile: steps completed during the outage (stamped by their senders) reach the
    new Core's log, asked for again, and no worker paused."""
    out = runs_dir / f"core_restart_mid_step{'_points' if points else ''}"
    env = dict(os.environ, **({CORE_RESTORE_EVERY_ENV: "2048"} if points else {}))
    proc = launch(out, *DP2_PP2, *LONGER, "--core-restart-delay", "1", env=env)
    _signal_core_when(out, proc, _at_step(3), signal.SIGKILL)
    killed_at = time.time()
    run = _finished(out, proc)
    s = run.summary
    assert s.core_incarnations == 2 and s.recoveries == ()
    diff = compare_runs(out, longer_reference.out)
    assert diff.loss_rel <= 1e-6 and diff.param_rel <= 1e-6, diff
    _started_once(out, 4)
    (restored,) = _log_records(out / "logs" / "core1.log", "core.restored")
    back_at = _iso_time(restored["timestamp"])
    assert back_at - killed_at >= 1.0
    # The new Core fed the protocol only what its predecessor's persisted state had not
    # taken in: not every step's reports since the run began.
    if points:
        assert 0 < restored["point"] < (out / "events.log").stat().st_size
        assert restored["backlog"] < 8
    else:
        assert restored["point"] == 0
        assert restored["taken_before"] >= 8 and restored["backlog"] < restored["taken_before"]
    during = [
        r.event.step
        for r in read_event_log(out / "events.log")
        if isinstance(r.event, StepCompleted) and killed_at < r.event.time < back_at
    ]
    assert len(during) >= 2, "the workers did not train while the Core was away"
    assert sorted(e.step for e in _completed(out)) == list(range(60)), "a step went unreported"
    for rank in range(4):
        assert not _log_records(out / "logs" / f"rank{rank}.log", "core.outage_paused")


def _completed(out) -> list:
    events = [r.event for r in read_event_log(out / "events.log")]
    return [e for e in events if isinstance(e, StepCompleted)]


def _iso_time(text: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


@pytest.mark.timeout(300)
@pytest.mark.long
def test_core_silent_past_the_bound_pauses_every_worker_at_one_boundary(runs_dir, longer_reference):
    """SIGSTOP the Core for 3 s with a 1 s outage bound: the workers agree through the
    store on one step boundary, all wait there with their state, and resume when the
    Core is heard again; the Core does not fence them for the silence it slept through."""
    out = runs_dir / "core_outage_pause"
    proc = launch(out, *DP2_PP2, *LONGER, "--core-outage", "1")
    pid = _signal_core_when(out, proc, _at_step(2), signal.SIGSTOP)
    time.sleep(3.0)
    os.kill(pid, signal.SIGCONT)
    run = _finished(out, proc)
    assert run.summary.core_incarnations == 1 and run.summary.recoveries == ()
    paused = [_log_records(out / "logs" / f"rank{r}.log", "core.outage_paused") for r in range(4)]
    resumed = [_log_records(out / "logs" / f"rank{r}.log", "core.outage_resumed") for r in range(4)]
    assert all(len(p) == 1 for p in paused), paused
    assert len({p[0]["step"] for p in paused}) == 1, paused
    assert all(len(r) == 1 and r[0]["paused_s"] > 0.5 for r in resumed), resumed
    diff = compare_runs(out, longer_reference.out)
    assert diff.loss_rel <= 1e-6 and diff.param_rel <= 1e-6, diff


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "when",
    ["plan", pytest.param("commit", marks=pytest.mark.long)],
)
# long: Core restarts: the mid-step case; recoveries across restarts: tests/unit/test_core_state.py
@pytest.mark.long
def test_core_killed_during_a_recovery_is_restarted_and_finishes_it(runs_dir, reference, when):
    """Rank 1 dies in step 4 and the Core SIGKILLs itself right after it has published
    the recovery's plan (its successor announces the plan again as a new attempt, which
    the survivors acknowledge) or its commit (its successor waits for the survivors to
    apply it). The kill point is the Core's own, as a worker's ``kill:`` fault is: a
    watcher polling the log cannot land between a plan and its commit reliably."""
    out = runs_dir / f"core_restart_{when}"
    # The successor restores from a restore point (one every 2 kB of log).
    env = dict(os.environ, **{CORE_FAULT_ENV: when, CORE_RESTORE_EVERY_ENV: "2048"})
    proc = launch(out, *DP4_PP2, "--fault", "kill:1@4:backward", env=env)
    run = _finished(out, proc)
    check_recovered(run, reference(4, 2), world=8, failed=[[1]])
    (rec,) = run.summary.recoveries
    assert rec.superseded == (1 if when == "plan" else 0)
    assert run.summary.core_incarnations == 2
    (injected,) = _log_records(out / "logs" / "core0.log", "core.fault_injected")
    assert injected["point"] == when
    (resuming,) = _log_records(out / "logs" / "core1.log", "core.resuming")
    assert resuming["state"] == ("announced" if when == "plan" else "committed")
    (restored,) = _log_records(out / "logs" / "core1.log", "core.restored")
    assert restored["point"] > 0


@pytest.mark.long
@pytest.mark.timeout(300)
def test_core_lost_more_often_than_allowed_stops_with_a_resumable_checkpoint(runs_dir, reference):
    out = runs_dir / "core_restarts_spent"
    proc = launch(out, *DP4_PP2, "--core-restarts", "0", "--checkpoint-every", "2")
    # after the checkpoint of step 1, long before the end (workers train on until the
    # host, told of the loss, stops them)
    _signal_core_when(out, proc, _checkpointed(out, 1), signal.SIGKILL)
    assert proc.wait(120) == 1
    err = out.with_suffix(".stderr").read_text()
    assert "the Core was lost (signal SIGKILL; see logs/core0.log)" in err, err
    assert "--core-restarts 0" in err and f"--resume {out}" in err, err
    resumed = train(runs_dir / "core_restarts_spent_resumed", "--resume", str(out))
    assert resumed.summary.steps_completed == 6
    assert param_rel_diff(load_params(resumed.out), load_params(reference(4, 2).out)) <= 1e-5


@pytest.mark.timeout(300)
@pytest.mark.long  # Core restarts: the mid-step case
def test_core_lost_after_every_worker_finished_leaves_a_complete_run(runs_dir, reference):
    """The Core dies once the workers are done, before it wrote the summary, and may not
    be restarted: the job host writes the summary from the workers' results."""
    out = runs_dir / "core_lost_at_the_end"
    env = dict(os.environ, **{CORE_FAULT_ENV: "finished"})
    proc = launch(out, *DP2_PP2, *JOB, "--core-restarts", "0", env=env)
    run = _finished(out, proc)
    assert run.summary.steps_completed == 6
    diff = compare_runs(out, reference(2, 2).out)
    assert diff.loss_rel <= 1e-6 and diff.param_rel <= 1e-6, diff
    assert "host.summarising" in out.with_suffix(".stderr").read_text()
