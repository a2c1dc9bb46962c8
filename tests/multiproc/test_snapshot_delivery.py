"""An owner waits for its snapshots' delivery before a step's all-gather, so a step is
never committed while its snapshot is missing at the holder (chaos seed 6502, case 97:
a holder whose receiving thread fell three steps behind lacked the step every survivor
rolled back to). Two ranks as two threads over real gloo."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elaswave.comm.abort import AbortSignal, StepAborted
from elaswave.comm.group import Group
from elaswave.comm.spec import CommError, GroupSpec, TagSpace, p2p_tag
from elaswave.fabric.adamw import OptimizerConfig, ShardState, adamw_update
from elaswave.fabric.snapshot import SnapshotKeeper, SnapshotSender

SPEC = GroupSpec("snap.0-1", (0, 1))


def _pair() -> list[Group]:
    store = dist.HashStore()
    pgs: list[Any] = [None, None]

    def make(rank: int) -> None:
        pgs[rank] = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=10))

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [Group(SPEC, pgs[r], r, timedelta(seconds=10)) for r in (0, 1)]


def test_the_owner_waits_until_the_holder_has_every_step_sent() -> None:
    owner, holder = _pair()
    abort = AbortSignal()
    sender = SnapshotSender(owner, 1, abort=abort)
    for step in range(3):
        sender.send(torch.full((4,), float(step)), step)
    with pytest.raises(CommError, match="not delivered"):
        sender.wait_delivered(0.3)  # the holder has received nothing yet
    got = []
    for step in range(3):
        buf = torch.empty(5)  # the shard and the frame's trailer
        holder.recv(buf, 0, p2p_tag(0, step, TagSpace.SNAPSHOT))
        got.append(buf[0].item())
    sender.wait_delivered(5.0)
    assert got == [0.0, 1.0, 2.0]
    sender.send(torch.zeros(4), 3)  # never received: a failure announced ends the wait
    abort.set("ranks [1] failed")
    with pytest.raises(StepAborted):
        sender.wait_delivered(5.0)
    sender.close()


def _state(numel: int) -> ShardState:
    master, avg, avg_sq = (torch.full((numel,), 1.0 + k) for k in range(3))
    return ShardState(master, avg, avg_sq, torch.ones(numel))


def test_a_live_owner_that_closes_its_sender_ends_the_keepers_thread() -> None:
    """A change closes every snapshot stream. The holder's receive for the next step is
    already posted; an owner that lives on (it abandoned that step) ends it with an
    END frame, so the keeper's thread ends and the group holds nothing pending. Before,
    the thread stayed parked for good on every change, holding its buffer and the
    group (scripts/gpu_check's churn on an H200: a survivor 12 such threads ahead)."""
    owner, holder = _pair()
    cfg = OptimizerConfig()
    keeper = SnapshotKeeper(owner=0, link=holder, cfg=cfg, initial=_state(4), generation=3)
    keeper.start()
    sender = SnapshotSender(owner, 1, generation=3, shard=(4, torch.float32))
    grads = [torch.full((4,), 0.1 * (step + 1)) for step in range(3)]
    for step, grad in enumerate(grads):
        sender.send(grad, step)
    sender.wait_delivered(5.0)
    sender.close()  # the owner abandons step 3
    deadline = time.monotonic() + 10
    while keeper.receiving and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not keeper.receiving, "the keeper's thread is parked on a live owner"
    assert holder.posted.pending() == 0 and keeper.error is None
    with pytest.raises(CommError, match="ended its snapshots at step 3"):
        keeper.wait(3, timeout_s=5.0)
    expected = _state(4)
    for step, grad in enumerate(grads):
        adamw_update(expected, grad, step=step, cfg=cfg)
    got = keeper.take(2, timeout_s=5.0)
    assert torch.equal(got.master, expected.master)
    assert torch.equal(got.exp_avg_sq, expected.exp_avg_sq)
