"""Fixtures shared by the e2e and fault suites."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def runs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One directory for the session's training runs (reference runs are shared)."""
    return tmp_path_factory.mktemp("runs")
