"""An authenticated bus beyond loopback: ``elaswave keys``, then a job whose bus binds on
this host's interface address with CURVE. It recovers from a SIGKILL as on loopback; a
publisher without the job's keys, on the same address, gets nothing into the job."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from elaswave.bus.codec import encode
from elaswave.bus.schema import StepCompleted
from elaswave.runtime.job.config import JobSpec
from tests.runs import Run, background_job, check_replay, elaswave, plain_publisher


def _interface_address() -> str:
    """This host's address on its default route (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))
        return probe.getsockname()[0]


@pytest.mark.timeout(240)
def test_a_curve_bus_beyond_loopback_recovers_and_keeps_strangers_out(tmp_path):
    host = _interface_address()
    assert not host.startswith("127."), "the host needs a non-loopback interface"
    made = elaswave("keys", str(tmp_path / "keys"), timeout=60)
    assert made.returncode == 0 and "--bus-keys" in made.stdout, made.stderr
    out = tmp_path / "run"
    args = ("--bus-host", host, "--bus-keys", str(tmp_path / "keys"), "--dp", "2", "--pp", "2",
            "--steps", "12", "--fault", "kill:1@6:backward")  # fmt: skip
    rogue = encode(StepCompleted(sender="rogue", rank=0, step=0, loss=0.0, step_time_s=0.0,
                                 samples=1))  # fmt: skip
    with background_job(out, *args) as job:
        endpoint = JobSpec.read(out).endpoints.bus_publish
        assert endpoint.startswith(f"tcp://{host}:")
        with plain_publisher(endpoint) as pub:  # no keys: the CURVE handshake refuses it
            while "step    2/12" not in (line := job.stdout.readline()):
                assert line, "job ended before its second step"
            for _ in range(50):
                pub.send_multipart(rogue)
            stdout, stderr = job.communicate(timeout=180)
    assert job.returncode == 0, stderr
    run = Run(out, subprocess.CompletedProcess([], 0, stdout, stderr))
    assert run.summary.steps_completed == 12
    assert [r.ranks for r in run.summary.recoveries] == [(1,)]
    check_replay(run)
    log = subprocess.run([sys.executable, "-m", "elaswave.cli.main", "events", str(out)],
                         capture_output=True, text=True, check=True, timeout=60).stdout  # fmt: skip
    assert "rogue" not in log and "step_completed" in log


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--bus-host", "192.0.2.2"), "binding beyond loopback needs CURVE keys"),
        (("--bus-host", "bus.example"), "must be an IP address of this host"),
        (("--bus-keys", "/nonexistent/keys"), "server.key_secret' is missing; make keys"),
    ],
)
def test_bus_flags_are_checked_before_anything_starts(tmp_path, args, message):
    proc = elaswave("train", "--steps", "1", "--out", str(tmp_path / "r"), *args, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert message in proc.stderr, proc.stderr
    assert not (tmp_path / "r" / "job.json").exists()


def test_keys_are_never_overwritten(tmp_path):
    assert elaswave("keys", str(tmp_path), timeout=60).returncode == 0
    again = elaswave("keys", str(tmp_path), timeout=60)
    assert again.returncode == 2 and "already holds keys" in again.stderr
