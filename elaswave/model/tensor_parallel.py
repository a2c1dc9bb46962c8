"""Megatron-style tensor parallelism for the built-in decoder (and the names by which a
Hugging Face or megatron-core model's split parameters are cut and joined).

A layer split ``size`` ways keeps, on member ``rank`` of its tensor-parallel (TP) group:

* **column-parallel** matrices (query, key, value, MLP gate and up): rows
  ``[rank * n / size, (rank + 1) * n / size)`` of the output dimension, so attention runs
  on the member's own heads and the MLP on its own slice of the inner width;
* **row-parallel** matrices (attention output, MLP down): the matching columns of the
  input dimension; their partial outputs are summed over the group (one all-reduce);
* **vocabulary-parallel** embedding and LM head: rows ``[rank * V / size, ...)`` of the
  vocabulary. The embedding looks up the ids it holds and the group sums the rows; the
  head's logits are gathered over the group into the full vocabulary;
* norms whole on every member (their inputs and gradients are the same on each).

Autograd follows Megatron's conjugate operators: :func:`copy_to` (identity forward,
all-reduce of the gradient backward) before a column-parallel block, :func:`reduce_from`
(all-reduce forward, identity backward) after a row-parallel one, :func:`gather_last`
(all-gather forward, own slice backward) after the head.

:func:`shard_param` cuts a whole layer's parameter into a member's piece and
:func:`merge_param` joins the members' pieces again, by parameter name, so a sharded
layer starts from exactly the parameters of the whole one (whatever its TP degree) and
saved parameters are always whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class TpGroup(Protocol):
    """What the layers need of their TP group (:class:`~elaswave.comm.group.Group`)."""

    @property
    def size(self) -> int: ...

    def all_reduce(self, tensor: torch.Tensor) -> None: ...

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class TpShard:
    """Member ``rank`` of a TP group of ``size``; ``group`` carries the layers'
    collectives (None for a copy that never runs forward: a snapshot holder's)."""

    rank: int = 0
    size: int = 1
    group: TpGroup | None = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"TP member {self.rank} of {self.size}: need 0 <= rank < size")

    @property
    def active(self) -> bool:
        return self.size > 1

    def collectives(self) -> TpGroup:
        if self.group is None:
            raise RuntimeError(
                f"TP member {self.rank} of {self.size} has no group: built for its parameters "
                "only, it cannot run forward"
            )
        return self.group


NO_TP = TpShard()

COLUMN: tuple[str, ...] = ("wq.weight", "wk.weight", "wv.weight", "w_gate.weight")
COLUMN += ("w_up.weight", "embed.weight", "lm_head.weight")
COLUMN += ("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_proj.bias", "k_proj.bias")
COLUMN += ("v_proj.bias", "gate_proj.weight", "up_proj.weight", "embed_tokens.weight")
COLUMN += ("qkv_proj.weight", "gate_up_proj.weight")
COLUMN += ("linear_qkv.weight", "linear_fc1.weight", "word_embeddings.weight")
COLUMN += ("output_layer.weight", "q_b_proj.weight", "kv_b_proj.weight")
"""Parameters split along dimension 0 (output rows; vocabulary rows): the built-in
model's, a Hugging Face decoder's (:mod:`elaswave.model.hf`; latent attention's
up-projections to the heads), and a megatron-core GPT's
(:mod:`elaswave.model.megatron`: its q/k/v rows are grouped by key-value head, so
contiguous rows are whole groups). The fused ones (Phi-3's q/k/v and gate/up,
megatron's gate/up) are blocks of rows, each split in turn: :func:`fused_parts`."""
ROW: tuple[str, ...] = ("wo.weight", "w_down.weight", "o_proj.weight", "down_proj.weight")
ROW += ("linear_proj.weight", "linear_fc2.weight")
"""Parameters split along dimension 1 (input columns)."""


EXPERTS: dict[str, int] = {"experts.gate_up_proj": 1, "experts.down_proj": 2}
"""A mixture of experts' routed experts, fused along a leading expert dimension
(transformers 5's ``[experts, 2 x width, hidden]`` gate | up and ``[experts, hidden,
width]`` down): each expert's MLP split as a dense one's, its gate and up rows (blocks,
:func:`fused_parts`) and its down columns; every member holds a slice of every expert."""


def split_dim(name: str) -> int | None:
    """The dimension parameter ``name`` is split along, None when it is kept whole."""
    leaf = name.rsplit(".", 2)[-2:]
    key = ".".join(leaf)
    if key in COLUMN:
        return 0
    if key in ROW:
        return 1
    return EXPERTS.get(key)


class Shape(Protocol):
    """What :func:`fused_parts` reads of a model's shape (a ModelConfig)."""

    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def ffn_hidden_size(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def expert_ffn_size(self) -> int: ...


def fused_parts(name: str, shape: Shape) -> tuple[int, ...] | None:
    """The blocks of rows a fused projection's weight ``name`` holds (Phi-3's q, k and v
    heads; its, megatron's and fused experts' gate and up halves), each split over the
    group in turn; None for any other parameter."""
    leaf = ".".join(name.rsplit(".", 2)[-2:])
    if leaf == "qkv_proj.weight":
        q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
        return (q, kv, kv)
    if leaf in ("gate_up_proj.weight", "linear_fc1.weight"):
        return (shape.ffn_hidden_size, shape.ffn_hidden_size)
    if leaf == "experts.gate_up_proj":
        return (shape.expert_ffn_size, shape.expert_ffn_size)
    return None


def shard_param(
    name: str, whole: torch.Tensor, tp: TpShard, parts: Sequence[int] | None = None
) -> torch.Tensor:
    """Member ``tp.rank``'s piece of parameter ``name`` (a view of ``whole``; a copy of
    each block's piece where ``parts`` gives the blocks of a fused weight)."""
    dim = split_dim(name)
    if dim is None or not tp.active:
        return whole
    blocks = whole.split(list(parts), dim=dim) if parts else [whole]
    for block in blocks:
        if block.shape[dim] % tp.size:
            raise ValueError(
                f"{name}: dimension {dim} of size {block.shape[dim]} does not split {tp.size} ways"
            )
    pieces = [block.chunk(tp.size, dim=dim)[tp.rank] for block in blocks]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def merge_param(
    name: str, pieces: Sequence[torch.Tensor], parts: Sequence[int] | None = None
) -> torch.Tensor:
    """Parameter ``name`` whole again from every member's piece, in member order
    (``parts``: the blocks of a fused weight, as :func:`shard_param` took them)."""
    dim = split_dim(name)
    if dim is None or len(pieces) == 1:
        return pieces[0]
    if not parts:
        return torch.cat(list(pieces), dim=dim)
    size = len(pieces)
    own = [p.split([n // size for n in parts], dim=dim) for p in pieces]
    return torch.cat([own[m][b] for b in range(len(parts)) for m in range(size)], dim=dim)


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TpGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TpGroup) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _SumBoth(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TpGroup) -> torch.Tensor:
        ctx.group = group
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _GatherLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TpGroup, rank: int) -> torch.Tensor:
        ctx.rank, ctx.width = rank, x.shape[-1]
        local = x.movedim(-1, 0).contiguous()
        out = torch.empty((group.size, *local.shape), dtype=x.dtype, device=x.device)
        group.all_gather(out.view(-1), local.view(-1))
        # [size, width, ...] -> [..., size * width]
        return out.flatten(0, 1).movedim(0, -1).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        lo = ctx.rank * ctx.width
        return grad[..., lo : lo + ctx.width].contiguous(), None, None


def _all_reduce(x: torch.Tensor, group: TpGroup) -> torch.Tensor:
    """The group's sum of ``x``, reduced in fp32 (a bf16 sum of partial products would
    round each member's contribution twice)."""
    out = x.detach().to(torch.float32, copy=True).contiguous()
    group.all_reduce(out)
    return out.to(x.dtype)


def copy_to(x: torch.Tensor, tp: TpShard) -> torch.Tensor:
    """Identity forward; the gradient is summed over the group backward."""
    return _CopyTo.apply(x, tp.collectives()) if tp.active else x


def reduce_from(x: torch.Tensor, tp: TpShard) -> torch.Tensor:
    """The group's sum forward; identity backward."""
    return _ReduceFrom.apply(x, tp.collectives()) if tp.active else x


def sum_both(x: torch.Tensor, tp: TpShard) -> torch.Tensor:
    """The group's sum forward, and the sum of the gradients backward: for a statistic
    that every member's different output depends on (a norm over a width TP splits)."""
    return _SumBoth.apply(x, tp.collectives()) if tp.active else x


def summed_grad(tp: TpShard) -> Any:
    """A tensor hook that sums a gradient over the group: for a parameter every member
    holds whole but uses on its own part of the work (a gain shared by the heads), so
    that every member's gradient is the whole one."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        return _all_reduce(grad, tp.collectives())

    return hook


def gather_last(x: torch.Tensor, tp: TpShard) -> torch.Tensor:
    """Every member's ``x`` joined along the last dimension, in member order."""
    return _GatherLast.apply(x, tp.collectives(), tp.rank) if tp.active else x


def check_divisible(*, num_heads: int, num_kv_heads: int, ffn: int, vocab: int, tp: int) -> None:
    """ValueError naming the first model dimension ``tp`` does not divide."""
    for name, value in (
        ("num_heads", num_heads),
        ("num_kv_heads", num_kv_heads),
        ("ffn_hidden_size", ffn),
        ("vocab_size", vocab),
    ):
        if value % tp:
            raise ValueError(
                f"tp = {tp} does not divide model.{name} = {value}: tensor parallelism splits "
                "heads, key/value heads, the MLP's inner width and the vocabulary evenly"
            )
