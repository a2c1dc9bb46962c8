"""Megatron-style tensor parallelism for the built-in decoder.

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
"""Parameters split along dimension 0 (output rows; vocabulary rows): the built-in
model's and a Hugging Face decoder's (:mod:`elaswave.model.hf`)."""
ROW = ("wo.weight", "w_down.weight", "o_proj.weight", "down_proj.weight")
"""Parameters split along dimension 1 (input columns)."""


def split_dim(name: str) -> int | None:
    """The dimension parameter ``name`` is split along, None when it is kept whole."""
    leaf = name.rsplit(".", 2)[-2:]
    key = ".".join(leaf)
    if key in COLUMN:
        return 0
    if key in ROW:
        return 1
    return None


def shard_param(name: str, whole: torch.Tensor, tp: TpShard) -> torch.Tensor:
    """Member ``tp.rank``'s piece of parameter ``name`` (a view of ``whole``)."""
    dim = split_dim(name)
    if dim is None or not tp.active:
        return whole
    if whole.shape[dim] % tp.size:
        raise ValueError(
            f"{name}: dimension {dim} of size {whole.shape[dim]} does not split {tp.size} ways"
        )
    return whole.chunk(tp.size, dim=dim)[tp.rank]


def merge_param(name: str, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    """Parameter ``name`` whole again from every member's piece, in member order."""
    dim = split_dim(name)
    if dim is None or len(pieces) == 1:
        return pieces[0]
    return torch.cat(list(pieces), dim=dim)


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


def refuse_tp(tp: TpShard, config: Any) -> None:
    """ValueError when a model without tensor-parallel layers is asked for them (a
    Hugging Face model checks its own layers: :func:`elaswave.model.hf.refuse_hf_tp`)."""
    if tp.active and config.source and not config.source.startswith("hf:"):
        raise ValueError(
            f"model {config.source!r} has no tensor-parallel layers: --tp {tp.size} needs "
            "ElasWave's built-in model or a Hugging Face model (use --tp 1 with megatron-core)"
        )
