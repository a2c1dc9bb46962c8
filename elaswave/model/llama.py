"""A Llama-style decoder as an ordered list of pipeline-placeable layers.

Layer 0 is the embedding, layers 1..N the transformer blocks, layer N+1 the final norm and
LM head. Any contiguous slice of the list can run as a pipeline stage. Each layer is
initialised from its own seed (seed, layer index), so parameters do not depend on which
stage builds them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from elaswave.model.config import ModelConfig
from elaswave.model.rng import DropoutRng, stream_key
from elaswave.model.tensor_parallel import (
    NO_TP,
    TpShard,
    copy_to,
    gather_last,
    reduce_from,
    shard_param,
)


@dataclass(frozen=True)
class StepContext:
    """What a layer needs to know about the micro-batch it is running."""

    step: int
    sample_ids: tuple[int, ...]
    rng: DropoutRng
    training: bool = True


def _dropout(x: torch.Tensor, ctx: StepContext, *, p: float, layer: int, site: int) -> torch.Tensor:
    if not ctx.training or p == 0.0:
        return x
    keep = ctx.rng.keep_mask(
        step=ctx.step,
        sample_ids=ctx.sample_ids,
        layer=layer,
        site=site,
        sample_shape=tuple(x.shape[1:]),
        p=p,
        device=x.device,
    )
    return x * keep.to(x.dtype) / (1.0 - p)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotary_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(half, dtype=torch.float64) / half))
    angles = torch.outer(torch.arange(cfg.seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [batch, heads, seq, head_dim]; rotate-half form.
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    seq = x.shape[-2]
    c, s = cos[:seq], sin[:seq]
    return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)


class PipelineLayer(nn.Module):
    """Base of every placeable layer: knows its global index."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index


def layer_index(layer: nn.Module) -> int:
    """The global index of ``layer``, which must be a :class:`PipelineLayer` (containers
    such as ``nn.ModuleList`` hand their items out as plain modules)."""
    if not isinstance(layer, PipelineLayer):
        raise TypeError(f"{type(layer).__name__} is not a pipeline layer")
    return layer.index


class EmbeddingLayer(PipelineLayer):
    def __init__(self, cfg: ModelConfig, index: int, tp: TpShard = NO_TP) -> None:
        super().__init__(index)
        self.p = cfg.dropout
        self.tp = tp
        rows = cfg.vocab_size // tp.size  # vocabulary-parallel: this member's ids
        self.lo = tp.rank * rows
        self.embed = nn.Embedding(rows, cfg.hidden_size)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        if not self.tp.active:
            return _dropout(self.embed(x), ctx, p=self.p, layer=self.index, site=0)
        local = x - self.lo
        outside = (local < 0) | (local >= self.embed.num_embeddings)
        rows = self.embed(local.masked_fill(outside, 0)).masked_fill(outside.unsqueeze(-1), 0.0)
        return _dropout(reduce_from(rows, self.tp), ctx, p=self.p, layer=self.index, site=0)


class TransformerBlock(PipelineLayer):
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, cfg: ModelConfig, index: int, tp: TpShard = NO_TP) -> None:
        super().__init__(index)
        self.cfg = cfg
        self.tp = tp
        # Column-parallel query/key/value and gate/up, row-parallel output and down: this
        # member runs heads [rank * H / tp, ...) and its slice of the MLP's inner width.
        self.heads, self.kv_heads = cfg.num_heads // tp.size, cfg.num_kv_heads // tp.size
        h, q, kv = cfg.hidden_size, self.heads * cfg.head_dim, self.kv_heads * cfg.head_dim
        ffn = cfg.ffn_hidden_size // tp.size
        self.attn_norm = RMSNorm(h, cfg.norm_eps)
        self.wq = nn.Linear(h, q, bias=False)
        self.wk = nn.Linear(h, kv, bias=False)
        self.wv = nn.Linear(h, kv, bias=False)
        self.wo = nn.Linear(q, h, bias=False)
        self.mlp_norm = RMSNorm(h, cfg.norm_eps)
        self.w_gate = nn.Linear(h, ffn, bias=False)
        self.w_up = nn.Linear(h, ffn, bias=False)
        self.w_down = nn.Linear(ffn, h, bias=False)
        cos, sin = _rotary_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, cfg.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.kv_heads, cfg.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.kv_heads, cfg.head_dim).transpose(1, 2)
        q = _apply_rotary(q, self.rope_cos, self.rope_sin)
        k = _apply_rotary(k, self.rope_cos, self.rope_sin)
        if self.kv_heads != self.heads:
            rep = self.heads // self.kv_heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, self.heads * cfg.head_dim))

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        p, tp = self.cfg.dropout, self.tp
        attn = reduce_from(self._attention(copy_to(self.attn_norm(x), tp)), tp)
        x = x + _dropout(attn, ctx, p=p, layer=self.index, site=0)
        y = copy_to(self.mlp_norm(x), tp)
        mlp = reduce_from(self.w_down(F.silu(self.w_gate(y)) * self.w_up(y)), tp)
        return x + _dropout(mlp, ctx, p=p, layer=self.index, site=1)


class HeadLayer(PipelineLayer):
    def __init__(self, cfg: ModelConfig, index: int, tp: TpShard = NO_TP) -> None:
        super().__init__(index)
        self.tp = tp
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size // tp.size, bias=False)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        # Vocabulary-parallel logits, gathered whole: the loss is the same on every member.
        return gather_last(self.lm_head(copy_to(self.norm(x), self.tp)), self.tp)


def _new_layer(cfg: ModelConfig, index: int, tp: TpShard = NO_TP) -> PipelineLayer:
    if not 0 <= index < cfg.num_layers:
        raise ValueError(f"layer index {index} out of range [0, {cfg.num_layers})")
    if index == 0:
        return EmbeddingLayer(cfg, index, tp)
    if index == cfg.num_layers - 1:
        return HeadLayer(cfg, index, tp)
    return TransformerBlock(cfg, index, tp)


@functools.cache
def layer_decay_flags(cfg: ModelConfig, index: int, tp: int = 1) -> tuple[tuple[int, bool], ...]:
    """(elements, takes weight decay) of global layer ``index``'s parameters in
    registration order, on one of ``tp`` tensor-parallel members: matrices decay,
    vectors do not. Cached per process: a snapshot holder asks it for the layers of
    another stage at every change."""
    layer = _new_layer(cfg, index, TpShard(0, tp))  # small; no seeded init needed
    return tuple((p.numel(), p.dim() >= 2) for p in layer.parameters())


def build_layer(cfg: ModelConfig, index: int, *, seed: int, tp: TpShard = NO_TP) -> PipelineLayer:
    """Build global layer ``index`` with parameters drawn from its own (seed, index)
    stream; a TP member keeps its piece of the whole layer's parameters, so they do not
    depend on the TP degree either."""
    whole = _whole_layer(cfg, index, seed=seed)
    if not tp.active:
        return whole
    layer = _new_layer(cfg, index, tp)
    with torch.no_grad():
        pieces = dict(whole.named_parameters())
        for name, param in layer.named_parameters():
            param.copy_(shard_param(name, pieces[name], tp))
    return layer


def _whole_layer(cfg: ModelConfig, index: int, *, seed: int) -> PipelineLayer:
    layer = _new_layer(cfg, index)
    gen = torch.Generator().manual_seed(stream_key(seed, 0x1A7E5, index) & ((1 << 63) - 1))
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if param.dim() >= 2:
                std = cfg.init_std
                if name.endswith(("wo.weight", "w_down.weight")):
                    std = cfg.init_std / math.sqrt(2 * cfg.num_blocks)
                param.normal_(0.0, std, generator=gen)
    return layer


def per_sample_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of each sample: shape [batch]."""
    ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    return ce.view(targets.shape).mean(dim=1)
