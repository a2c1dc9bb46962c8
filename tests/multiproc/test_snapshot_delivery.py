"""An owner waits for its snapshots' delivery before a step's all-gather, so a step is
never committed while its snapshot is missing at the holder (chaos seed 6502, case 97:
a holder whose receiving thread fell three steps behind lacked the step every survivor
rolled back to). Two ranks as two threads over real gloo."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elaswave.comm.abort import AbortSignal, StepAborted
from elaswave.comm.group import Group
from elaswave.comm.spec import CommError, GroupSpec, TagSpace, p2p_tag
from elaswave.fabric.snapshot import SnapshotSender

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
        buf = torch.empty(4)
        holder.recv(buf, 0, p2p_tag(0, step, TagSpace.SNAPSHOT))
        got.append(buf[0].item())
    sender.wait_delivered(5.0)
    assert got == [0.0, 1.0, 2.0]
    sender.send(torch.zeros(4), 3)  # never received: a failure announced ends the wait
    abort.set("ranks [1] failed")
    with pytest.raises(StepAborted):
        sender.wait_delivered(5.0)
    sender.close()
