"""Live remap planning (paper §5.2): integrity check and transfer plan, as pure code.

Any plan change moves optimizer state: when a stage's DP membership changes, every
layer's flat state moves from the old interleaved partition (D shards) to the new one
(D' shards); when a layer migrates, its D shards move to the new stage's D' owners. Both
are the same problem, solved per layer by :func:`plan_reshard`: each old shard's source
is its owner's device copy if the owner survives, else the host snapshot on its holder,
and the plan lists the element ranges each source sends to each new owner (the overlap
matrix of source and target partitions). Under the interleaved layout a layer moving
between stages of equal width is exactly D disjoint rank-to-rank sends. Executing the
plan is the executor's job.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from elaswave.fabric.errors import Unrecoverable
from elaswave.fabric.placement import SnapshotPlacement

FP32_BYTES = 4
"""Bytes of one fp32 element: the runtime trains, reduces and keeps its optimizer state
in fp32."""
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
    owner: int
    """The old owner of the shard the range is read from (``src`` itself for DEVICE)."""

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    @property
    def local(self) -> bool:
        return self.src == self.dst and self.kind is Source.DEVICE


@dataclass(frozen=True)
class LayerShards:
    """Who owns one layer's interleaved shards before and after a change."""

    layer: int
    numel: int
    old_ranks: tuple[int, ...]
    """Owner of each old shard, in replica order (the layer's old stage)."""
    new_ranks: tuple[int, ...]
    """Owner of each new shard, in replica order (the layer's new stage)."""


@dataclass(frozen=True)
class RemapPlan:
    transfers: tuple[Transfer, ...]

    def overlap_matrix(self) -> dict[tuple[int, int], int]:
        """(source rank, destination rank) -> elements moved between them."""
        out: dict[tuple[int, int], int] = {}
        for t in self.transfers:
            out[(t.src, t.dst)] = out.get((t.src, t.dst), 0) + t.numel
        return out

    def bytes_moved(self) -> int:
        """Bytes that cross between ranks (local device copies excluded)."""
        return sum(t.numel for t in self.transfers if not t.local) * STATE_TENSORS * FP32_BYTES


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
        holders = placement.holders_of(owner)
        alive = [h for h in holders if h not in failed]
        if alive:
            sources[replica] = (alive[0], Source.HOST)
        else:
            lost.append(f"shard {replica} of ranks {list(old_ranks)} ({_who(owner, holders)})")
    if lost:
        raise Unrecoverable(_lost(lost))
    return sources


def _who(owner: int, holders: Sequence[int]) -> str:
    """An owner and its snapshot holders, as a lost shard's message names them."""
    if len(holders) > 1:
        return f"owner {owner}, snapshot holders {list(holders)}"
    return f"owner {owner}, snapshot holder {holders[0] if holders else 'none'}"


def _lost(shards: Sequence[str]) -> str:
    return (
        "optimizer state lost: " + "; ".join(shards) + " — the owner and every holder of "
        "its snapshot failed, so no copy of it is left in memory"
    )


def plan_reshard(
    layers: Sequence[LayerShards],
    *,
    failed: Collection[int] = (),
    holder_of: Mapping[int, Sequence[int]] | None = None,
) -> RemapPlan:
    """Transfers that move every layer's shards from its old owners to its new ones.

    ``holder_of`` maps an owner rank to the ranks holding copies of its host snapshot
    (a failed owner's shard is read from the first that survives). Raises
    Unrecoverable naming every shard with neither a surviving owner nor a surviving
    holder. Transfers are ordered by layer, old shard, new shard: every rank derives the
    same list, so a transfer's position can name its message.
    """
    failed, holder_of = set(failed), dict(holder_of or {})
    lost, transfers = [], []
    for item in layers:
        if not item.new_ranks:
            raise Unrecoverable(f"layer {item.layer} has no new owner")
        d_old, d_new = len(item.old_ranks), len(item.new_ranks)
        for j, owner in enumerate(item.old_ranks):
            if owner not in failed:
                src, kind = owner, Source.DEVICE
            else:
                holders = holder_of.get(owner, ())
                alive = [h for h in holders if h not in failed]
                if not alive:
                    shard = f"shard {j} of ranks {list(item.old_ranks)}"
                    lost.append(f"{shard} ({_who(owner, holders)})")
                    continue
                src, kind = alive[0], Source.HOST
            olo, ohi = shard_bounds(item.numel, d_old, j)
            for jn in range(d_new):
                nlo, nhi = shard_bounds(item.numel, d_new, jn)
                lo, hi = max(olo, nlo), min(ohi, nhi)
                if lo < hi:
                    transfers.append(
                        Transfer(item.layer, lo, hi, src, kind, item.new_ranks[jn], owner)
                    )
    if lost:
        raise Unrecoverable(_lost(list(dict.fromkeys(lost))))
    return RemapPlan(tuple(transfers))


def plan_remap(
    *,
    layer_numels: Sequence[tuple[int, int]],
    old_ranks: Sequence[int],
    new_ranks: Sequence[int],
    failed: Collection[int],
    placement: SnapshotPlacement,
) -> RemapPlan:
    """Transfers that rebuild one stage's interleaved layout over ``new_ranks``."""
    if not new_ranks:
        raise Unrecoverable(f"no surviving rank in DP group {list(old_ranks)}")
    check_integrity(old_ranks, failed, placement)
    return plan_reshard(
        [LayerShards(layer, n, tuple(old_ranks), tuple(new_ranks)) for layer, n in layer_numels],
        failed=failed,
        holder_of={owner: placement.holders_of(owner) for owner in placement.holder},
    )
