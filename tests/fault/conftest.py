"""Fault-test fixtures: fault-free reference runs, trained once per session."""

from __future__ import annotations

import pytest

from tests.fault.recovery import JOB
from tests.runs import Run, train


@pytest.fixture(scope="session")
def reference(runs_dir):
    cache: dict[tuple[int, int, int], Run] = {}

    def get(dp: int, pp: int, rpn: int = 1) -> Run:
        if (dp, pp, rpn) not in cache:
            cache[(dp, pp, rpn)] = train(
                runs_dir / f"ref_{dp}x{pp}_{rpn}",
                "--dp",
                str(dp),
                "--pp",
                str(pp),
                "--ranks-per-node",
                str(rpn),
                *JOB,
            )
        return cache[(dp, pp, rpn)]

    return get
