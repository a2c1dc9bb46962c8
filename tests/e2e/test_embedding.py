"""The embedding API: the example runs, and a user process can attach to a live job."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

import elaswave
from elaswave.bus.schema import EventKind
from tests.runs import background_job

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_embed_example_pauses_on_recovery_and_streams_steps():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "embed_training.py")],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    started = lines.index("[callback] recovery started at step 4: rank 5 stopped heartbeating")
    finished = next(i for i, line in enumerate(lines) if line.startswith("[callback] recovery fin"))
    step4 = lines.index(next(line for line in lines if line.startswith("[dashboard] step 4 ")))
    # Training paused at the step boundary: step 4 ran only after the recovery finished.
    assert started < finished < step4
    assert lines[-1] == "trained 8 steps; dashboard saw steps [0, 1, 2, 3, 4, 5, 6, 7]"


@pytest.mark.timeout(180)
def test_connect_to_a_running_job(tmp_path):
    out = tmp_path / "run"
    with background_job(out, "--dp", "1", "--pp", "2", "--steps", "60") as job:
        steps: list[int] = []

        async def watch(session: elaswave.Session) -> None:
            async for event in session.events(kinds=[EventKind.STEP_COMPLETED]):
                steps.append(event.step)
                if len(steps) == 3:
                    return

        with elaswave.connect(out, sender="test-observer") as session:
            asyncio.run(asyncio.wait_for(watch(session), timeout=90))
        assert steps == sorted(steps) and len(steps) == 3
        _, stderr = job.communicate(timeout=120)
        assert job.returncode == 0, stderr


def test_connect_refuses_a_non_run_dir(tmp_path):
    with pytest.raises(ValueError, match=r"has no job\.json"):
        elaswave.connect(tmp_path)
