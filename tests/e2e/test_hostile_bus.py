"""Bad messages on a live job's bus are reported and skipped; training goes on."""

from __future__ import annotations

import subprocess
import sys

import msgpack
import pytest

from elaswave.bus.codec import encode
from elaswave.bus.schema import KIND_KEY, RecoveryStarted, StepCompleted
from elaswave.runtime.job.config import JobSpec
from tests.runs import background_job, plain_publisher


def _bad_messages() -> list[list[bytes]]:
    newer = encode(
        StepCompleted(
            sender="rogue", rank=0, step=0, loss=1.0, step_time_s=1.0, samples=1, schema_version=99
        )
    )
    mystery = [
        b"recovery/rogue",
        msgpack.packb({KIND_KEY: "mystery_kind", "sender": "rogue", "schema_version": 1}),
    ]
    missing = [b"recovery/rogue", msgpack.packb({KIND_KEY: "recovery_started", "sender": "rogue"})]
    wrong_topic = encode(
        RecoveryStarted(sender="rogue", step=1, kind="fail-stop", ranks=[0], reason="x")
    )
    wrong_topic[0] = b"control/rogue"
    return [
        newer,
        mystery,
        missing,
        wrong_topic,
        [b"control/rogue", b"\xc1\xff garbage"],
        [b"recovery/rogue"],
        [b"recovery/rogue", b"a", b"b"],
    ]


@pytest.mark.timeout(180)
def test_live_job_survives_hostile_messages(tmp_path):
    out = tmp_path / "run"
    bad = _bad_messages()
    with (
        background_job(out, "--dp", "2", "--pp", "2", "--steps", "40") as job,
        plain_publisher(JobSpec.read(out).endpoints.bus_publish) as pub,
    ):
        # Once the first step is out, every worker's session is subscribed.
        while "step    1/40" not in (line := job.stdout.readline()):
            assert line, "job ended before its first step"
        for frames in bad:
            pub.send_multipart(frames)
        stdout, stderr = job.communicate(timeout=150)
    assert job.returncode == 0, stderr
    assert "step   40/40" in stdout, stdout
    assert stderr.count("bus_message_rejected") == len(bad), stderr
    assert "unknown event kind 'mystery_kind'" in stderr
    assert "unsupported schema_version 99" in stderr
    log = subprocess.run(
        [sys.executable, "-m", "elaswave.cli.main", "events", str(out)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert log.count("INVALID") == len(bad)
    kinds = [line.split()[2] for line in log.splitlines() if "INVALID" not in line]
    # Workers saw the control/recovery ones too, skipped them, and finished normally.
    assert kinds.count("step_completed") == 40 and kinds.count("worker_finished") == 4
