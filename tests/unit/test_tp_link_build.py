"""A TP group's first build, like its rebuilds, is abandoned only by a failure of its own
unit announced during it (chaos seed 66203 case 19: a joining unit's member died of
another unit's failure announced while it built its TP group)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from elaswave.comm.abort import AbortSignal, StepAborted
from elaswave.comm.backend import backend_for
from elaswave.runtime.worker.tpgroup import TpLink

pytestmark = pytest.mark.timeout(60)


def _build(store: dist.Store, member: int, abort: AbortSignal, out: dict) -> None:
    try:
        out[member] = TpLink(
            store, unit=2, member=member, size=2, backend=backend_for("cpu-strict"),
            timeout=timedelta(seconds=20), abort=abort,
        )  # fmt: skip
    except StepAborted as exc:
        out[member] = exc


def _first_member_waiting(ranks: list[int]) -> dict:
    """Member 0 of unit 2 starts its build; a failure naming ``ranks`` is announced to it
    while it waits for member 1, which starts after."""
    store, out = dist.HashStore(), {}
    signals = [AbortSignal(), AbortSignal()]
    first = threading.Thread(target=_build, args=(store, 0, signals[0], out))
    first.start()
    time.sleep(0.3)
    signals[0].set(f"ranks {ranks} failed (process-exit)", ranks)
    time.sleep(0.3)
    second = threading.Thread(target=_build, args=(store, 1, signals[1], out), daemon=True)
    second.start()
    first.join(30)
    second.join(2)
    return out


def test_another_units_failure_during_the_first_build_leaves_it_to_finish() -> None:
    out = _first_member_waiting([0])
    assert all(isinstance(out.get(m), TpLink) for m in (0, 1)), out
    assert out[0].group.size == 2


def test_a_failure_of_its_own_unit_abandons_the_first_build() -> None:
    out = _first_member_waiting([2])
    assert isinstance(out.get(0), StepAborted) and "ranks [2] failed" in str(out[0])
