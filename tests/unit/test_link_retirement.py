"""Retired links are let go once nothing can wait on them: a survivor's gloo process
groups (and their threads) do not pile up over changes. Two ranks run as two threads of
this process over real gloo."""

from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from elaswave.comm.backend import GlooBackend
from elaswave.comm.links import LinkPool

WAIT = timedelta(seconds=10)


def _pools() -> list[LinkPool]:
    store = dist.HashStore()
    pools = [LinkPool(store, rank, GlooBackend(), timeout=WAIT) for rank in (0, 1)]
    threads = [
        threading.Thread(target=pool.connect, args=([(0, 1)],), kwargs={"generation": 0})
        for pool in pools
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(len(pool) == 1 for pool in pools)
    return pools


def test_a_retired_link_stays_while_an_operation_on_it_is_pending_then_goes() -> None:
    pools = _pools()
    link = pools[0].get(0, 1)
    got = torch.zeros(1)
    pending = link.recv(got, 1, 7)  # posted, not yet matched: a wait may block on it
    assert pools[0].retire([1]) == [(0, 1)]
    pools[0].retire([])  # a later change: still pending, so still kept
    assert pools[0].retired == [link]
    pools[1].get(0, 1).send(torch.ones(1), 0, 7).wait(WAIT)
    pending.wait(WAIT)
    assert got.item() == 1.0
    pools[0].retire([])  # the next change lets it go
    assert pools[0].retired == []


def test_an_idle_retired_link_goes_at_the_next_retirement() -> None:
    pools = _pools()
    pools[0].retire([1])
    assert len(pools[0].retired) == 1  # kept through the change that retires it
    pools[0].retire([])
    assert pools[0].retired == []


def test_a_dropped_pair_group_is_kept_only_while_its_link_has_a_pending_operation() -> None:
    """The dynamic communicator let go none of the groups its changes dropped, and with
    them their links: a survivor of a churn trace held a gloo group per change."""
    from elaswave.comm.dynamic import may_be_parked
    from elaswave.comm.links import PairGroup
    from elaswave.comm.spec import GroupSpec

    pools = _pools()
    group = PairGroup(GroupSpec("remap.0-1", (0, 1)), 0, pools[0], timeout=WAIT)
    assert not may_be_parked(group)
    got = torch.zeros(1)
    pending = group.irecv(got, 1, 9)
    assert may_be_parked(group)  # a wait may block on it: freeing it could abort us
    pools[1].get(0, 1).send(torch.ones(1), 0, 9).wait(WAIT)
    pending.wait(WAIT)
    assert not may_be_parked(group)
