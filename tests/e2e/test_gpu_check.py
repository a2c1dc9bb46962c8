"""scripts/gpu_check's plumbing on CPU: the bash wrapper, case selection, real runs of a
layout case and a fault case (``--device cpu`` compares two CPU runs), the per-case
lines, the JSON of figures and the exit codes. The GPU figures come from a GPU machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def gpu_check(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHON=sys.executable)
    return subprocess.run(
        [str(ROOT / "scripts" / "gpu_check"), *args],
        capture_output=True, text=True, env=env, timeout=timeout, check=False,
    )  # fmt: skip


def test_the_dry_run_lists_every_case_and_a_bad_selection_is_named():
    listed = gpu_check("--dry-run")
    assert listed.returncode == 0, listed.stderr
    names = [line.split()[1] for line in listed.stdout.splitlines() if line.startswith("PLAN")]
    assert "layout-tiny-tp2" in names and "layout-llama-dp2xpp2" in names
    assert {"kill-grad-sync", "hang-optimizer", "churn", "snapshot-overhead"} <= set(names)
    assert {"exact-sums", "hosts-tp"} <= set(names)
    assert {"layout-llama-tp2", "layout-megatron-tp2", "layout-megatron-dp2xpp2-zb"} <= set(names)
    bad = gpu_check("--cases", "kill-nowhere", "--dry-run")
    assert bad.returncode == 2
    assert "--cases 'kill-nowhere' names no case; valid: layout-tiny-dp2" in bad.stderr
    assert "Traceback" not in bad.stderr


@pytest.mark.timeout(180)
def test_a_slice_runs_end_to_end_on_cpu(tmp_path):
    """A layout case (device run against its CPU twin) and a SIGKILL case (recovered,
    compared with the layout's run, MTTR and release read from the run directory), two
    at a time: the kill case waits for the fault-free run the layout case starts."""
    done = gpu_check(
        "--device", "cpu", "--cases", "layout-tiny-dp2xpp2", "kill-backward",
        "--steps", "5", "--out", str(tmp_path), "--jobs", "2", timeout=170,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    header, *lines = done.stdout.splitlines()
    assert header.startswith("gpu_check: 2 cases, 2 at a time, on {'commit'")
    layout = next(line for line in lines if "layout-tiny-dp2xpp2" in line)
    kill = next(line for line in lines if "kill-backward" in line)
    assert layout.startswith("PASS") and "loss_rel=0" in layout
    assert kill.startswith("PASS") and "mttr_s=" in kill
    assert "2 passed, 0 failed, 0 not run" in done.stdout
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert doc["device"] == "cpu" and doc["steps"] == 5
    kill = {c["name"]: c for c in doc["cases"]}["kill-backward"]
    assert kill["status"] == "PASS" and kill["figures"]["worker_starts"] == 4
    assert 0 <= kill["figures"]["release_s"] < 1.0
