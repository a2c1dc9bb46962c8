"""Helpers for tests that drive the real ``elaswave`` CLI in subprocesses."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from elaswave.runtime.compare import load_params


@dataclass
class Run:
    out: Path
    proc: subprocess.CompletedProcess

    @property
    def summary(self) -> dict:
        return json.loads((self.out / "summary.json").read_text())

    def workers(self) -> list[dict]:
        return [json.loads(p.read_text()) for p in sorted((self.out / "workers").glob("*.json"))]

    def params(self) -> dict[int, dict[str, torch.Tensor]]:
        return load_params(self.out)


def elaswave(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "elaswave.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def train(out: Path, *args: str, timeout: float = 240) -> Run:
    proc = elaswave("train", "--out", str(out), *args, timeout=timeout)
    assert proc.returncode == 0, f"train failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return Run(out, proc)


@pytest.fixture(scope="session")
def runs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("runs")
