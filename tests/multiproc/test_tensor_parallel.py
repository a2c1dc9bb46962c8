"""Tensor-parallel layers on real gloo processes against the whole layers in one process:
the same loss, logits and gradients (the members' pieces joined again)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elaswave.comm.backend import GlooBackend
from elaswave.comm.communicator import Communicator
from elaswave.comm.spec import GroupSpec
from elaswave.model.config import ModelConfig
from elaswave.model.llama import StepContext, build_layer, layer_decay_flags, per_sample_loss
from elaswave.model.rng import make_rng
from elaswave.model.tensor_parallel import TpShard, merge_param, shard_param
from tests.multiproc.test_dynamic_comm import Job

CFG = ModelConfig(num_blocks=2, dropout=0.1)
GQA = ModelConfig(num_blocks=1, num_heads=4, num_kv_heads=2, dropout=0.1)
SAMPLES = (3, 8)


def layers_step(
    layers: Sequence[Any],
    loss_fn: Callable,
    *,
    vocab: int,
    seq: int,
    samples: tuple[int, ...],
    step: int = 0,
) -> tuple[float, torch.Tensor, dict[str, torch.Tensor]]:
    """Loss, logits and every parameter's gradient of one micro-batch of ``samples``
    through ``layers`` (a whole model's, or a TP member's)."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(vocab, (len(samples), seq + 1), generator=gen)
    ctx = StepContext(step=step, sample_ids=samples, rng=make_rng("counter", seed=5, rank=0))
    x = tokens[:, :-1]
    for layer in layers:
        x = layer(x, ctx)
    loss = loss_fn(x, tokens[:, 1:]).sum()
    loss.backward()
    grads = {
        f"{layer.index}.{name}": p.grad.clone()
        for layer in layers
        for name, p in layer.named_parameters()
        if p.grad is not None
    }
    return float(loss.detach()), x.detach(), grads


def model_step(model: Any, tp: TpShard) -> tuple[float, torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`layers_step` through every layer of a user's ``model`` (Hugging Face,
    megatron-core) as member ``tp`` builds them, over samples 0, 1, 2."""
    c = model.config
    layers = [model.build_layer(i, seed=5, tp=tp) for i in range(c.num_layers)]
    return layers_step(
        layers, model.per_sample_loss, vocab=c.vocab_size, seq=c.seq_len, samples=(0, 1, 2)
    )


def _step(cfg: ModelConfig, tp: TpShard) -> tuple[float, torch.Tensor, dict[str, torch.Tensor]]:
    layers = [build_layer(cfg, i, seed=5, tp=tp) for i in range(cfg.num_layers)]
    return layers_step(
        layers, per_sample_loss, vocab=cfg.vocab_size, seq=cfg.seq_len, samples=SAMPLES, step=2
    )


def _member(rank: int, store: dist.Store, size: int, cfg: ModelConfig) -> tuple:
    return tp_member(rank, store, size, _step, cfg)


def members_of(member: Callable, size: int, model: Any, timeout_s: float = 120) -> dict:
    """What ``member(rank, store, size, model)`` returns on each of ``size`` processes."""
    job = Job(member, size, size, model)
    try:
        return job.results(size, timeout_s=timeout_s)
    finally:
        job.close()


def tp_member(rank: int, store: dist.Store, size: int, step: Callable, model: Any) -> tuple:
    """``step(model, shard)`` on TP member ``rank`` of a gloo group of ``size``: its loss,
    logits and gradients, as numpy arrays."""
    comm = Communicator(store, rank, GlooBackend(), timeout=timedelta(seconds=30))
    comm.build([GroupSpec("tp", tuple(range(size)))])
    torch.set_num_threads(1)
    loss, logits, grads = step(model, TpShard(rank, size, comm.collective("tp")))
    # numpy arrays travel by value (a tensor would be shared memory, gone with the process)
    return loss, logits.numpy(), {k: g.numpy() for k, g in grads.items()}


@pytest.mark.parametrize(
    ("size", "cfg"), [(2, CFG), (4, CFG), (2, GQA)], ids=["tp2", "tp4", "gqa-tp2"]
)
def test_tensor_parallel_layers_match_whole_layers(size: int, cfg: ModelConfig) -> None:
    members = members_of(_member, size, cfg)
    loss, logits, grads = _step(cfg, TpShard())
    for rank in range(size):
        got_loss, got_logits, _ = members[rank]
        assert got_loss == pytest.approx(loss, rel=1e-6)
        torch.testing.assert_close(torch.from_numpy(got_logits), logits, rtol=1e-5, atol=1e-6)
    for name, whole in grads.items():
        merged = merge_param(name, [torch.from_numpy(members[r][2][name]) for r in range(size)])
        torch.testing.assert_close(merged, whole, rtol=1e-5, atol=1e-7, msg=name)
    assert set(members[0][2]) == set(grads)  # every parameter has a gradient on every member


def test_pieces_join_into_the_whole_layer_and_count_as_decay_flags_say() -> None:
    for index in range(CFG.num_layers):
        whole = dict(build_layer(CFG, index, seed=1).named_parameters())
        pieces = [dict(build_layer(CFG, index, seed=1, tp=TpShard(r, 4)).named_parameters())
                  for r in range(4)]  # fmt: skip
        for name, param in whole.items():
            assert torch.equal(merge_param(name, [p[name] for p in pieces]), param)
            assert torch.equal(shard_param(name, param, TpShard(1, 4)), pieces[1][name])
        flags = layer_decay_flags(CFG, index, 4)
        assert [n for n, _ in flags] == [p.numel() for p in pieces[0].values()]
