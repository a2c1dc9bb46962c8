"""scripts/bench_core_capacity.py: a Core hears every message of a crowd of workers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_a_core_hears_every_message_of_fifty_workers(tmp_path: Path) -> None:
    """50 workers' heartbeats and beacons (450 a second) over 2 s: the Core records each
    (the load's messages are counted where the recorder dispatches them), within a few
    milliseconds, and the report says so."""
    cmd = [sys.executable, "scripts/bench_core_capacity.py", "--workers", "50"]
    cmd += ["--seconds", "2", "--warmup", "0.5", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=100, check=False)
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads((tmp_path / "core_capacity.json").read_text())
    assert row["offered_msgs_per_s"] == 450
    assert row["received_msgs_per_s"] == pytest.approx(450, rel=0.05)
    assert 0 < row["delay_ms_median"] < 50
    assert 0 < row["core_cpu_fraction"] < 1
    assert "| 50 | 450 |" in (tmp_path / "core_capacity.md").read_text()


def test_bad_arguments_get_one_message() -> None:
    cmd = [sys.executable, "scripts/bench_core_capacity.py", "--workers", "0"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2
    assert "--workers takes positive counts" in proc.stderr
    assert "Traceback" not in proc.stderr
