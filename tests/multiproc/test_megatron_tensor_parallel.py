"""megatron-core's own tensor-parallel layers over two gloo processes (ElasWave's TP
group carrying their collectives) against the whole layers in one process: the same
loss and logits, and every parameter's gradient once the members' pieces are joined."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from elaswave.model.megatron import MegatronModel, megatron_shape
from elaswave.model.tensor_parallel import TpShard, fused_parts, merge_param, shard_param
from tests.multiproc.test_tensor_parallel import members_of, model_step, tp_member

SHAPE = {"num_layers": 4, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2,
         "ffn_hidden_size": 80, "vocab_size": 96}  # fmt: skip
SEQ = 16


def _source(tmp_path: Path) -> str:
    path = tmp_path / "gpt.json"
    path.write_text(json.dumps(SHAPE))
    return f"megatron:{path}"


def _step(source: str, tp: TpShard) -> tuple[float, torch.Tensor, dict[str, torch.Tensor]]:
    return model_step(MegatronModel(megatron_shape(source, seq_len=SEQ)), tp)


def _member(rank: int, store: dist.Store, size: int, source: str) -> tuple:
    return tp_member(rank, store, size, _step, source)


def test_megatron_tp_layers_give_the_whole_layers_loss_and_gradients(tmp_path: Path):
    source = _source(tmp_path)
    members = members_of(_member, 2, source, timeout_s=180)
    loss, logits, grads = _step(source, TpShard())
    shape = megatron_shape(source, seq_len=SEQ)
    for rank in range(2):
        got_loss, got_logits, _ = members[rank]
        assert got_loss == pytest.approx(loss, rel=1e-6)
        torch.testing.assert_close(torch.from_numpy(got_logits), logits, rtol=1e-5, atol=1e-6)
    assert set(members[0][2]) == set(grads)
    for name, whole in grads.items():
        pieces = [torch.from_numpy(members[r][2][name]) for r in range(2)]
        merged = merge_param(name, pieces, fused_parts(name, shape))
        torch.testing.assert_close(merged, whole, rtol=1e-5, atol=1e-7, msg=name)


def test_megatron_pieces_join_into_the_whole_layer(tmp_path: Path):
    """Each member's megatron layer holds its piece of the whole layer's parameters (no
    collective runs: the members' layers are built for their parameters only)."""
    model = MegatronModel(megatron_shape(_source(tmp_path), seq_len=SEQ))
    for index in range(model.config.num_layers):
        whole = dict(model.build_layer(index, seed=1).named_parameters())
        pieces = [dict(model.build_layer(index, seed=1, tp=TpShard(r, 2)).named_parameters())
                  for r in range(2)]  # fmt: skip
        assert set(pieces[0]) == set(whole)
        for name, param in whole.items():
            parts = fused_parts(name, model.config)
            assert torch.equal(merge_param(name, [p[name] for p in pieces], parts), param), name
            assert torch.equal(shard_param(name, param, TpShard(1, 2), parts), pieces[1][name])
        flags = model.decay_flags(index, 2)
        assert [n for n, _ in flags] == [p.numel() for p in pieces[0].values()]
