"""Gradient clipping by global norm over a sharded, pipelined, tensor-parallel model.

After the reduce-scatter each rank holds its replica's shard of its stage's summed
gradient. The global norm is the square root of the sum, over every shard of every
stage (and every TP member's piece), of the squared gradients: each rank adds its
shard's squares in float64, the TP group sums its members' (a parameter kept whole on
every member counts on member 0 only), and the plane's world group sums the units'.
Every rank then scales its shard by ``min(1, max_norm / (norm + 1e-6))``, as
``torch.nn.utils.clip_grad_norm_`` does, before its snapshot holder gets it, so owner
and holder apply the same update. The sums run in float64: every layout's norm agrees
to about 1e-15, whatever order its ranks add in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

EPS = 1e-6
"""Added to the norm before dividing, as ``clip_grad_norm_`` does."""


class SumGroup(Protocol):
    """A group that sums a tensor over its members, in place."""

    def all_reduce(self, tensor: torch.Tensor) -> None: ...


@dataclass
class GradClip:
    """One rank's part in clipping the step's gradient to ``max_norm``."""

    max_norm: float
    world: SumGroup
    """Every rank of the plan (in this rank's TP plane)."""
    world_size: int
    tp: SumGroup | None = None
    """The rank's TP group; None without tensor parallelism."""
    counted: torch.Tensor | None = None
    """0/1 per element of the shard: the elements this member counts (None: all)."""

    def norm(self, shard: torch.Tensor) -> float:
        """The global norm of the step's gradient, of which ``shard`` is this rank's
        part (every rank calls it at the same point of the step)."""
        part = torch.zeros(max(1, self.world_size), dtype=torch.float64, device=shard.device)
        squares = shard.double().square_()  # one float64 copy of the shard
        if self.counted is not None:
            squares.mul_(self.counted)
        part[0] = squares.sum()
        if self.tp is not None:
            self.tp.all_reduce(part)
        self.world.all_reduce(part)
        return math.sqrt(float(part[0]))

    def apply(self, shard: torch.Tensor) -> float:
        """Scale ``shard`` in place so that the global gradient's norm is at most
        ``max_norm``; return the norm before clipping."""
        total = self.norm(shard)
        scale = self.max_norm / (total + EPS)
        if scale < 1.0:
            shard.mul_(scale)
        return total
