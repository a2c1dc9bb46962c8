"""What a worker keeps while it applies a plan change: the committed shard it rolls back
to if a participant fails in the apply window (runtime/worker/memento.py)."""

from __future__ import annotations

from typing import cast

import pytest
import torch
from torch import nn

from elaswave.comm.group import CollectiveGroup
from elaswave.fabric.adamw import OptimizerConfig, ShardState, recyclable
from elaswave.fabric.zero import ZeroAdamW
from elaswave.runtime.job.config import JobConfig
from elaswave.runtime.worker.memento import Memento, Settled
from tests.unit.test_device_plane import RecordingGroup

pytestmark = pytest.mark.timeout(30)


class OneMember(RecordingGroup):
    """A data-parallel group of one: the reduce-scatter is a copy."""

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None:
        output.copy_(input)


def _optimizer() -> tuple[ZeroAdamW, nn.Sequential]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 3))
    opt = ZeroAdamW(
        list(model), layer_ids=[0, 1], dp_group=cast("CollectiveGroup", OneMember(size=1)),
        replica=0, cfg=OptimizerConfig(),
    )  # fmt: skip
    return opt, model


def _train(opt: ZeroAdamW, model: nn.Sequential, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        model(torch.ones(2, 6)).square().sum().backward()
        opt.reduce_scatter_grads()
        opt.step(step)
        opt.commit(step)


def _shard() -> ShardState:
    return ShardState(*(torch.zeros(8) for _ in range(4)))


def test_a_shard_a_memento_refers_to_is_never_recycled() -> None:
    """The optimizer overwrites a dropped shard as the next update's buffers only when
    nothing else refers to it (``recyclable``): a rank keeps the shard of a change's
    committed step by reference, no copy, and that keeps it whole."""
    like = _shard()
    spare = _shard()  # as the optimizer holds a dropped shard: one variable
    assert recyclable(spare, like)
    memento = Memento(plan=JobConfig().plan(), step=3, layers=nn.ModuleList(), layout=None,
                      state=spare)  # fmt: skip
    assert not recyclable(spare, like)
    memento.state = None  # dropped once the change is settled
    assert recyclable(spare, like)


def test_training_on_leaves_the_kept_shard_as_committed() -> None:
    """Six steps after a change, the shard its memento kept holds the committed step's
    values (updates run out of place, into other buffers)."""
    opt, model = _optimizer()
    before = opt.state.master.clone()
    memento = Memento(plan=JobConfig().plan(), step=-1, layers=nn.ModuleList(model),
                      layout=opt.layout, state=opt.state)  # fmt: skip
    _train(opt, model, range(6))
    assert not torch.equal(opt.state.master, before), "training changed nothing"
    assert memento.state is not None and torch.equal(memento.state.master, before)


def test_settled_covers_every_generation_up_to_the_newest_announced() -> None:
    settled = Settled()
    assert not settled.covers(0)
    settled.note(3)
    settled.note(2)  # announcements may arrive out of order
    assert settled.covers(3) and settled.covers(1) and not settled.covers(4)
