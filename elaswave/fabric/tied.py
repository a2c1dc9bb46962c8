"""Tied input and output embeddings: one weight held twice, as Megatron holds it.

The layer that embeds tokens (first stage) and the layer that computes logits (last
stage) each hold a copy of the tied weight, with their own optimizer shards. Every step
the copies' gradients are summed over every rank that holds either (the first and last
stages' ranks: the plan's ``dp.tied`` group; on a one-stage pipeline, where one rank
holds both, its stage's ranks), and each stage's replica 0 keeps the sum while its other
replicas zero theirs, so the stage's reduce-scatter gives every shard of either copy the
whole gradient. Both copies then take the same AdamW update, element for element (the
update is elementwise and cut on a grid that does not depend on the shard,
:data:`elaswave.fabric.adamw.GRID`), so they stay equal through every step, snapshot,
recovery and layer move without being compared.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from elaswave.fabric.clip import SumGroup


@dataclass(frozen=True)
class TiedGrad:
    """One rank's part in summing the tied weight's gradient."""

    group: SumGroup
    """Every rank that holds a copy."""
    slots: tuple[tuple[int, int], ...]
    """(layer, parameter) positions of this rank's copies in its optimizer's layers."""
    keeps: bool
    """Replica 0 of its stage: it keeps the sum (the others zero their copies)."""

    def sum(self, grads: Sequence[torch.Tensor]) -> None:
        """Replace ``grads`` (this rank's copies' gradients, in :attr:`slots` order) by
        the sum over every copy of every rank (or by zeros where not :attr:`keeps`)."""
        total = grads[0].detach().clone()
        for grad in grads[1:]:
            total += grad
        self.group.all_reduce(total)
        for grad in grads:
            if self.keeps:
                grad.copy_(total)
            else:
                grad.zero_()
