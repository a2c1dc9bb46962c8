"""Workers on separate network hosts, and one host's link cut mid-training.

Each worker runs in its own network namespace (``ip netns``) behind a veth pair on a
bridge, with its own ``eth0``: a host that reaches the others only through its link. The
Core's bus and store bind on the bridge's address (the bus under CURVE keys, as any
non-loopback bus must). Cutting a link is what a switch port or cable failure does: the
worker lives on, holding its connections, but nothing it sends arrives.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from elaswave.bus.eventlog import read_event_log
from elaswave.bus.schema import FailureDetected, StepTiming
from elaswave.runtime.core.compare import compare_runs
from elaswave.runtime.core.runlog import read_run_log
from tests import netns
from tests.runs import Run, check_replay, elaswave, train

NET = "10.77.0"
HOSTS = 4
JOB = ("--dp", "2", "--pp", "2", "--steps", "10", "--global-batch", "16", "--micro-batch", "2")


@pytest.fixture
def hosts() -> Iterator[str]:
    """Hosts ewh0..ewh3 at NET.10.. on bridge ewbr0 (NET.1, where the Core binds)."""
    with netns.hosts("ew", NET, HOSTS):
        yield f"{NET}.1"


def _cut_when(out, proc: subprocess.Popen, step: int, rank: int) -> float:
    """Take rank's host off the network once some worker is in ``step``; the cut time."""
    deadline = time.monotonic() + 120
    while not any(
        isinstance(r.event, StepTiming) and r.event.step >= step for r in read_run_log(out)
    ):
        assert proc.poll() is None, "the job ended before the cut"
        assert time.monotonic() < deadline, "the job never reached the cut"
        time.sleep(0.05)
    netns.ip("link", "set", f"ewv{rank}", "down")
    return time.time()


@pytest.mark.long
@pytest.mark.timeout(400)
def test_a_host_cut_off_the_network_is_fenced_and_recovered(hosts, runs_dir, tmp_path):
    keys = tmp_path / "keys"
    assert elaswave("keys", str(keys), timeout=60).returncode == 0
    out = runs_dir / "partition"
    args = (*JOB, "--bus-host", hosts, "--bus-keys", str(keys), "--heartbeat-timeout", "2",
            "--worker-prefix", "ip netns exec ewh{rank} env GLOO_SOCKET_IFNAME=eth0")  # fmt: skip
    err = (runs_dir / "partition.stderr").open("w")
    with contextlib.closing(err):
        proc = subprocess.Popen(
            [sys.executable, "-m", "elaswave.cli.main", "train", "--out", str(out), *args],
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
        try:
            cut_at = _cut_when(out, proc, step=4, rank=1)
            proc.wait(300)
        finally:
            if proc.poll() is None:
                proc.kill()
    stderr = (runs_dir / "partition.stderr").read_text()
    assert proc.returncode == 0, stderr
    run = Run(out, subprocess.CompletedProcess(proc.args, 0, "", stderr))
    check_replay(run)
    (rec,) = run.summary.recoveries
    assert rec.ranks == (1,) and rec.kind == "fail-stop"
    assert "no heartbeat" in stderr and "fenced" in stderr
    assert run.summary.steps_completed == 10
    # Seen from the missed heartbeats: about the heartbeat deadline after the cut.
    detected = next(
        r.t for r in read_event_log(out / "events.log") if isinstance(r.event, FailureDetected)
    )
    assert 1.5 < detected - cut_at < 10, detected - cut_at
    ref = train(runs_dir / "partition_ref", *JOB)
    diff = compare_runs(out, ref.out)
    assert diff.loss_rel <= 1e-4 and diff.param_rel <= 1e-4, diff
