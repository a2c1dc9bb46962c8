"""Fault-test fixtures: the device their jobs run on, and fault-free reference runs,
trained once per session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests import runs
from tests.fault.recovery import JOB
from tests.runs import Run, train


@pytest.fixture(autouse=True)
def strict_device() -> Iterator[None]:
    """Fault tests run their jobs on ``--device cpu-strict``, whose training traffic
    keeps NCCL's rules, unless a test names its device (emulated ones do)."""
    runs.DEVICE_ARGS = ("--device", "cpu-strict")
    yield
    runs.DEVICE_ARGS = ()


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
