"""The contiguous ZeRO layout, and moving one layer's optimizer state between stages.

The contiguous layout is the baseline the interleaved one (:mod:`elaswave.fabric.layout`)
replaces (paper §6.3). A stage's layers' flat optimizer state is one global array, the
layers one after another in stage order with no padding between them, and DP replica j
owns the contiguous block ``[j * S, (j + 1) * S)`` of it, ``S = ceil(total / D)`` (the
last blocks may be short or empty).

Migrating layer i's state from stage S to S+1 (or S-1) then does two things:

- *cross*: the layer's elements go from their owners in the source stage to their owners
  in the destination stage (``|O_i|`` bytes);
- *reshard*: both stages' totals change by ``|O_i|``, so every cut point moves and
  elements that stay in a stage change owner (the paper's intra-stage all-to-all(v)).

Under the interleaved layout only the layer's D shards move, rank to rank
(:func:`plan_interleaved_migration` for the layer's shards alone,
:func:`plan_interleaved_stage_migration` for whole shard vectors).

This module is the pure planning core: layouts and plans are frozen dataclasses and every
function is a function of its arguments. Each planned transfer names the sender's and the
receiver's element offsets in their *local frames* (see :class:`MigrationPlan`); one
element is the three fp32 tensors of the optimizer (master weight, exp_avg, exp_avg_sq),
:data:`STATE_BYTES_PER_ELEMENT` bytes. :mod:`benchmarks.migration_exec` executes a
plan over point-to-point links.

Cost found (elements; ``n = |O_i|``, ``D`` ranks in a stage, ``R`` elements of the stage
that stay in it): cross is exactly ``n``. A stage's resharding is
:func:`reshard_numel_estimate` ``= sum_{k=1}^{D-1} min(R / D, k * n / D)`` up to the
rounding of the ``ceil`` block sizes (within ``(D - 1)^2 / 2`` elements, property-tested).
That is ``(D - 1) / 2 * n`` when ``R >= (D - 1) * n`` and less otherwise (a block cannot
hand over more than it holds). Both stages reshard, so with D equal layers per stage the
total is ``D * n``; the paper's ``(D + 1) / 2 * n`` is the cross transfer plus one
stage's resharding.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

from elaswave.fabric.layout import InterleavedLayout
from elaswave.fabric.remap import FP32_BYTES, STATE_TENSORS, shard_bounds

STATE_BYTES_PER_ELEMENT = STATE_TENSORS * FP32_BYTES
"""Bytes that move per element of a layer's flat state: fp32 master, exp_avg, exp_avg_sq."""


class ZeroScheme(enum.StrEnum):
    """How a stage's optimizer state is divided among its DP replicas."""

    CONTIGUOUS = "contiguous"
    """One block of the stage's concatenated state per replica."""
    INTERLEAVED = "interleaved"
    """Shard j of every layer on replica j (:class:`elaswave.fabric.layout.InterleavedLayout`)."""


class TransferKind(enum.StrEnum):
    """Why a range of elements moves between two ranks during a migration."""

    CROSS = "cross"
    """The moved layer, from its source-stage owner to its destination-stage owner."""
    RESHARD_SRC = "reshard-src"
    """An element that stays in the source stage but changes owner."""
    RESHARD_DST = "reshard-dst"
    """An element that stays in the destination stage but changes owner."""


# --------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class ContiguousLayer:
    """Where one layer sits in its stage's concatenated state array."""

    layer: int
    """Global layer index."""
    numel: int
    """Elements of the layer's flat state."""
    offset: int
    """Element offset of the layer's first element in the stage array."""

    @property
    def end(self) -> int:
        """Element offset one past the layer's last element."""
        return self.offset + self.numel


@dataclass(frozen=True)
class ContiguousLayout:
    """A stage's optimizer state as one array of ``total_numel`` elements over ``dp`` blocks."""

    dp: int
    """DP replicas of the stage; replica j owns block j."""
    layers: tuple[ContiguousLayer, ...]
    """The stage's layers in stage order, packed without padding."""

    def __post_init__(self) -> None:
        if self.dp < 1:
            raise ValueError(f"contiguous layout: dp = {self.dp} must be at least 1")
        ids = [entry.layer for entry in self.layers]
        if len(set(ids)) != len(ids):
            raise ValueError(f"contiguous layout: layer indices {ids} must be distinct")
        offset = 0
        for entry in self.layers:
            if entry.numel < 0:
                raise ValueError(f"layer {entry.layer}: numel {entry.numel} must be >= 0")
            assert entry.offset == offset, f"layer {entry.layer} not packed at {offset}"
            offset = entry.end

    @classmethod
    def build(cls, layer_numels: Sequence[tuple[int, int]], dp: int) -> ContiguousLayout:
        """``layer_numels``: (global layer index, flat size in elements) in stage order."""
        entries, offset = [], 0
        for layer, numel in layer_numels:
            if numel < 0:
                raise ValueError(f"layer {layer}: numel {numel} must be >= 0")
            entries.append(ContiguousLayer(layer, numel, offset))
            offset += numel
        return cls(dp, tuple(entries))

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return tuple(entry.layer for entry in self.layers)

    @property
    def layer_numels(self) -> tuple[tuple[int, int], ...]:
        """(layer, numel) in stage order: the argument :meth:`build` takes."""
        return tuple((entry.layer, entry.numel) for entry in self.layers)

    @property
    def total_numel(self) -> int:
        """Elements of the stage array."""
        return self.layers[-1].end if self.layers else 0

    @property
    def block_numel(self) -> int:
        """``S = ceil(total / dp)``: elements of every block but the last ones."""
        return -(-self.total_numel // self.dp)

    def block_bounds(self, replica: int) -> tuple[int, int]:
        """Element range ``[lo, hi)`` of the stage array that ``replica`` owns."""
        if not 0 <= replica < self.dp:
            raise ValueError(f"replica {replica} out of range [0, {self.dp})")
        return shard_bounds(self.total_numel, self.dp, replica)

    def blocks(self) -> list[tuple[int, int]]:
        """Every replica's block, in replica order."""
        return [self.block_bounds(replica) for replica in range(self.dp)]

    def block_sizes(self) -> list[int]:
        """Elements each replica owns, in replica order."""
        return [hi - lo for lo, hi in self.blocks()]

    def entry(self, layer: int) -> ContiguousLayer:
        for entry in self.layers:
            if entry.layer == layer:
                return entry
        raise ValueError(f"layer {layer} is not in this stage (layers {list(self.layer_ids)})")

    def layer_bounds(self, layer: int) -> tuple[int, int]:
        """Element range ``[lo, hi)`` of ``layer`` in the stage array."""
        entry = self.entry(layer)
        return entry.offset, entry.end

    def owners(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """(replica, lo, hi): the pieces of stage-array range ``[lo, hi)`` by owner."""
        out = []
        for replica, (blo, bhi) in enumerate(self.blocks()):
            plo, phi = max(lo, blo), min(hi, bhi)
            if plo < phi:
                out.append((replica, plo, phi))
        return out

    def layer_owners(self, layer: int) -> list[tuple[int, int, int]]:
        """(replica, lo, hi) of ``layer``'s pieces, ranges relative to the layer's start."""
        entry = self.entry(layer)
        return [
            (r, lo - entry.offset, hi - entry.offset)
            for r, lo, hi in self.owners(*self.layer_bounds(layer))
        ]

    def without(self, layer: int) -> ContiguousLayout:
        """The layout once ``layer`` has left the stage (the other layers repacked)."""
        self.entry(layer)
        return ContiguousLayout.build([p for p in self.layer_numels if p[0] != layer], self.dp)

    def with_layer(self, layer: int, numel: int, *, first: bool) -> ContiguousLayout:
        """The layout once ``layer`` has joined the stage, as its first or last layer."""
        if layer in self.layer_ids:
            raise ValueError(f"layer {layer} is already in this stage")
        pairs = list(self.layer_numels)
        pairs.insert(0 if first else len(pairs), (layer, numel))
        return ContiguousLayout.build(pairs, self.dp)


# --------------------------------------------------------------------------- plans


@dataclass(frozen=True)
class StateTransfer:
    """A range of elements sent from one rank to another (never rank-local)."""

    src: int
    """Global rank that sends."""
    dst: int
    """Global rank that receives."""
    numel: int
    """Elements (each :data:`STATE_BYTES_PER_ELEMENT` bytes)."""
    kind: TransferKind
    src_offset: int
    """Element offset of the range in the sender's local frame before the migration."""
    dst_offset: int
    """Element offset of the range in the receiver's local frame after the migration."""

    @property
    def bytes(self) -> int:
        """Bytes on the wire: ``numel`` x 12."""
        return self.numel * STATE_BYTES_PER_ELEMENT


@dataclass(frozen=True)
class LocalCopy:
    """A range of elements that stays on its rank but moves inside its local frame."""

    rank: int
    numel: int
    """Elements."""
    src_offset: int
    """Element offset in the rank's local frame before the migration."""
    dst_offset: int
    """Element offset in the rank's local frame after the migration."""


@dataclass(frozen=True)
class MigrationPlan:
    """Every element range one layer's migration moves, and the frames it moves them between.

    A rank's *local frame* is the flat element vector the plan reads from and writes to:
    under the contiguous scheme, the rank's whole block of its stage array (every element
    the rank owns, so local copies restore the kept elements' positions); under the
    interleaved scheme, the rank's (padded) shard of the moved layer only
    (:func:`plan_interleaved_migration`: the other layers' shards stay where they are), or
    the rank's whole shard vector (:func:`plan_interleaved_stage_migration`, with local
    copies for the other layers' shards). ``old_numel`` and ``new_numel`` give each
    rank's frame size, in elements, before and after.
    """

    scheme: ZeroScheme
    layer: int | None
    """Global index of the moved layer (None when the caller did not name it)."""
    numel: int
    """Elements of the moved layer's flat state (``|O_i|`` / 12 bytes)."""
    src_ranks: tuple[int, ...]
    """Global ranks of the source stage, in replica order."""
    dst_ranks: tuple[int, ...]
    """Global ranks of the destination stage, in replica order."""
    transfers: tuple[StateTransfer, ...]
    """Rank-to-rank sends, cross-stage pieces first; ``transfers[i]`` travels with tag index i."""
    local_copies: tuple[LocalCopy, ...]
    old_numel: Mapping[int, int]
    """Rank -> elements of its local frame before the migration."""
    new_numel: Mapping[int, int]
    """Rank -> elements of its local frame after the migration."""
    src_layout: ContiguousLayout | InterleavedLayout | None = None
    """The source stage's layout after the migration (None for a layer-only plan)."""
    dst_layout: ContiguousLayout | InterleavedLayout | None = None
    """The destination stage's layout after the migration (None for a layer-only plan)."""

    @property
    def ranks(self) -> tuple[int, ...]:
        return self.src_ranks + self.dst_ranks

    def numel_moved(self, kind: TransferKind | None = None) -> int:
        """Elements sent between ranks (all kinds, or only ``kind``)."""
        return sum(t.numel for t in self.transfers if kind is None or t.kind is kind)

    def bytes(self, kind: TransferKind | None = None) -> int:
        """Bytes sent between ranks (all kinds, or only ``kind``); 12 per element."""
        return self.numel_moved(kind) * STATE_BYTES_PER_ELEMENT

    def pair_numel(self) -> dict[tuple[int, int], int]:
        """(sending rank, receiving rank) -> elements sent between them."""
        out: dict[tuple[int, int], int] = {}
        for t in self.transfers:
            out[(t.src, t.dst)] = out.get((t.src, t.dst), 0) + t.numel
        return out

    def pairs(self) -> set[tuple[int, int]]:
        """Unordered rank pairs (lower first) that exchange at least one range."""
        return {(min(t.src, t.dst), max(t.src, t.dst)) for t in self.transfers}


def _pieces(
    old_bounds: Sequence[tuple[int, int]],
    new_bounds: Sequence[tuple[int, int]],
    *,
    old_lo: int,
    new_lo: int,
    length: int,
) -> Iterator[tuple[int, int, int, int, int]]:
    """Split a moving segment by old and new owner.

    The segment is ``length`` elements at ``[old_lo, old_lo + length)`` of the old array
    and ``[new_lo, new_lo + length)`` of the new one. Yields (old index, new index,
    numel, offset in the old owner's range, offset in the new owner's range) for every
    non-empty overlap.
    """
    shift = new_lo - old_lo
    for old_index, (olo, ohi) in enumerate(old_bounds):
        lo, hi = max(olo, old_lo), min(ohi, old_lo + length)
        if lo >= hi:
            continue
        for new_index, (nlo, nhi) in enumerate(new_bounds):
            plo, phi = max(lo + shift, nlo), min(hi + shift, nhi)
            if plo < phi:
                yield old_index, new_index, phi - plo, plo - shift - olo, plo - nlo


def _emit(
    pieces: Iterator[tuple[int, int, int, int, int]],
    old_ranks: Sequence[int],
    new_ranks: Sequence[int],
    kind: TransferKind,
    transfers: list[StateTransfer],
    copies: list[LocalCopy],
) -> None:
    for old_index, new_index, numel, src_offset, dst_offset in pieces:
        src, dst = old_ranks[old_index], new_ranks[new_index]
        if src == dst:
            copies.append(LocalCopy(src, numel, src_offset, dst_offset))
        else:
            transfers.append(StateTransfer(src, dst, numel, kind, src_offset, dst_offset))


def _is_forward(src_ids: Sequence[int], dst_ids: Sequence[int], layer: int) -> bool:
    """True when ``layer`` moves to the next stage (last of src, before all of dst), False
    when it moves to the previous one (first of src, after all of dst)."""
    if src_ids and layer == src_ids[-1] and all(layer < other for other in dst_ids):
        return True
    if src_ids and layer == src_ids[0] and all(layer > other for other in dst_ids):
        return False
    raise ValueError(
        f"layer {layer} cannot move from stage layers {list(src_ids)} to {list(dst_ids)}: "
        "only the last layer moves to the next stage and the first to the previous one"
    )


def _check_ranks(
    src_ranks: Sequence[int], dst_ranks: Sequence[int], dp_src: int, dp_dst: int
) -> None:
    if len(src_ranks) != dp_src or len(dst_ranks) != dp_dst:
        raise ValueError(
            f"{len(src_ranks)} source ranks and {len(dst_ranks)} destination ranks given for "
            f"dp {dp_src} and {dp_dst}: pass one global rank per replica"
        )
    ranks = list(src_ranks) + list(dst_ranks)
    if len(set(ranks)) != len(ranks):
        raise ValueError(
            f"source ranks {list(src_ranks)} and destination ranks {list(dst_ranks)} must be "
            "distinct: a rank belongs to one pipeline stage"
        )


def plan_contiguous_migration(
    src: ContiguousLayout,
    dst: ContiguousLayout,
    layer: int,
    src_ranks: Sequence[int],
    dst_ranks: Sequence[int],
) -> MigrationPlan:
    """Move ``layer`` from the stage laid out as ``src`` to the one laid out as ``dst``.

    Forward (stage S to S+1): ``layer`` is the last layer of ``src`` and precedes every
    layer of ``dst``; it becomes ``dst``'s first layer. Backward (stage S to S-1): it is
    the first layer of ``src``, follows every layer of ``dst`` and becomes its last.
    The plan holds the cross-stage pieces of the layer, then the resharding of both
    stages (elements that stay in a stage but change owner), and the rank-local copies;
    frames are the ranks' whole blocks (see :class:`MigrationPlan`).
    """
    _check_ranks(src_ranks, dst_ranks, src.dp, dst.dp)
    entry = src.entry(layer)
    forward = _is_forward(src.layer_ids, dst.layer_ids, layer)
    n = entry.numel
    src_after = src.without(layer)
    dst_after = dst.with_layer(layer, n, first=forward)
    old_src, new_src = src.blocks(), src_after.blocks()
    old_dst, new_dst = dst.blocks(), dst_after.blocks()
    rest_src, rest_dst = src_after.total_numel, dst.total_numel
    transfers: list[StateTransfer] = []
    copies: list[LocalCopy] = []
    # The layer itself: from its place in src to the start (forward) or end of dst.
    cross = _pieces(
        old_src, new_dst, old_lo=entry.offset, new_lo=0 if forward else rest_dst, length=n
    )
    _emit(cross, src_ranks, dst_ranks, TransferKind.CROSS, transfers, copies)
    # What stays in src: in place (forward) or shifted down by n (backward).
    stay_src = _pieces(old_src, new_src, old_lo=0 if forward else n, new_lo=0, length=rest_src)
    _emit(stay_src, src_ranks, src_ranks, TransferKind.RESHARD_SRC, transfers, copies)
    # What stays in dst: shifted up by n (forward) or in place (backward).
    stay_dst = _pieces(old_dst, new_dst, old_lo=0, new_lo=n if forward else 0, length=rest_dst)
    _emit(stay_dst, dst_ranks, dst_ranks, TransferKind.RESHARD_DST, transfers, copies)
    old_numel = dict(zip(src_ranks, src.block_sizes(), strict=True))
    old_numel.update(zip(dst_ranks, dst.block_sizes(), strict=True))
    new_numel = dict(zip(src_ranks, src_after.block_sizes(), strict=True))
    new_numel.update(zip(dst_ranks, dst_after.block_sizes(), strict=True))
    return MigrationPlan(
        scheme=ZeroScheme.CONTIGUOUS,
        layer=layer,
        numel=n,
        src_ranks=tuple(src_ranks),
        dst_ranks=tuple(dst_ranks),
        transfers=tuple(transfers),
        local_copies=tuple(copies),
        old_numel=old_numel,
        new_numel=new_numel,
        src_layout=src_after,
        dst_layout=dst_after,
    )


def plan_interleaved_migration(
    layer_numel: int,
    dp_src: int,
    dp_dst: int,
    src_ranks: Sequence[int],
    dst_ranks: Sequence[int],
    *,
    layer: int | None = None,
) -> MigrationPlan:
    """Move one layer's interleaved shards from a stage of ``dp_src`` to one of ``dp_dst``.

    Only the layer's shards move, and nothing reshards: with ``dp_src == dp_dst`` shard j
    goes from ``src_ranks[j]`` to ``dst_ranks[j]`` (at most D disjoint sends, fewer when
    trailing shards are pure padding); otherwise each piece of the overlap matrix of the
    two partitions (:func:`elaswave.fabric.remap.shard_bounds`) is one send. Only real
    elements move, never padding. Frames are each rank's padded shard of this layer:
    ``ceil(numel / dp)`` elements, zero before (destination) or after (source).
    """
    if layer_numel < 0:
        raise ValueError(f"layer_numel {layer_numel} must be >= 0")
    if dp_src < 1 or dp_dst < 1:
        raise ValueError(f"dp_src = {dp_src} and dp_dst = {dp_dst} must be at least 1")
    _check_ranks(src_ranks, dst_ranks, dp_src, dp_dst)
    old_bounds = [shard_bounds(layer_numel, dp_src, j) for j in range(dp_src)]
    new_bounds = [shard_bounds(layer_numel, dp_dst, j) for j in range(dp_dst)]
    transfers: list[StateTransfer] = []
    copies: list[LocalCopy] = []
    pieces = _pieces(old_bounds, new_bounds, old_lo=0, new_lo=0, length=layer_numel)
    _emit(pieces, src_ranks, dst_ranks, TransferKind.CROSS, transfers, copies)
    assert not copies, "source and destination ranks are distinct"
    old_shard, new_shard = -(-layer_numel // dp_src), -(-layer_numel // dp_dst)
    old_numel = {rank: old_shard for rank in src_ranks} | {rank: 0 for rank in dst_ranks}
    new_numel = {rank: 0 for rank in src_ranks} | {rank: new_shard for rank in dst_ranks}
    return MigrationPlan(
        scheme=ZeroScheme.INTERLEAVED,
        layer=layer,
        numel=layer_numel,
        src_ranks=tuple(src_ranks),
        dst_ranks=tuple(dst_ranks),
        transfers=tuple(transfers),
        local_copies=(),
        old_numel=old_numel,
        new_numel=new_numel,
    )


def plan_interleaved_stage_migration(
    src: InterleavedLayout,
    dst: InterleavedLayout,
    layer: int,
    src_ranks: Sequence[int],
    dst_ranks: Sequence[int],
) -> MigrationPlan:
    """:func:`plan_interleaved_migration` over whole shard vectors, with the new layouts.

    Frames are each rank's whole interleaved shard vector
    (:meth:`elaswave.fabric.layout.InterleavedLayout.shard_slices`): the transfers are
    those of the layer-only plan, offset to the layer's slice, and each rank's other
    shards are one local copy (they keep their order; only the moved layer's slice leaves
    or joins one end). Direction as in :func:`plan_contiguous_migration`.
    """
    src_ids = tuple(shards.layer for shards in src.layers)
    dst_ids = tuple(shards.layer for shards in dst.layers)
    forward = _is_forward(src_ids, dst_ids, layer)
    numel = next(shards.numel for shards in src.layers if shards.layer == layer)
    if layer in dst_ids:
        raise ValueError(f"layer {layer} is already in the destination stage")
    base = plan_interleaved_migration(numel, src.dp, dst.dp, src_ranks, dst_ranks, layer=layer)
    src_after = InterleavedLayout.build(
        [(s.layer, s.numel) for s in src.layers if s.layer != layer], src.dp
    )
    dst_pairs = [(s.layer, s.numel) for s in dst.layers]
    dst_pairs.insert(0 if forward else len(dst_pairs), (layer, numel))
    dst_after = InterleavedLayout.build(dst_pairs, dst.dp)
    src_lo = next(lo for lid, lo, _ in src.shard_slices() if lid == layer)
    dst_lo = next(lo for lid, lo, _ in dst_after.shard_slices() if lid == layer)
    transfers = tuple(
        replace(t, src_offset=t.src_offset + src_lo, dst_offset=t.dst_offset + dst_lo)
        for t in base.transfers
    )
    src_shard = -(-numel // src.dp)
    src_keep = (0, 0) if forward else (src_shard, 0)  # (old offset, new offset) of the rest
    dst_keep = (0, -(-numel // dst.dp)) if forward else (0, 0)
    copies = []
    for ranks, (old_at, new_at), kept in (
        (src_ranks, src_keep, src_after.shard_numel),
        (dst_ranks, dst_keep, dst.shard_numel),
    ):
        if kept:
            copies += [LocalCopy(rank, kept, old_at, new_at) for rank in ranks]
    return MigrationPlan(
        scheme=ZeroScheme.INTERLEAVED,
        layer=layer,
        numel=numel,
        src_ranks=tuple(src_ranks),
        dst_ranks=tuple(dst_ranks),
        transfers=transfers,
        local_copies=tuple(copies),
        old_numel={r: src.shard_numel for r in src_ranks} | {r: dst.shard_numel for r in dst_ranks},
        new_numel={r: src_after.shard_numel for r in src_ranks}
        | {r: dst_after.shard_numel for r in dst_ranks},
        src_layout=src_after,
        dst_layout=dst_after,
    )


# --------------------------------------------------------------------------- cost model


def reshard_numel_estimate(rest_numel: float, moved_numel: float, dp: int) -> float:
    """Elements one stage reshards when ``moved_numel`` elements leave or join one end of it.

    ``rest_numel``: elements that stay in the stage. The cut point of block k shifts by
    ``k * moved_numel / dp`` (counted from the end the layer leaves or joins), and a block
    hands over at most what it holds (``rest_numel / dp``), so the estimate is
    ``sum_{k=1}^{dp-1} min(rest_numel / dp, k * moved_numel / dp)``. It equals the paper's
    ``(dp - 1) / 2 * moved_numel`` exactly when ``rest_numel >= (dp - 1) * moved_numel``.
    The planned count differs from it only by the rounding of ``ceil`` block sizes.
    """
    if dp < 1:
        raise ValueError(f"dp = {dp} must be at least 1")
    block = rest_numel / dp
    return sum(min(block, k * moved_numel / dp) for k in range(1, dp))


def paper_contiguous_numel(moved_numel: float, dp: int) -> float:
    """The paper's contiguous migration cost in elements: ``(dp + 1) / 2 * moved_numel``."""
    return (dp + 1) / 2 * moved_numel
