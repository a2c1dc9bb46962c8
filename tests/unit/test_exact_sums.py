"""Gradients summed in float64 (``[optim] grad_reduce_dtype = "float64"``): the step's
gradient does not depend on the order micro-batches are added in, nor on how a share is
grouped into the blocks computed at once; and AdamW's update of an element does not
depend on how the layout shards its layer (the runs: tests/fault/test_exact_sums.py)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from torch import nn

from elaswave.engine.dataflow import regroupings, resize_after_failure, split_shares
from elaswave.engine.plan import initial_plan, plan_from_dict, plan_to_dict
from elaswave.fabric.adamw import GradReduceDtype, OptimizerConfig, ShardState, adamw_update
from elaswave.fabric.zero import ZeroAdamW
from elaswave.runtime.worker.pipeline import share_blocks


class _Alone:
    size = 1

    def all_reduce(self, tensor: torch.Tensor) -> None:
        return None


def _summed(dtype: str, order: list[int], grads: list[torch.Tensor]) -> torch.Tensor:
    layer = nn.Linear(2, 2, bias=False)
    cfg = OptimizerConfig(grad_reduce_dtype=GradReduceDtype(dtype))
    opt = ZeroAdamW([layer], layer_ids=[0], dp_group=_Alone(), replica=0, cfg=cfg)
    opt.zero_grad()
    for i in order:  # one micro-batch's backward each, then its fold
        assert layer.weight.grad is not None
        layer.weight.grad.add_(grads[i].view(2, 2))
        opt.fold()
    return opt.reduce_scatter_grads()


def test_float64_sums_of_micro_batches_do_not_depend_on_their_order() -> None:
    # magnitudes within 2**29 of each other: float64 holds their sums exactly
    grads = [torch.tensor([1.0, 3.0, 1e-8, 7.0]), torch.tensor([1e-8, -3.0, 1.0, 3e-7]),
             torch.tensor([-1.0, 1e-7, -1.0, -7.0])]  # fmt: skip
    orders = [[0, 1, 2], [2, 0, 1], [1, 2, 0]]
    exact = [_summed("float64", order, grads) for order in orders]
    assert all(torch.equal(exact[0], other) for other in exact[1:])
    assert exact[0].dtype == torch.float32
    assert exact[0].tolist() == torch.stack(grads).double().sum(0).float().tolist()
    rounded = [_summed("float32", order, grads) for order in orders]
    assert not all(torch.equal(rounded[0], other) for other in rounded[1:])  # what it fixes


def test_a_share_is_cut_into_the_blocks_every_layout_computes() -> None:
    assert share_blocks((4, 5, 6, 7), 2) == [(0, 2), (2, 4)]
    assert share_blocks((5, 6, 7, 8, 9), 2) == [(0, 1), (1, 3), (3, 5)]
    assert share_blocks((8, 9), 2) == [(0, 2)]
    assert share_blocks((4, 5, 6, 7), None) == [(0, 4)]
    assert share_blocks((), 2) == [(0, 0)]


def _shard(values: torch.Tensor, decay: torch.Tensor) -> ShardState:
    return ShardState(values.clone(), torch.zeros_like(values), torch.zeros_like(values), decay)


def test_an_elements_update_does_not_depend_on_where_its_shard_is_cut() -> None:
    """One layer's elements updated whole, and in three shards cut at odd places (as
    dp3 cuts a layer), over several steps: the same bits. The CPU kernel's scalar rest
    of a run rounds apart from its vector code; every element takes the vector code."""
    torch.manual_seed(0)
    n = 1000 + 37
    decay = (torch.arange(n) % 300 < 200).float()  # decayed and plain runs
    cfg = OptimizerConfig(lr=1e-2)
    whole = _shard(torch.randn(n), decay)
    cuts = [0, 347, 346 * 2 + 5, n]
    shards = [_shard(whole.master[a:b], decay[a:b]) for a, b in itertools.pairwise(cuts)]
    for step in range(4):
        grad = torch.randn(n) * torch.logspace(-6, 1, n)
        adamw_update(whole, grad, step=step, cfg=cfg)
        for shard, (a, b) in zip(shards, itertools.pairwise(cuts), strict=True):
            adamw_update(shard, grad[a:b].clone(), step=step, cfg=cfg)
    assert torch.equal(torch.cat([s.master for s in shards]), whole.master)
    assert torch.equal(torch.cat([s.exp_avg_sq for s in shards]), whole.exp_avg_sq)


def test_the_planner_splits_shares_in_whole_blocks_of_the_plans_grain() -> None:
    """Under float64 sums the plan's grain is the job's micro-batch: three survivors of
    an 8-sample micro-batch take 4 + 2 + 2 in rotation (not 3 + 3 + 2, which cuts a block
    between two ranks: chaos seed 19937, case 37), and a regrouping keeps whole blocks."""
    assert split_shares(8, 3, 2) == {"sizes": (4, 2, 2), "rotate": True, "block": 1}
    assert split_shares(8, 3) == {"sizes": (3, 3, 2), "rotate": True, "block": 1}
    assert split_shares(10, 4, 2)["sizes"] == (4, 2, 2, 2)  # rotating, one block apart
    assert split_shares(4, 3, 2)["sizes"] == (2, 2, 0)  # fewer blocks than replicas
    plan = initial_plan(num_layers=4, dp=4, pp=2, global_batch=16, micro_batch=2, grain=2)
    shrunk, _ = resize_after_failure(plan, [6])
    assert shrunk.grain == 2 and shrunk.stages[1].sizes == (4, 2, 2)
    assert plan_from_dict(plan_to_dict(shrunk)) == shrunk
    assert "grain" not in plan_to_dict(dataclasses.replace(shrunk, grain=1))  # as before
    assert all(g % 2 == 0 for g in regroupings(shrunk))
    with pytest.raises(ValueError, match="grain = 3: must divide the micro batch 2"):
        initial_plan(num_layers=4, dp=4, pp=2, global_batch=16, micro_batch=2, grain=3)
    with pytest.raises(ValueError, match="grain = 0: must be a whole number of samples"):
        plan_from_dict({**plan_to_dict(plan), "grain": 0})
