"""ZeroAdamW's step on a real ring: the reduce-scatter started from the last backward's
gradient hooks gives the same shards and parameters as the one started after it, both
match a single-process AdamW on the summed gradients, and a roll-back restores the
committed parameters; clipped by global norm under a cosine schedule, it matches torch's
``clip_grad_norm_`` and AdamW at the same learning rates."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from elaswave.comm.backend import GlooBackend
from elaswave.comm.dynamic import DynamicCommunicator
from elaswave.comm.spec import GroupSpec
from elaswave.fabric.adamw import OptimizerConfig, ShardState
from elaswave.fabric.clip import GradClip
from elaswave.fabric.zero import ZeroAdamW
from tests.multiproc.test_dynamic_comm import TIMEOUT, Job, _barrier

WORLD = 3
STEPS = 4
MICRO_BATCHES = 2
CFG = OptimizerConfig(lr=1e-2, warmup_steps=2)


class Scale(nn.Module):
    """A layer with a 1-D parameter (not decayed) and one that no gradient reaches."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, width))
        self.unused = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


def _layers() -> list[nn.Module]:
    torch.manual_seed(0)  # numels 7*5+5, 5+4, 5*3: none a multiple of the ring size
    return [nn.Linear(7, 5), Scale(5), nn.Linear(5, 3, bias=False)]


def _batch(step: int, mb: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 7, generator=torch.Generator().manual_seed(1000 * step + 10 * mb + rank))


def _loss(layers: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return (x**2).sum()


def _params(layers: list[nn.Module]) -> list[torch.Tensor]:
    return [p.detach().clone() for layer in layers for p in layer.parameters()]


def _arrays(tensors: list[torch.Tensor]) -> list[Any]:
    """numpy copies, which a worker can return through a queue (tensors would be
    shared by file descriptor, gone once the worker has left)."""
    return [t.numpy().copy() for t in tensors]


def _train(rank: int, store: dist.Store, cfg: OptimizerConfig = CFG) -> dict[str, Any]:
    _barrier(store, "up", WORLD)
    dyn = DynamicCommunicator(store, rank, GlooBackend(), timeout=TIMEOUT)
    dyn.build([GroupSpec("dp.s0", tuple(range(WORLD)))])
    ring = dyn.comm.collective("dp.s0")
    runs: dict[str, list[list[torch.Tensor]]] = {}
    held: list[ShardState] = []
    for overlap in (True, False):
        layers = _layers()
        opt = ZeroAdamW(layers, layer_ids=[0, 1, 2], dp_group=ring, replica=rank, cfg=cfg)
        if cfg.max_grad_norm is not None:  # one stage: its DP ring is the world
            opt.clip = GradClip(max_norm=cfg.max_grad_norm, world=ring, world_size=WORLD)
        after = []
        for step in range(STEPS):
            opt.zero_grad()
            for mb in range(MICRO_BATCHES):
                if overlap and mb == MICRO_BATCHES - 1:
                    opt.overlap_reduction()
                _loss(layers, _batch(step, mb, rank)).backward()
            opt.step(step)
            opt.commit(step)
            if not overlap:
                held.append(opt.state)  # kept: no shard is recycled in this run
            after.append(_params(layers))
        # A step abandoned after its update: the roll-back keeps the committed shard.
        opt.zero_grad()
        for mb in range(MICRO_BATCHES):
            _loss(layers, _batch(STEPS, mb, rank)).backward()
        opt.step(STEPS)
        opt.rollback(STEPS - 1)
        opt.all_gather_params()
        assert all(torch.equal(a, b) for a, b in zip(_params(layers), after[-1], strict=True))
        runs["overlap" if overlap else "after"] = [_arrays(ps) for ps in after]
        runs["norms" if overlap else "norms_after"] = [opt.grad_norms.get(s) for s in range(STEPS)]
    return runs


def _reference(cfg: OptimizerConfig = CFG) -> tuple[list[list[torch.Tensor]], list[float]]:
    """torch AdamW on the gradients summed over every rank's micro-batches (clipped by
    ``clip_grad_norm_`` where ``cfg`` clips); and each step's norm before clipping."""
    layers = _layers()
    decay = [p for layer in layers for p in layer.parameters() if p.dim() >= 2]
    no_decay = [p for layer in layers for p in layer.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": CFG.weight_decay}, {"params": no_decay}],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        weight_decay=0.0,
    )
    after, norms = [], []
    params = [p for layer in layers for p in layer.parameters()]
    for step in range(STEPS):
        for group in opt.param_groups:
            group["lr"] = cfg.lr_at(step)
        opt.zero_grad(set_to_none=False)
        for rank in range(WORLD):
            for mb in range(MICRO_BATCHES):
                _loss(layers, _batch(step, mb, rank)).backward()
        if cfg.max_grad_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)))
        opt.step()
        after.append(_params(layers))
    return after, norms


@pytest.mark.timeout(60)
def test_overlapped_reduction_matches_the_reduction_after_backward() -> None:
    job = Job(_train, WORLD)
    try:
        results = job.results(WORLD, timeout_s=45)
    finally:
        job.close()
    reference, _ = _reference()
    for rank, runs in results.items():
        for step, (mine, other, ref) in enumerate(
            zip(runs["overlap"], runs["after"], reference, strict=True)
        ):
            for a, b, c in zip(mine, other, ref, strict=True):
                assert (a == b).all(), (rank, step)
                torch.testing.assert_close(torch.from_numpy(a), c, rtol=1e-5, atol=1e-6)
        if rank:  # every replica holds the same parameters
            assert all(
                (a == b).all()
                for a, b in zip(runs["overlap"][-1], results[0]["overlap"][-1], strict=True)
            )


CLIPPED = OptimizerConfig(
    lr=1e-2, warmup_steps=1, lr_schedule="cosine", decay_steps=3, min_lr=1e-3, max_grad_norm=2.0
)


@pytest.mark.timeout(60)
def test_a_clipped_step_under_a_cosine_schedule_matches_torch() -> None:
    job = Job(_train, WORLD, CLIPPED)
    try:
        results = job.results(WORLD, timeout_s=45)
    finally:
        job.close()
    reference, norms = _reference(CLIPPED)
    assert all(n > CLIPPED.max_grad_norm for n in norms)  # every step clips
    assert [CLIPPED.lr_at(s) for s in (0, 3, 4)] == [1e-2, 1e-3, 1e-3]
    for rank, runs in results.items():
        torch.testing.assert_close(runs["norms"], norms, rtol=1e-6, atol=0)
        assert runs["norms"] == runs["norms_after"]
        for step, (mine, ref) in enumerate(zip(runs["overlap"], reference, strict=True)):
            for a, c in zip(mine, ref, strict=True):
                (
                    torch.testing.assert_close(torch.from_numpy(a), c, rtol=1e-5, atol=1e-6),
                    (rank, step),
                )
