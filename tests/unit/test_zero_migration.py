"""Layer migration plans under the contiguous and interleaved ZeRO layouts.

The oracle is brute force on numpy arrays: every element of every layer carries a unique
id; the old blocks/shards are cut from the concatenated stage arrays by plain slicing,
the plan is applied, and the result must equal the blocks/shards cut from the new stage
arrays. Owner changes are counted element by element to check the plan's byte counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.contiguous import (
    STATE_BYTES_PER_ELEMENT,
    ContiguousLayout,
    MigrationPlan,
    TransferKind,
    ZeroScheme,
    paper_contiguous_numel,
    plan_contiguous_migration,
    plan_interleaved_migration,
    plan_interleaved_stage_migration,
    reshard_numel_estimate,
)
from elaswave.fabric.layout import InterleavedLayout

pytestmark = pytest.mark.timeout(120)

ROW = 3
"""Columns per element in the simulation: master, exp_avg, exp_avg_sq."""
MOVED = 100
"""Global index of the moved layer in the generated cases."""


def state_of(layer: int, numel: int) -> np.ndarray:
    """[numel, 3] int64: a value no other (layer, element, tensor) of a case shares."""
    ids = (layer * 1_000_000 + np.arange(numel, dtype=np.int64))[:, None]
    return ids * ROW + np.arange(ROW, dtype=np.int64)[None, :]


def stage_array(layer_numels: list[tuple[int, int]]) -> np.ndarray:
    parts = [state_of(layer, numel) for layer, numel in layer_numels]
    return np.concatenate(parts) if parts else np.zeros((0, ROW), dtype=np.int64)


def cut_blocks(array: np.ndarray, dp: int) -> list[np.ndarray]:
    """Replica j's block: ``array[j * S : (j + 1) * S]`` with ``S = ceil(len / dp)``."""
    size = -(-len(array) // dp)
    return [array[j * size : (j + 1) * size] for j in range(dp)]


def simulate(
    plan: MigrationPlan, old: dict[int, np.ndarray], fill: int
) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    """Apply ``plan`` to every rank's old frame; returns (new frames, writes per row)."""
    new = {r: np.full((plan.new_numel[r], ROW), fill, dtype=np.int64) for r in plan.ranks}
    writes = {r: np.zeros(plan.new_numel[r], dtype=np.int64) for r in plan.ranks}
    for c in plan.local_copies:
        src = old[c.rank][c.src_offset : c.src_offset + c.numel]
        assert len(src) == c.numel
        new[c.rank][c.dst_offset : c.dst_offset + c.numel] = src
        writes[c.rank][c.dst_offset : c.dst_offset + c.numel] += 1
    for t in plan.transfers:
        src = old[t.src][t.src_offset : t.src_offset + t.numel]
        assert len(src) == t.numel
        new[t.dst][t.dst_offset : t.dst_offset + t.numel] = src
        writes[t.dst][t.dst_offset : t.dst_offset + t.numel] += 1
    return new, writes


@dataclass(frozen=True)
class Case:
    src: list[tuple[int, int]]
    dst: list[tuple[int, int]]
    dp_src: int
    dp_dst: int
    forward: bool

    @property
    def src_ranks(self) -> list[int]:
        return list(range(self.dp_src))

    @property
    def dst_ranks(self) -> list[int]:
        return list(range(50, 50 + self.dp_dst))

    @property
    def numel(self) -> int:
        return dict(self.src)[MOVED]

    def plan(self) -> MigrationPlan:
        return plan_contiguous_migration(
            ContiguousLayout.build(self.src, self.dp_src),
            ContiguousLayout.build(self.dst, self.dp_dst),
            MOVED,
            self.src_ranks,
            self.dst_ranks,
        )


@st.composite
def cases(draw: st.DrawFn, *, same_dp: bool = False) -> Case:
    """A stage pair and the layer moving between them: last of src forward, first backward."""
    dp_src = draw(st.integers(1, 8))
    dp_dst = dp_src if same_dp else draw(st.integers(1, 8))
    sizes = st.lists(st.integers(0, 60), max_size=5)
    kept, others, moved = draw(sizes), draw(sizes), draw(st.integers(0, 200))
    forward = draw(st.booleans())
    if forward:  # stage S's last layer becomes stage S+1's first
        src = [(MOVED - len(kept) + k, n) for k, n in enumerate(kept)] + [(MOVED, moved)]
        dst = [(MOVED + 1 + k, n) for k, n in enumerate(others)]
    else:  # stage S's first layer becomes stage S-1's last
        src = [(MOVED, moved)] + [(MOVED + 1 + k, n) for k, n in enumerate(kept)]
        dst = [(MOVED - len(others) + k, n) for k, n in enumerate(others)]
    return Case(src, dst, dp_src, dp_dst, forward)


# --------------------------------------------------------------------------- contiguous


@settings(max_examples=300, deadline=None)
@given(cases())
def test_contiguous_plan_rebuilds_both_stages_exactly(case: Case) -> None:
    plan = case.plan()
    src_new = [p for p in case.src if p[0] != MOVED]
    dst_new = [(MOVED, case.numel), *case.dst] if case.forward else [*case.dst, (MOVED, case.numel)]
    old = dict(zip(case.src_ranks, cut_blocks(stage_array(case.src), case.dp_src), strict=True))
    old |= dict(zip(case.dst_ranks, cut_blocks(stage_array(case.dst), case.dp_dst), strict=True))
    assert {r: plan.old_numel[r] for r in plan.ranks} == {r: len(a) for r, a in old.items()}

    new, writes = simulate(plan, old, fill=-1)

    want = dict(zip(case.src_ranks, cut_blocks(stage_array(src_new), case.dp_src), strict=True))
    want |= dict(zip(case.dst_ranks, cut_blocks(stage_array(dst_new), case.dp_dst), strict=True))
    for rank in plan.ranks:
        assert np.array_equal(new[rank], want[rank]), rank
        assert (writes[rank] == 1).all(), f"rank {rank}: rows written {writes[rank].tolist()}"
    assert plan.src_layout == ContiguousLayout.build(src_new, case.dp_src)
    assert plan.dst_layout == ContiguousLayout.build(dst_new, case.dp_dst)


@settings(max_examples=300, deadline=None)
@given(cases())
def test_contiguous_plan_sends_exactly_the_elements_that_change_owner(case: Case) -> None:
    plan = case.plan()
    src_set, dst_set = set(case.src_ranks), set(case.dst_ranks)
    for t in plan.transfers:
        assert t.src != t.dst and t.numel > 0
        ends = {
            TransferKind.CROSS: (src_set, dst_set),
            TransferKind.RESHARD_SRC: (src_set, src_set),
            TransferKind.RESHARD_DST: (dst_set, dst_set),
        }[t.kind]
        assert t.src in ends[0] and t.dst in ends[1], t

    def owners(layer_numels: list[tuple[int, int]], ranks: list[int]) -> dict[int, int]:
        """element id -> owning rank, element by element."""
        array = stage_array(layer_numels)
        size = -(-len(array) // len(ranks))
        return {int(array[x, 0]): ranks[x // size] for x in range(len(array))}

    src_new = [p for p in case.src if p[0] != MOVED]
    dst_new = [(MOVED, case.numel), *case.dst] if case.forward else [*case.dst, (MOVED, case.numel)]
    changed = {}
    for kind, before, after, ranks in (
        (TransferKind.RESHARD_SRC, case.src, src_new, case.src_ranks),
        (TransferKind.RESHARD_DST, case.dst, dst_new, case.dst_ranks),
    ):
        old_owner, new_owner = owners(before, ranks), owners(after, ranks)
        changed[kind] = sum(old_owner[e] != new_owner[e] for e in old_owner if e in new_owner)
        assert plan.numel_moved(kind) == changed[kind]
    assert plan.numel_moved(TransferKind.CROSS) == case.numel
    total = case.numel + changed[TransferKind.RESHARD_SRC] + changed[TransferKind.RESHARD_DST]
    assert plan.bytes() == STATE_BYTES_PER_ELEMENT * total
    assert plan.bytes(TransferKind.CROSS) == 12 * case.numel


@settings(max_examples=300, deadline=None)
@given(cases())
def test_each_stage_reshards_the_closed_form_up_to_rounding(case: Case) -> None:
    """|planned - sum_k min(R / D, k n / D)| <= (D - 1)^2 / 2 elements, per stage."""
    plan = case.plan()
    rest_src = sum(n for layer, n in case.src if layer != MOVED)
    rest_dst = sum(n for _, n in case.dst)
    for kind, rest, dp in (
        (TransferKind.RESHARD_SRC, rest_src, case.dp_src),
        (TransferKind.RESHARD_DST, rest_dst, case.dp_dst),
    ):
        got = plan.numel_moved(kind)
        assert abs(got - reshard_numel_estimate(rest, case.numel, dp)) <= (dp - 1) ** 2 / 2 + 1e-9
        assert got <= rest  # a stage reshards at most what stays in it


@settings(max_examples=200, deadline=None)
@given(dp=st.integers(1, 8), numel=st.integers(1, 5000), forward=st.booleans())
def test_paper_formula_holds_per_stage_with_d_equal_layers(
    dp: int, numel: int, forward: bool
) -> None:
    """D equal layers per stage: the rest R = (D - 1) n, the boundary of the regime
    R >= (D - 1) n where one stage's resharding is (D - 1) / 2 n. Then cross + one stage's
    resharding is the paper's (D + 1) / 2 |O_i|, and both stages' resharding makes D |O_i|."""
    if forward:  # the last of src's D layers becomes the first of dst's
        src = [(MOVED - dp + 1 + k, numel) for k in range(dp)]
        dst = [(MOVED + 1 + k, numel) for k in range(dp)]
    else:  # the first of src's D layers becomes the last of dst's
        src = [(MOVED + k, numel) for k in range(dp)]
        dst = [(MOVED - dp + k, numel) for k in range(dp)]
    plan = plan_contiguous_migration(
        ContiguousLayout.build(src, dp),
        ContiguousLayout.build(dst, dp),
        MOVED,
        list(range(dp)),
        list(range(dp, 2 * dp)),
    )
    layer_bytes = STATE_BYTES_PER_ELEMENT * numel
    rounding = STATE_BYTES_PER_ELEMENT * (dp - 1) ** 2 / 2
    paper = STATE_BYTES_PER_ELEMENT * paper_contiguous_numel(numel, dp)
    assert plan.bytes(TransferKind.CROSS) == layer_bytes
    for kind in (TransferKind.RESHARD_SRC, TransferKind.RESHARD_DST):
        assert abs(plan.bytes(TransferKind.CROSS) + plan.bytes(kind) - paper) <= rounding
    assert abs(plan.bytes() - dp * layer_bytes) <= 2 * rounding
    if numel >= 50 * dp * dp:  # rounding is then below 1 % of the layer
        assert plan.bytes(TransferKind.CROSS) + plan.bytes(TransferKind.RESHARD_SRC) == (
            pytest.approx(paper, rel=0.01)
        )
        assert plan.bytes() == pytest.approx(dp * layer_bytes, rel=0.01)


def test_large_layer_saturates_resharding() -> None:
    """R < (D - 1) n: a block cannot hand over more than it holds. D = 8, 1000 elements
    stay in each stage and 8000 move: every block but one hands over all of its 125, far
    below the paper's (D - 1) / 2 n = 28000 per stage."""
    plan = plan_contiguous_migration(
        ContiguousLayout.build([(0, 1000), (1, 8000)], 8),
        ContiguousLayout.build([(2, 1000)], 8),
        1,
        list(range(8)),
        list(range(8, 16)),
    )
    for kind in (TransferKind.RESHARD_SRC, TransferKind.RESHARD_DST):
        # blocks k = 1..7 move min(125, 1000 k) = 125 each
        assert plan.numel_moved(kind) == 7 * 125 == reshard_numel_estimate(1000, 8000, 8)
    assert plan.numel_moved() == 8000 + 2 * 875


def test_tiny_layer_is_dominated_by_rounding_of_the_cut_points() -> None:
    """D = 8, 56 elements stay and 1 leaves: S drops from 8 to 7, so cut point k moves by
    k elements and 0 + 1 + ... + 7 = 28 elements reshard, not (D - 1) / 2 = 3.5."""
    plan = plan_contiguous_migration(
        ContiguousLayout.build([(0, 56), (1, 1)], 8),
        ContiguousLayout.build([(2, 56)], 8),
        1,
        list(range(8)),
        list(range(8, 16)),
    )
    assert plan.numel_moved(TransferKind.RESHARD_SRC) == 28
    assert reshard_numel_estimate(56, 1, 8) == 3.5


def test_contiguous_plan_rejects_a_layer_off_the_boundary() -> None:
    src = ContiguousLayout.build([(0, 4), (1, 4), (2, 4)], 2)
    dst = ContiguousLayout.build([(3, 4)], 2)
    with pytest.raises(ValueError, match="only the last layer moves"):
        plan_contiguous_migration(src, dst, 1, [0, 1], [2, 3])
    with pytest.raises(ValueError, match="only the last layer moves"):
        plan_contiguous_migration(src, dst, 0, [0, 1], [2, 3])  # stage S-1 would be dst
    with pytest.raises(ValueError, match="one pipeline stage"):
        plan_contiguous_migration(src, dst, 2, [0, 1], [1, 2])
    with pytest.raises(ValueError, match="one global rank per replica"):
        plan_contiguous_migration(src, dst, 2, [0, 1, 5], [2, 3])


def test_contiguous_layout_blocks() -> None:
    layout = ContiguousLayout.build([(4, 5), (5, 3), (6, 2)], 4)
    assert layout.total_numel == 10 and layout.block_numel == 3
    assert layout.blocks() == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert layout.layer_bounds(5) == (5, 8)
    assert layout.layer_owners(5) == [(1, 0, 1), (2, 1, 3)]
    assert layout.without(4).layer_numels == ((5, 3), (6, 2))
    assert layout.with_layer(3, 7, first=True).layers[1].offset == 7
    with pytest.raises(ValueError, match="distinct"):
        ContiguousLayout.build([(1, 2), (1, 3)], 2)


# --------------------------------------------------------------------------- interleaved


def padded_shard(flat: np.ndarray, dp: int, replica: int) -> np.ndarray:
    """Replica's shard of the layer as :class:`InterleavedLayout` stores it (zero padding)."""
    layout = InterleavedLayout.build([(MOVED, len(flat))], dp)
    cols = [
        layout.shard_of([torch.from_numpy(flat[:, c].astype(np.float64))], replica)
        for c in range(ROW)
    ]
    return torch.stack(cols, dim=1).numpy().astype(np.int64)


@settings(max_examples=300, deadline=None)
@given(numel=st.integers(0, 300), dp_src=st.integers(1, 8), dp_dst=st.integers(1, 8))
def test_interleaved_plan_moves_only_the_layer_shards(numel: int, dp_src: int, dp_dst: int) -> None:
    src_ranks, dst_ranks = list(range(dp_src)), list(range(20, 20 + dp_dst))
    plan = plan_interleaved_migration(numel, dp_src, dp_dst, src_ranks, dst_ranks, layer=MOVED)
    assert plan.scheme is ZeroScheme.INTERLEAVED
    flat = state_of(MOVED, numel)
    old = {r: padded_shard(flat, dp_src, j) for j, r in enumerate(src_ranks)}
    old |= {r: np.zeros((0, ROW), dtype=np.int64) for r in dst_ranks}
    assert {r: plan.old_numel[r] for r in plan.ranks} == {r: len(a) for r, a in old.items()}

    new, writes = simulate(plan, old, fill=0)

    for j, rank in enumerate(dst_ranks):
        assert np.array_equal(new[rank], padded_shard(flat, dp_dst, j)), rank
        assert (writes[rank] <= 1).all()
        size = -(-numel // dp_dst)
        assert writes[rank].sum() == len(range(numel)[j * size : (j + 1) * size])
    assert all(len(new[r]) == 0 for r in src_ranks)
    assert plan.bytes() == STATE_BYTES_PER_ELEMENT * numel == plan.bytes(TransferKind.CROSS)
    assert all(t.kind is TransferKind.CROSS and t.numel > 0 for t in plan.transfers)
    if dp_src == dp_dst:
        size = -(-numel // dp_src)
        expected = [
            (src_ranks[j], dst_ranks[j], min(size, numel - j * size))
            for j in range(dp_src)
            if j * size < numel
        ]
        assert [(t.src, t.dst, t.numel) for t in plan.transfers] == expected
        assert len(plan.transfers) <= dp_src


def shard_vector(layer_numels: list[tuple[int, int]], dp: int, replica: int) -> np.ndarray:
    """Shard ``replica`` of every layer, each zero-padded to ``ceil(numel / dp)`` rows."""
    parts = [np.zeros((0, ROW), dtype=np.int64)]
    for layer, numel in layer_numels:
        size = -(-numel // dp)
        shard = np.zeros((size, ROW), dtype=np.int64)
        real = state_of(layer, numel)[replica * size : (replica + 1) * size]
        shard[: len(real)] = real
        parts.append(shard)
    return np.concatenate(parts)


@settings(max_examples=300, deadline=None)
@given(cases())
def test_interleaved_stage_plan_rebuilds_both_shard_vectors(case: Case) -> None:
    plan = plan_interleaved_stage_migration(
        InterleavedLayout.build(case.src, case.dp_src),
        InterleavedLayout.build(case.dst, case.dp_dst),
        MOVED,
        case.src_ranks,
        case.dst_ranks,
    )
    src_new = [p for p in case.src if p[0] != MOVED]
    dst_new = [(MOVED, case.numel), *case.dst] if case.forward else [*case.dst, (MOVED, case.numel)]
    old = {r: shard_vector(case.src, case.dp_src, j) for j, r in enumerate(case.src_ranks)}
    old |= {r: shard_vector(case.dst, case.dp_dst, j) for j, r in enumerate(case.dst_ranks)}
    assert {r: plan.old_numel[r] for r in plan.ranks} == {r: len(a) for r, a in old.items()}

    new, writes = simulate(plan, old, fill=0)

    size = -(-case.numel // case.dp_dst)
    for j, rank in enumerate(case.src_ranks):
        assert np.array_equal(new[rank], shard_vector(src_new, case.dp_src, j)), rank
        assert (writes[rank] == 1).all()
    for j, rank in enumerate(case.dst_ranks):
        assert np.array_equal(new[rank], shard_vector(dst_new, case.dp_dst, j)), rank
        assert (writes[rank] <= 1).all()
        padding = size - len(range(case.numel)[j * size : (j + 1) * size])
        assert (writes[rank] == 0).sum() == padding  # only the moved shard's padding
    layer_only = plan_interleaved_migration(
        case.numel, case.dp_src, case.dp_dst, case.src_ranks, case.dst_ranks
    )
    assert [(t.src, t.dst, t.numel) for t in plan.transfers] == [
        (t.src, t.dst, t.numel) for t in layer_only.transfers
    ]
    assert plan.bytes() == STATE_BYTES_PER_ELEMENT * case.numel
    assert plan.src_layout == InterleavedLayout.build(src_new, case.dp_src)
    assert plan.dst_layout == InterleavedLayout.build(dst_new, case.dp_dst)


def test_interleaved_plan_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="one global rank per replica"):
        plan_interleaved_migration(10, 2, 2, [0, 1], [2])
    with pytest.raises(ValueError, match="one pipeline stage"):
        plan_interleaved_migration(10, 2, 2, [0, 1], [1, 2])
    with pytest.raises(ValueError, match="at least 1"):
        plan_interleaved_migration(10, 0, 2, [], [1, 2])
