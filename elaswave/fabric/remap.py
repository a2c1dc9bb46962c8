"""Live remap planning (paper §5.2): integrity check and transfer plan, as pure code.

When a stage's DP membership changes, every layer's flat optimizer state moves from the
old interleaved partition (D shards) to the new one (D' shards). Each old shard's source
is its owner's device copy if the owner survives, else the host snapshot on its holder.
The plan lists, per layer, the element ranges each source sends to each new owner: the
overlap matrix of source and target partitions. Executing it is the executor's job.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from elaswave.fabric.errors import Unrecoverable
from elaswave.fabric.placement import SnapshotPlacement

STATE_TENSORS = 3
"""fp32 tensors per element that move: master weight, exp_avg, exp_avg_sq."""


class Source(enum.StrEnum):
    DEVICE = "device"
    HOST = "host"


@dataclass(frozen=True)
class Transfer:
    layer: int
    lo: int
    hi: int
    """Element range [lo, hi) of the layer's flat state."""
    src: int
    kind: Source
    dst: int

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    @property
    def local(self) -> bool:
        return self.src == self.dst and self.kind is Source.DEVICE


@dataclass(frozen=True)
class RemapPlan:
    old_ranks: tuple[int, ...]
    new_ranks: tuple[int, ...]
    sources: dict[int, tuple[int, Source]]
    """Old replica index -> (rank, device or host) its shard is read from."""
    transfers: tuple[Transfer, ...]

    def overlap_matrix(self) -> dict[tuple[int, int], int]:
        """(source rank, destination rank) -> elements moved between them."""
        out: dict[tuple[int, int], int] = {}
        for t in self.transfers:
            out[(t.src, t.dst)] = out.get((t.src, t.dst), 0) + t.numel
        return out

    def bytes_moved(self) -> int:
        """Bytes that cross between ranks (local device copies excluded)."""
        return sum(t.numel for t in self.transfers if not t.local) * STATE_TENSORS * 4


def shard_bounds(numel: int, num_shards: int, index: int) -> tuple[int, int]:
    """Element range of shard ``index`` when ``numel`` is split into padded equal shards."""
    size = -(-numel // num_shards)
    return min(index * size, numel), min((index + 1) * size, numel)


def check_integrity(
    old_ranks: Sequence[int],
    failed: Collection[int],
    placement: SnapshotPlacement,
) -> dict[int, tuple[int, Source]]:
    """Where each old shard can be read from; raises Unrecoverable naming what was lost."""
    failed = set(failed)
    sources: dict[int, tuple[int, Source]] = {}
    lost = []
    for replica, owner in enumerate(old_ranks):
        if owner not in failed:
            sources[replica] = (owner, Source.DEVICE)
            continue
        holder = placement.holder.get(owner)
        if holder is not None and holder not in failed:
            sources[replica] = (holder, Source.HOST)
        else:
            lost.append(
                f"shard {replica} of ranks {list(old_ranks)} (owner {owner}, "
                f"snapshot holder {holder if holder is not None else 'none'})"
            )
    if lost:
        raise Unrecoverable(
            "optimizer state lost: " + "; ".join(lost) + " — the owner and its snapshot "
            "holder both failed, so no copy of it is left in memory"
        )
    return sources


def plan_remap(
    *,
    layer_numels: Sequence[tuple[int, int]],
    old_ranks: Sequence[int],
    new_ranks: Sequence[int],
    failed: Collection[int],
    placement: SnapshotPlacement,
) -> RemapPlan:
    """Transfers that rebuild the interleaved layout over ``new_ranks``."""
    if not new_ranks:
        raise Unrecoverable(f"no surviving rank in DP group {list(old_ranks)}")
    sources = check_integrity(old_ranks, failed, placement)
    d_old, d_new = len(old_ranks), len(new_ranks)
    transfers = []
    for layer, numel in layer_numels:
        for j in range(d_old):
            olo, ohi = shard_bounds(numel, d_old, j)
            src, kind = sources[j]
            for jn in range(d_new):
                nlo, nhi = shard_bounds(numel, d_new, jn)
                lo, hi = max(olo, nlo), min(ohi, nhi)
                if lo < hi:
                    transfers.append(Transfer(layer, lo, hi, src, kind, new_ranks[jn]))
    return RemapPlan(tuple(old_ranks), tuple(new_ranks), sources, tuple(transfers))
