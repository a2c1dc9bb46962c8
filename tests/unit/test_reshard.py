"""Resharding optimizer state for any plan change, checked against brute force.

A random model is split into stages under an old and a new plan (different layer
ranges, DP widths and members, some old owners failed with their snapshot on a
surviving holder). Applying the planned transfers to every old owner's interleaved shard
vector must give every new owner exactly the shard vector of the new layout, built
directly from the full per-layer states.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elaswave.fabric.errors import Unrecoverable
from elaswave.fabric.layout import InterleavedLayout
from elaswave.fabric.remap import LayerShards, Source, plan_reshard
from elaswave.fabric.remap_exec import vector_offset

pytestmark = pytest.mark.timeout(120)


def _stages(draw, num_layers: int, num_stages: int, ranks: list[int], max_dp: int):
    cuts = sorted(draw(st.sets(st.integers(1, num_layers - 1), min_size=num_stages - 1,
                               max_size=num_stages - 1)))  # fmt: skip
    bounds = [0, *cuts, num_layers]
    out, pool = [], list(ranks)
    for p in range(num_stages):
        dp = draw(st.integers(1, min(max_dp, len(pool) - (num_stages - p - 1))))
        members = tuple(pool[:dp])
        pool = pool[dp:]
        out.append((range(bounds[p], bounds[p + 1]), members))
    return out


@st.composite
def changes(draw):
    num_layers = draw(st.integers(2, 7))
    num_stages = draw(st.integers(1, min(3, num_layers)))
    numels = [draw(st.integers(1, 23)) for _ in range(num_layers)]
    old = _stages(draw, num_layers, num_stages, list(range(12)), 3)
    old_ranks = [r for _, members in old for r in members]
    # Failures: each failed owner's snapshot lives on a surviving rank of its stage.
    failed, holder_of = set(), {}
    for _, members in old:
        for i, owner in enumerate(members):
            if len(members) > 1 and draw(st.booleans()) and len(failed) < len(members) - 1:
                holder = members[(i + 1) % len(members)]
                if holder not in failed and all(owner not in h for h in holder_of.values()):
                    failed.add(owner)
                    holder_of[owner] = (holder,)
    survivors = [r for r in old_ranks if r not in failed] + list(range(12, 15))  # joiners
    new = _stages(draw, num_layers, num_stages, survivors, 3)
    return numels, old, new, failed, holder_of


def _layout(stage, numels) -> InterleavedLayout:
    layers, members = stage
    return InterleavedLayout.build([(i, numels[i]) for i in layers], len(members))


@settings(max_examples=150, deadline=None)
@given(changes())
def test_transfers_rebuild_every_new_shard_exactly(change) -> None:
    numels, old, new, failed, holder_of = change
    rng = np.random.default_rng(0)
    full = [torch.from_numpy(rng.standard_normal(n).astype(np.float32)) for n in numels]
    vectors = {}  # old owner -> its shard vector under its stage's old layout
    for stage in old:
        layout = _layout(stage, numels)
        for replica, owner in enumerate(stage[1]):
            vectors[owner] = layout.shard_of([full[i] for i in stage[0]], replica)
    items = []
    for layer in range(len(numels)):
        src = next(s for s in old if layer in s[0])
        dst = next(s for s in new if layer in s[0])
        items.append(LayerShards(layer, numels[layer], src[1], dst[1]))
    plan = plan_reshard(items, failed=failed, holder_of=holder_of)

    old_layout = {r: _layout(s, numels) for s in old for r in s[1]}
    new_layout = {r: _layout(s, numels) for s in new for r in s[1]}
    out = {r: torch.full((lay.shard_numel,), float("nan")) for r, lay in new_layout.items()}
    for t in plan.transfers:
        assert t.src not in failed and t.dst not in failed
        if t.kind is Source.HOST:
            assert holder_of[t.owner] == (t.src,) and t.owner in failed
        else:
            assert t.owner == t.src
        # The source reads the owner's vector (its own, or the snapshot of the owner's).
        o = vector_offset(old_layout[t.owner], t.layer, t.lo)
        n = vector_offset(new_layout[t.dst], t.layer, t.lo)
        out[t.dst][n : n + t.numel] = vectors[t.owner][o : o + t.numel]
    for stage in new:
        layout = _layout(stage, numels)
        for replica, owner in enumerate(stage[1]):
            want = layout.shard_of([full[i] for i in stage[0]], replica)
            got = out[owner]
            real = _real_mask(layout, replica, numels)
            assert torch.equal(got[real], want[real]), (owner, got, want)


def _real_mask(layout: InterleavedLayout, replica: int, numels) -> torch.Tensor:
    """Elements of a shard vector that hold state (not padding)."""
    mask = torch.zeros(layout.shard_numel, dtype=torch.bool)
    offset = 0
    for shards in layout.layers:
        lo = replica * shards.shard
        real = max(0, min(shards.shard, numels[shards.layer] - lo))
        mask[offset : offset + real] = True
        offset += shards.shard
    return mask


@given(st.integers(1, 8), st.integers(1, 10_000))
def test_interleaved_migration_is_d_disjoint_sends(dp: int, numel: int) -> None:
    """A layer moving between stages of equal width: shard j goes to rank j, |O| total."""
    src, dst = tuple(range(dp)), tuple(range(100, 100 + dp))
    plan = plan_reshard([LayerShards(7, numel, src, dst)])
    sends = [(t.src, t.dst) for t in plan.transfers]
    assert sends == [(src[j], dst[j]) for j in range(dp) if j * -(-numel // dp) < numel]
    assert sum(t.numel for t in plan.transfers) == numel


def test_lost_shard_names_owner_and_holder() -> None:
    with pytest.raises(Unrecoverable, match=r"owner 1, snapshot holder 2"):
        plan_reshard([LayerShards(0, 10, (0, 1, 2), (0,))], failed={1, 2}, holder_of={1: (2,)})


def test_a_failed_owners_shard_is_read_from_its_first_surviving_copy() -> None:
    """Two copies of rank 1's snapshot (on 2, then 3): with 1 and 2 lost, 3's is read;
    with 1, 2 and 3 lost, every holder is named."""
    items = [LayerShards(0, 12, (0, 1), (0, 4))]
    plan = plan_reshard(items, failed={1, 2}, holder_of={1: (2, 3)})
    assert {t.src for t in plan.transfers if t.owner == 1} == {3}
    with pytest.raises(Unrecoverable, match=r"owner 1, snapshot holders \[2, 3\]"):
        plan_reshard(items, failed={1, 2, 3}, holder_of={1: (2, 3)})
