"""``run_job`` called from a program: no zygote, the Core is started with exec."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROGRAM = """
import sys
from pathlib import Path

import uvloop

from elaswave.runtime.job.config import JobConfig
from elaswave.runtime.job.sections import LayoutConfig, ScheduleConfig
from elaswave.runtime.host.launcher import run_job

kinds = []
cfg = JobConfig(
    layout=LayoutConfig(dp=1, pp=2), schedule=ScheduleConfig(steps=3, global_batch=8, micro_batch=2)
)
summary = uvloop.run(run_job(cfg, Path(sys.argv[1]), on_event=lambda e: kinds.append(e.KIND)))
print(summary.steps_completed, summary.core_incarnations, kinds.count("step_completed"))
"""


@pytest.mark.timeout(120)
def test_run_job_from_a_program_starts_its_core_without_a_zygote(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(out)],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    steps, incarnations, completed = (int(x) for x in proc.stdout.splitlines()[-1].split())
    assert (steps, incarnations, completed) == (3, 1, 3), "on_event saw every step complete"
    assert (out / "logs" / "core0.log").is_file()
    assert json.loads((out / "core_result.json").read_text()) == {"ok": True}
