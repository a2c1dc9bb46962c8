"""A snapshot sender ends each holder's stream when it is closed (an END frame on the
tag of the step the holder waits for next), the holders of further copies included,
and a holder whose link failed does not stop the others from getting theirs."""

from __future__ import annotations

import queue
from typing import cast

import torch
import torch.distributed as dist

from elaswave.comm.group import P2PGroup
from elaswave.comm.spec import CommError, TagSpace, p2p_tag
from elaswave.fabric.snapshot import END, GRADIENT, SnapshotSender


class _Holder:
    """One holder's link, seen from the owner: what is sent is kept with its tag; a
    failed link raises on every wait."""

    def __init__(self, name: str, *, fails: bool = False) -> None:
        self.name = name
        self.fails = fails
        self.sent: queue.Queue[tuple[int, torch.Tensor]] = queue.Queue()

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> dist.Work:
        self.sent.put((tag, tensor.clone()))
        return cast("dist.Work", object())

    def wait_detached(self, work: dist.Work, op: str) -> None:
        if self.fails:
            raise CommError(self.name, op, "connection closed by peer")

    def frames(self, count: int) -> list[tuple[int, float]]:
        """The next ``count`` frames' tags and trailers."""
        out = []
        for _ in range(count):
            tag, frame = self.sent.get(timeout=10)
            out.append((tag, frame[-1].item()))
        return out


def _tag(step: int) -> int:
    return p2p_tag(5, step, TagSpace.SNAPSHOT)


def test_each_live_holder_gets_every_step_then_its_end_frame() -> None:
    first, second = _Holder("snap.0-1"), _Holder("snap.0-2")
    sender = SnapshotSender(
        cast("P2PGroup", first), 1, generation=5, initial_step=2,
        more=[(cast("P2PGroup", second), 2)], shard=(4, torch.float32),
    )  # fmt: skip
    for step in (3, 4):
        sender.send(torch.full((4,), float(step)), step)
    sender.close()
    for holder in (first, second):
        assert holder.frames(3) == [(_tag(3), GRADIENT), (_tag(4), GRADIENT), (_tag(5), END)]


def test_a_sender_closed_before_any_step_ends_the_stream_at_the_first() -> None:
    holder = _Holder("snap.0-1")
    sender = SnapshotSender(
        cast("P2PGroup", holder), 1, generation=5, initial_step=7, shard=(3, torch.float32)
    )
    sender.close()
    ((tag, frame),) = [holder.sent.get(timeout=10)]
    assert tag == _tag(8) and frame.shape == (4,) and frame[-1] == END


def test_a_failed_holder_does_not_keep_the_others_from_their_frames() -> None:
    dead, live = _Holder("snap.0-1", fails=True), _Holder("snap.0-2")
    sender = SnapshotSender(
        cast("P2PGroup", dead), 1, generation=5, initial_step=-1,
        more=[(cast("P2PGroup", live), 2)], shard=(4, torch.float32),
    )  # fmt: skip
    for step in (0, 1):
        sender.send(torch.ones(4), step)
    sender.wait_delivered(5.0)  # a failed holder ends the wait
    assert sender.error is not None
    sender.close()
    assert live.frames(3) == [(_tag(0), GRADIENT), (_tag(1), GRADIENT), (_tag(2), END)]
    assert [tag for tag, _ in dead.frames(2)] == [_tag(0), _tag(1)]  # posted, then nothing
    assert dead.sent.empty()
