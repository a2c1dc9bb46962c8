"""Which device groups a failure releases, and how: the pure choice, and parallel aborts
under a deadline (with stand-in communicators)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any, cast

import torch.distributed as dist

from elaswave.comm.group import Group
from elaswave.comm.release import abort_all, must_release, release
from elaswave.comm.spec import GroupSpec


class _Comm:
    """A communicator stand-in whose abort takes ``abort_s``."""

    def __init__(self, abort_s: float = 0.0) -> None:
        self.abort_s = abort_s
        self.aborted = threading.Event()

    def abort(self) -> None:
        time.sleep(self.abort_s)
        self.aborted.set()


class _Pending:
    def is_completed(self) -> bool:
        return False


def _group(name: str, ranks: tuple[int, ...], *, parks: bool, abort_s: float = 0.0) -> Group:
    pg = cast(dist.ProcessGroup, _Comm(abort_s))
    return Group(GroupSpec(name, ranks), pg, ranks[0], timedelta(seconds=1), parks=parks)


def test_only_groups_that_park_are_released_those_with_a_failed_rank_or_work_in_flight() -> None:
    busy = _group("fwd.s0", (0, 1), parks=True)
    busy.posted.hold(cast(dist.Work, _Pending()))
    assert must_release(_group("dp.s0", (0, 2), parks=True), failed=[2])
    assert not must_release(_group("dp.s1", (0, 1), parks=True), failed=[2])  # idle
    assert must_release(busy, failed=[2])
    assert not must_release(_group("dp.s0", (0, 2), parks=False), failed=[2])  # gloo
    gloo_busy = _group("fwd.s1", (0, 1), parks=False)
    gloo_busy.posted.hold(cast(dist.Work, _Pending()))
    assert not gloo_busy.tainted and not must_release(gloo_busy, failed=[])


def test_aborts_run_at_once_and_a_slow_one_is_reported_late() -> None:
    groups = [_group(f"g{i}", (0, 1), parks=True, abort_s=0.3) for i in range(4)]
    stuck = _group("stuck", (0, 1), parks=True, abort_s=5.0)
    started = time.perf_counter()
    released = abort_all([*groups, stuck], deadline_s=1.0)
    took = time.perf_counter() - started
    assert 0.3 <= took < 1.5  # in parallel (4 x 0.3 s one after another would be 1.2 s + 5)
    assert released.aborted == ("g0", "g1", "g2", "g3", "stuck")
    assert released.late == ("stuck",)
    assert all(g.aborted and g.tainted for g in groups)
    assert all(cast(Any, g.pg).aborted.is_set() for g in groups)


def test_a_released_group_is_not_aborted_twice() -> None:
    group = _group("dp.s0", (0, 2), parks=True)
    assert release([group], failed=[2]).aborted == ("dp.s0",)
    assert release([group], failed=[2]).aborted == ()
