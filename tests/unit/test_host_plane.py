"""Host-plane buffers are marked where they are allocated (fabric.hostplane): snapshots,
the gradients shipped to them, remap's and migration's staging and receive buffers, so
that the ``cpu-strict`` device refuses them on a device-plane communicator; what the
training plane keeps (activations, an optimizer's shard, a remap's result) is not."""

from __future__ import annotations

import queue
import threading
from typing import cast

import pytest
import torch
import torch.distributed as dist

from elaswave.comm.group import P2PGroup, P2PLink
from elaswave.comm.strict import is_host
from elaswave.fabric.adamw import OptimizerConfig, ShardState
from elaswave.fabric.hostplane import (
    CpuHostCopier,
    as_host,
    bind_thread_device,
    host_copier,
    host_empty,
    host_state,
    host_zeros,
)
from elaswave.fabric.layout import InterleavedLayout
from elaswave.fabric.remap import RemapPlan, Source
from elaswave.fabric.remap import Transfer as RemapTransfer
from elaswave.fabric.remap_exec import execute_remap
from elaswave.fabric.snapshot import GRADIENT, SnapshotKeeper, SnapshotSender

pytestmark = pytest.mark.timeout(30)

CPU = torch.device("cpu")


def _state(numel: int) -> ShardState:
    master, avg, avg_sq = (torch.full((numel,), 1.0 + k) for k in range(3))
    return ShardState(master, avg, avg_sq, torch.ones(numel))


def test_host_buffers_are_marked_and_training_tensors_are_not() -> None:
    activation = torch.randn(2, 3, requires_grad=True)
    assert not is_host(activation)
    assert is_host(host_empty(5)) and is_host(host_zeros((3, 4)))
    assert host_zeros((3, 4)).abs().sum() == 0
    fresh = torch.stack([torch.ones(3), torch.zeros(3)])
    assert as_host(fresh) is fresh and is_host(fresh)
    assert is_host(fresh[1]), "a view shares its buffer's mark"
    snapshot = host_state(_state(4))
    assert all(is_host(t) for t in (snapshot.master, snapshot.exp_avg, snapshot.exp_avg_sq))


def test_the_host_copier_gives_a_marked_copy_and_leaves_the_source_on_the_device() -> None:
    assert isinstance(host_copier(CPU), CpuHostCopier)
    grad = torch.arange(6.0)
    copy = host_copier(CPU).copy(grad)
    copy.wait()
    assert copy.ready and is_host(copy.tensor) and not is_host(grad)
    assert copy.tensor.data_ptr() != grad.data_ptr()
    assert torch.equal(copy.tensor, grad)
    framed = host_copier(CPU).copy(grad.view(2, 3), extra=1)  # a flat buffer, one more
    assert framed.tensor.shape == (7,) and is_host(framed.tensor)
    assert torch.equal(framed.tensor[:6], grad)
    bind_thread_device(CPU)  # nothing to bind on the host
    bind_thread_device(None)


class _Link:
    """Both ends of a link in one process: what is sent is kept, receives take it."""

    name = "snap.0-1"

    def __init__(self) -> None:
        self.sent: queue.Queue[torch.Tensor] = queue.Queue()
        self.received: list[torch.Tensor] = []
        self.threads: set[str] = set()

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> dist.Work:
        self.threads.add(threading.current_thread().name)
        self.sent.put(tensor)
        return cast("dist.Work", object())

    def wait_detached(self, work: dist.Work, op: str) -> None:
        return None

    def wait_send(self, work: dist.Work) -> None:
        return None

    def recv_detached(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        self.received.append(tensor)
        tensor.copy_(self.sent.get(timeout=10))

    recv = recv_detached


def test_snapshot_shipping_sends_a_host_copy_and_the_keeper_keeps_host_buffers() -> None:
    link = _Link()
    sender = SnapshotSender(cast("P2PGroup", link), holder=1)
    grad = torch.full((4,), 0.5)
    sender.send(grad, step=0)
    sender.flush(timeout_s=10)
    shipped = link.sent.get(timeout=10)
    assert is_host(shipped) and not is_host(grad) and torch.equal(shipped[:-1], grad)
    assert shipped[-1] == GRADIENT  # the frame's trailer
    assert link.threads == {threading.current_thread().name}, "a host copy is posted at once"
    sender.close()

    link.sent.put(shipped)
    cfg = OptimizerConfig()
    keeper = SnapshotKeeper(owner=0, link=cast("P2PGroup", link), cfg=cfg, initial=_state(4))
    keeper.start()
    version = keeper.wait(0, timeout_s=10)
    assert all(is_host(t) for t in (version.master, version.exp_avg, version.exp_avg_sq))
    assert link.received and is_host(link.received[0])
    base = keeper.take(0, timeout_s=10)
    assert is_host(base.master)


def test_remap_stages_its_traffic_in_host_buffers_and_returns_an_unmarked_shard() -> None:
    layout = InterleavedLayout.build([(0, 8)], 2)
    plan = RemapPlan(
        transfers=(
            RemapTransfer(layer=0, lo=0, hi=4, src=0, dst=0, kind=Source.DEVICE, owner=0),
            RemapTransfer(layer=0, lo=4, hi=8, src=1, dst=0, kind=Source.DEVICE, owner=1),
            RemapTransfer(layer=0, lo=0, hi=4, src=0, dst=1, kind=Source.DEVICE, owner=0),
        )
    )
    link = _Link()
    link.sent.put(torch.full((3, 4), 7.0))  # what rank 1 sends rank 0
    result = execute_remap(
        plan,
        rank=0,
        old_layout=layout,
        new_layout=InterleavedLayout.build([(0, 8)], 1),
        device_state=_state(4),
        host_states={},
        link=lambda a, b: cast("P2PLink", link),
        generation=0,
        step=0,
        device=CPU,
    )
    shipped = link.sent.get(timeout=10)
    assert is_host(shipped) and is_host(link.received[0])
    assert not any(is_host(t) for t in (result.state.master, result.state.exp_avg))
    assert torch.equal(result.state.master, torch.tensor([1.0] * 4 + [7.0] * 4))
