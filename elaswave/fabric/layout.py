"""The interleaved ZeRO layout (paper §6.3).

Each layer's parameters are flattened in registration order and padded to a multiple of
D; DP rank j owns shard j of every layer. A stage's gradient bucket is laid out rank-major
(shard 0 of every layer, then shard 1 of every layer, ...), so one reduce-scatter gives
rank j exactly its shards and one all-gather restores every layer. Moving a layer between
stages then moves D disjoint shards rank to rank, with no intra-stage resharding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerShards:
    layer: int
    numel: int
    """Elements of the layer's flat parameter."""
    shard: int
    """Elements of each of the D shards (padded)."""


@dataclass(frozen=True)
class InterleavedLayout:
    dp: int
    layers: tuple[LayerShards, ...]

    @classmethod
    def build(cls, layer_numels: Sequence[tuple[int, int]], dp: int) -> InterleavedLayout:
        """``layer_numels``: (global layer index, flat size) in stage order."""
        return cls(dp, tuple(LayerShards(layer, n, -(-n // dp)) for layer, n in layer_numels))

    @property
    def shard_numel(self) -> int:
        """Elements one DP rank owns across all the stage's layers."""
        return sum(shards.shard for shards in self.layers)

    def shard_slices(self) -> list[tuple[int, int, int]]:
        """(layer, lo, hi) of each layer's shard inside a rank's shard vector."""
        out, lo = [], 0
        for shards in self.layers:
            out.append((shards.layer, lo, lo + shards.shard))
            lo += shards.shard
        return out

    def to_rank_major(self, flats: Sequence[torch.Tensor]) -> torch.Tensor:
        """Per-layer flat tensors -> one [D * shard_numel] bucket, rank-major."""
        cols = []
        for shards, flat in zip(self.layers, flats, strict=True):
            padded = torch.zeros(self.dp * shards.shard, dtype=flat.dtype, device=flat.device)
            padded[: shards.numel] = flat
            cols.append(padded.view(self.dp, shards.shard))
        return torch.cat(cols, dim=1).reshape(-1)

    def from_rank_major(self, bucket: torch.Tensor) -> list[torch.Tensor]:
        """Inverse of :meth:`to_rank_major`: one flat tensor per layer (padding dropped)."""
        grid = bucket.view(self.dp, self.shard_numel)
        out, lo = [], 0
        for shards in self.layers:
            out.append(grid[:, lo : lo + shards.shard].reshape(-1)[: shards.numel])
            lo += shards.shard
        return out

    def shard_of(self, flats: Sequence[torch.Tensor], replica: int) -> torch.Tensor:
        """Replica ``replica``'s shard vector taken from full per-layer flats."""
        return self.to_rank_major(flats).view(self.dp, self.shard_numel)[replica].clone()
