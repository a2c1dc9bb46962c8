"""A job on two hosts that share no run directory (two agents on loopback): node 1's
agent hears node 0's requests and starts its workers, the job trains as on one host,
and node 0's summary takes what its own disk lacks from the event log."""

from __future__ import annotations

import signal
import socket

import pytest

from elaswave.bus.schema import RecoveryFinished, StepTiming, WorkerSpawned, WorkerStarted
from elaswave.runtime.core.compare import compare_runs, load_params, loss_rel_diff, param_rel_diff
from elaswave.runtime.core.runlog import read_run_log
from elaswave.runtime.job.results import read_summary
from tests.fault.recovery import JOB
from tests.runs import launch, train, wait_for_event


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.timeout(240)
def test_two_hosts_without_a_shared_run_directory_train_as_one(runs_dir, reference) -> None:
    """dp2 x pp2 over two hosts of two ranks, each its own run directory: node 1 holds
    the last stage, so node 0's disk has none of its results. Both hosts exit 0; node
    0's summary has every step's loss (from the StepCompleted node 1's last stage
    published), equal to the one-host run's, and no parameter digest (it holds stage
    0's parameters only); the two hosts' parameters together equal the one-host run's."""
    rdzv = f"127.0.0.1:{_free_port()}"
    hosts = ("--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", rdzv)
    node0 = launch(
        runs_dir / "two_hosts0", "--dp", "2", "--pp", "2", *JOB, *hosts, "--node-rank", "0"
    )
    node1 = launch(runs_dir / "two_hosts1", *hosts, "--node-rank", "1")
    assert node0.wait(200) == 0, (runs_dir / "two_hosts0.stderr").read_text()[-2000:]
    assert node1.wait(60) == 0, (runs_dir / "two_hosts1.stderr").read_text()[-2000:]
    ref = reference(2, 2)
    summary = read_summary(runs_dir / "two_hosts0")
    assert summary.steps_completed == ref.summary.steps_completed
    assert loss_rel_diff(summary.loss, ref.summary.loss) <= 1e-6
    assert summary.param_digest is None and ref.summary.param_digest is not None
    here, there = load_params(runs_dir / "two_hosts0"), load_params(runs_dir / "two_hosts1")
    assert here.keys().isdisjoint(there.keys())
    assert param_rel_diff(here | there, ref.params()) <= 1e-6


@pytest.mark.timeout(240)
def test_a_tp_group_per_host_trains_on_when_a_member_on_the_other_host_dies(
    runs_dir, reference
) -> None:
    """dp2 x tp2 on two hosts of two workers, a TP group on each (their own run
    directories): node 1's workers take that host's devices 0 and 1 (not the devices of
    their process ranks 2 and 3). A member of node 1's group is killed mid-backward; its
    other member, on node 1, is released through node 1's agent, and the job trains on
    with node 0's group to the fault-free run's losses and parameters."""
    rdzv = f"127.0.0.1:{_free_port()}"
    hosts = ("--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", rdzv)
    job = ("--dp", "2", "--pp", "1", "--tp", "2", *JOB)
    fault = ("--fault", "kill:3@3:backward")
    node0 = launch(runs_dir / "tp_hosts0", *job, *fault, *hosts, "--node-rank", "0")
    node1 = launch(runs_dir / "tp_hosts1", *hosts, "--node-rank", "1")
    assert node0.wait(200) == 0, (runs_dir / "tp_hosts0.stderr").read_text()[-2000:]
    assert node1.wait(60) == 0, (runs_dir / "tp_hosts1.stderr").read_text()[-2000:]
    summary = read_summary(runs_dir / "tp_hosts0")
    (rec,) = summary.recoveries
    assert rec.kind == "fail-stop" and rec.ranks == (1,)
    started = [r.event for r in read_run_log(runs_dir / "tp_hosts0")]
    local = {e.rank: e.local_rank for e in started if isinstance(e, WorkerStarted)}
    assert local == {0: 0, 1: 0}  # each group's leader: device 0 of its own host
    diff = compare_runs(runs_dir / "tp_hosts0", reference(1, 1).out)
    assert diff.loss_rel <= 1e-4 and diff.param_rel <= 1e-4, diff


@pytest.mark.long  # a restart on one host: tests/fault/test_restarts.py
@pytest.mark.timeout(240)
def test_a_tp_group_killed_on_a_host_that_is_up_is_started_again_there(runs_dir, reference):
    """As above with ``--max-restarts 1``: once both members of node 1's group have
    exited, node 0 offers node 1's two devices again; the new group (rank 2, processes
    4 and 5) starts there through node 1's agent on its devices 0 and 1, joins, and
    the job ends at the fault-free run's losses and parameters."""
    rdzv = f"127.0.0.1:{_free_port()}"
    hosts = ("--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", rdzv)
    job = ("--dp", "2", "--pp", "1", "--tp", "2", *JOB, "--max-restarts", "1")
    fault = ("--fault", "kill:3@3:backward")
    node0 = launch(runs_dir / "tp_restart0", *job, *fault, *hosts, "--node-rank", "0")
    node1 = launch(runs_dir / "tp_restart1", *hosts, "--node-rank", "1")
    assert node0.wait(200) == 0, (runs_dir / "tp_restart0.stderr").read_text()[-2000:]
    assert node1.wait(60) == 0, (runs_dir / "tp_restart1.stderr").read_text()[-2000:]
    summary = read_summary(runs_dir / "tp_restart0")
    assert [(r.kind, r.ranks) for r in summary.recoveries] == [("fail-stop", (1,)), ("join", (2,))]
    events = [r.event for r in read_run_log(runs_dir / "tp_restart0")]
    spawned = {e.rank: e.node for e in events if isinstance(e, WorkerSpawned)}
    assert spawned == {2: 1, 3: 1, 4: 1, 5: 1}  # node 1's processes, the new group's too
    local = {e.rank: e.local_rank for e in events if isinstance(e, WorkerStarted)}
    assert local == {0: 0, 1: 0, 2: 0}
    diff = compare_runs(runs_dir / "tp_restart0", reference(1, 1).out)
    assert diff.loss_rel <= 1e-4 and diff.param_rel <= 1e-4, diff


TP_BACK = ("--dp", "2", "--pp", "1", "--tp", "2", "--steps", "40", "--global-batch", "8",
           "--micro-batch", "2", "--device", "emulated", "--heartbeat-timeout", "2")  # fmt: skip
"""40 steps: a returning host's agent takes seconds to start, and its join must come
before the job ends."""


@pytest.mark.long
@pytest.mark.timeout(300)
def test_a_host_of_tp_groups_lost_and_back_rejoins_with_whole_groups(runs_dir) -> None:
    """dp2 x tp2 on two hosts, a TP group each. Node 1's agent is killed (its host lost:
    the group's members die with it), the job trains on with node 0's group; the agent
    comes back, offers its two slots as one group, and the group (workers 4 and 5)
    starts there, on that host's devices 0 and 1, and joins. The run matches the
    fault-free one."""
    rdzv = f"127.0.0.1:{_free_port()}"
    hosts = ("--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", rdzv)
    out = runs_dir / "tp_back0"
    node0 = launch(out, *TP_BACK, *hosts, "--node-rank", "0")
    agent = launch(runs_dir / "tp_back1", *hosts, "--node-rank", "1")
    try:
        wait_for_event(out, lambda e: isinstance(e, StepTiming) and e.step >= 4, node0)
        agent.send_signal(signal.SIGKILL)  # the host: its agent and, with it, its workers
        agent.wait(30)
        wait_for_event(
            out, lambda e: isinstance(e, RecoveryFinished) and e.kind == "fail-stop", node0
        )
        agent = launch(runs_dir / "tp_back1b", *hosts, "--node-rank", "1")  # it comes back
        assert node0.wait(240) == 0, (runs_dir / "tp_back0.stderr").read_text()[-3000:]
        assert agent.wait(60) == 0, (runs_dir / "tp_back1b.stderr").read_text()[-3000:]
    finally:
        for proc in (node0, agent):
            if proc.poll() is None:
                proc.kill()
    s = read_summary(out)
    assert s.steps_completed == 40
    assert [(r.kind, sorted(r.ranks)) for r in s.recoveries] == [
        ("fail-stop", [1]), ("join", [2]),
    ]  # fmt: skip
    events = [r.event for r in read_run_log(out)]
    spawned = {e.rank: e.sender for e in events if isinstance(e, WorkerSpawned)}
    assert spawned == {2: "node1", 3: "node1", 4: "node1", 5: "node1"}
    local = {e.rank: e.local_rank for e in events if isinstance(e, WorkerStarted)}
    assert local == {0: 0, 1: 0, 2: 0}
    ref = train(runs_dir / "tp_back_ref", *TP_BACK)
    diff = compare_runs(out, ref.out)
    assert diff.loss_rel <= 1e-4 and diff.param_rel <= 1e-4, diff
