"""Fixtures shared by the e2e and fault suites, and the property tests' settings.

Property tests (hypothesis) run derandomized by default: the same examples on every run,
so the suite's outcome depends on the code alone, never on which examples a run happened
to draw, and no wall-clock deadline (the host may be loaded). Random exploration is a
separate, deliberate run: ``ELASWAVE_HYPOTHESIS=explore`` (``scripts/model_check`` sets
it), and whatever it finds becomes an explicit example or an exhaustive test.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None, database=None)
settings.register_profile("explore", deadline=None, database=None)
settings.load_profile(os.environ.get("ELASWAVE_HYPOTHESIS", "ci"))


@pytest.fixture(scope="session")
def runs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One directory for the session's training runs (reference runs are shared)."""
    return tmp_path_factory.mktemp("runs")
