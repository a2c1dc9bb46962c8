"""A job across three hosts (network namespaces), one agent per host as torchrun runs:
node 0 runs the Core, the store and its workers; nodes 1 and 2 run agents. Killing a
host's agent (its workers die with it) is a node failure recovered in-process; the host
coming back joins; the run matches the fault-free one and replay reproduces every plan."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from elaswave.bus.eventlog import read_event_log
from elaswave.bus.schema import RecoveryFinished, StepTiming, WorkerSpawned
from elaswave.runtime.core.compare import compare_runs
from tests import netns
from tests.runs import Run, check_replay, elaswave, train, wait_for_event

NET = "10.78.0"
HOSTS = 3
PORT = 29533
# 48 steps: a returning host's workers take seconds to start (a fresh agent, torch imported
# under load: 8 s on the 2-core host), and the join must come before the job ends.
JOB = ("--dp", "3", "--pp", "2", "--steps", "48", "--global-batch", "24", "--micro-batch", "2",
       "--device", "emulated", "--heartbeat-timeout", "2")  # fmt: skip


@pytest.fixture
def hosts() -> Iterator[list[str]]:
    """Hosts emh0..emh2 at NET.10.. on bridge embr0: node 0's address first."""
    with netns.hosts("em", NET, HOSTS) as addresses:
        yield addresses


def _host(i: int, out: Path, keys: Path, node0: str, *extra: str) -> subprocess.Popen:
    """``elaswave train`` as node ``i`` inside its namespace (its stderr beside OUT)."""
    err = (out.parent / f"{out.name}.node{i}.stderr").open("a")
    with contextlib.closing(err):
        return subprocess.Popen(
            ["ip", "netns", "exec", f"emh{i}", "env", "GLOO_SOCKET_IFNAME=eth0",
             sys.executable, "-m", "elaswave.cli.main", "train", "--out", str(out),
             "--nnodes", str(HOSTS), "--node-rank", str(i), "--nproc-per-node", "2",
             "--rdzv-endpoint", f"{node0}:{PORT}", "--bus-keys", str(keys), *extra],
            stdout=subprocess.DEVNULL, stderr=err,
        )  # fmt: skip


@pytest.mark.long
@pytest.mark.timeout(400)
def test_a_host_lost_whole_is_a_node_failure_and_its_return_a_join(hosts, runs_dir, tmp_path):
    keys = tmp_path / "keys"
    assert elaswave("keys", str(keys), timeout=60).returncode == 0
    out = runs_dir / "multihost"
    node0 = _host(0, out, keys, hosts[0], *JOB)
    agents = {i: _host(i, out, keys, hosts[0]) for i in (1, 2)}
    try:
        wait_for_event(out, lambda e: isinstance(e, StepTiming) and e.step >= 4, node0)
        agents[1].send_signal(signal.SIGKILL)  # the host: its agent and, with it, its workers
        agents[1].wait(30)
        wait_for_event(
            out, lambda e: isinstance(e, RecoveryFinished) and e.kind == "fail-stop", node0
        )
        agents[1] = _host(1, out, keys, hosts[0])  # the host comes back
        assert node0.wait(300) == 0, (out.parent / "multihost.node0.stderr").read_text()
        assert agents[2].wait(60) == 0
        assert agents[1].wait(60) == 0
    finally:
        for proc in (node0, *agents.values()):
            if proc.poll() is None:
                proc.kill()
    run = Run(out, subprocess.CompletedProcess(node0.args, 0, "", ""))
    check_replay(run)
    s = run.summary
    assert s.steps_completed == 48
    kinds = [(r.kind, sorted(r.ranks)) for r in s.recoveries]
    assert kinds[0] == ("fail-stop", [2, 3]), kinds  # node 1 held ranks 2 and 3
    joined = sorted(r for kind, ranks in kinds[1:] if kind == "join" for r in ranks)
    assert joined == [6, 7], kinds  # its return: two joiners (in one change or two)
    spawned = {
        r.event.rank: r.event.sender
        for r in read_event_log(out / "events.log")
        if isinstance(r.event, WorkerSpawned)
    }
    assert spawned == {2: "node1", 3: "node1", 4: "node2", 5: "node2", 6: "node1", 7: "node1"}
    ref = train(runs_dir / "multihost_ref", *JOB)
    diff = compare_runs(out, ref.out)
    assert diff.loss_rel <= 1e-4 and diff.param_rel <= 1e-4, diff
