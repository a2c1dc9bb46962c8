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
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__(index)
        self.p = cfg.dropout
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        return _dropout(self.embed(x), ctx, p=self.p, layer=self.index, site=0)


class TransformerBlock(PipelineLayer):
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__(index)
        self.cfg = cfg
        h, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
        self.attn_norm = RMSNorm(h, cfg.norm_eps)
        self.wq = nn.Linear(h, h, bias=False)
        self.wk = nn.Linear(h, kv, bias=False)
        self.wv = nn.Linear(h, kv, bias=False)
        self.wo = nn.Linear(h, h, bias=False)
        self.mlp_norm = RMSNorm(h, cfg.norm_eps)
        self.w_gate = nn.Linear(h, cfg.ffn_hidden_size, bias=False)
        self.w_up = nn.Linear(h, cfg.ffn_hidden_size, bias=False)
        self.w_down = nn.Linear(cfg.ffn_hidden_size, h, bias=False)
        cos, sin = _rotary_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, cfg.num_heads, cfg.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        q = _apply_rotary(q, self.rope_cos, self.rope_sin)
        k = _apply_rotary(k, self.rope_cos, self.rope_sin)
        if cfg.num_kv_heads != cfg.num_heads:
            rep = cfg.num_heads // cfg.num_kv_heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, cfg.hidden_size))

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        p = self.cfg.dropout
        x = x + _dropout(self._attention(self.attn_norm(x)), ctx, p=p, layer=self.index, site=0)
        y = self.mlp_norm(x)
        mlp = self.w_down(F.silu(self.w_gate(y)) * self.w_up(y))
        return x + _dropout(mlp, ctx, p=p, layer=self.index, site=1)


class HeadLayer(PipelineLayer):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__(index)
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        return self.lm_head(self.norm(x))


def _new_layer(cfg: ModelConfig, index: int) -> PipelineLayer:
    if not 0 <= index < cfg.num_layers:
        raise ValueError(f"layer index {index} out of range [0, {cfg.num_layers})")
    if index == 0:
        return EmbeddingLayer(cfg, index)
    if index == cfg.num_layers - 1:
        return HeadLayer(cfg, index)
    return TransformerBlock(cfg, index)


@functools.cache
def layer_decay_flags(cfg: ModelConfig, index: int) -> tuple[tuple[int, bool], ...]:
    """(elements, takes weight decay) of global layer ``index``'s parameters in
    registration order: matrices decay, vectors do not. Cached per process: a snapshot
    holder asks it for the layers of another stage at every change."""
    layer = _new_layer(cfg, index)  # small for the built-in model; no seeded init needed
    return tuple((p.numel(), p.dim() >= 2) for p in layer.parameters())


def build_layer(cfg: ModelConfig, index: int, *, seed: int) -> PipelineLayer:
    """Build global layer ``index`` with parameters drawn from its own (seed, index) stream."""
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
