"""Pure fail-stop planning against brute force: resizing, snapshot placement, live remap."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elaswave.engine.dataflow import resize_after_failure
from elaswave.engine.plan import initial_plan
from elaswave.fabric.errors import Unrecoverable
from elaswave.fabric.placement import node_of, place_snapshots
from elaswave.fabric.remap import Source, plan_remap, shard_bounds


def test_resize_keeps_global_batch_and_spreads_the_share():
    plan = initial_plan(num_layers=6, dp=4, pp=2, global_batch=32, micro_batch=2)
    new, reason = resize_after_failure(plan, {5})
    assert new.generation == 1
    assert new.stages[0] == plan.stages[0]
    assert new.stages[1].ranks == (4, 6, 7) and new.stages[1].sizes == (3, 3, 2)
    assert sum(new.stages[1].sizes) == sum(plan.stages[1].sizes) == 8
    assert "ranks [5] failed" in reason
    # Activations from 4 replicas fan into 3: every sample offset still has one route.
    covered = sorted(o for r in new.routes(0) for o in range(r.lo, r.hi))
    assert covered == list(range(8))


def test_resize_refuses_losing_a_whole_stage():
    plan = initial_plan(num_layers=6, dp=2, pp=3, global_batch=8, micro_batch=2)
    with pytest.raises(Unrecoverable, match=r"stage 1 \(layers 2-3\) lost all its ranks \[2, 3\]"):
        resize_after_failure(plan, {2, 3})


@given(st.integers(1, 8), st.integers(1, 4), st.data())
def test_placement_is_node_safe_whenever_possible(dp, ranks_per_node, data):
    base = data.draw(st.integers(0, 3)) * dp
    ranks = list(range(base, base + dp))
    placement = place_snapshots(ranks, ranks_per_node)
    nodes = {node_of(r, ranks_per_node) for r in ranks}
    if dp == 1:
        assert placement.holder == {}
        return
    assert set(placement.holder) == set(ranks)
    assert all(placement.holder[r] != r for r in ranks)
    safe = all(
        node_of(placement.holder[r], ranks_per_node) != node_of(r, ranks_per_node) for r in ranks
    )
    assert placement.node_safe == safe
    assert safe == (len(nodes) > 1), "node-safe exactly when the stage spans nodes"
    if placement.node_safe and dp % ranks_per_node == 0 and base % ranks_per_node == 0:
        # Whole nodes: a uniform shift exists, so each rank holds exactly one snapshot.
        assert sorted(placement.holder.values()) == ranks


@settings(max_examples=200)
@given(
    st.lists(st.integers(1, 60), min_size=1, max_size=4),
    st.integers(2, 6),
    st.integers(1, 3),
    st.data(),
)
def test_remap_plan_matches_element_brute_force(numels, dp, ranks_per_node, data):
    old = list(range(10, 10 + dp))
    failed = set(
        data.draw(st.lists(st.sampled_from(old), min_size=1, max_size=dp - 1, unique=True))
    )
    new = [r for r in old if r not in failed]
    placement = place_snapshots(old, ranks_per_node)
    layers = list(enumerate(numels))
    lost = [o for o in failed if placement.holder.get(o) in failed]
    if lost:
        with pytest.raises(Unrecoverable) as info:
            plan_remap(
                layer_numels=layers,
                old_ranks=old,
                new_ranks=new,
                failed=failed,
                placement=placement,
            )
        for owner in lost:
            assert f"owner {owner}, snapshot holder {placement.holder[owner]}" in str(info.value)
        return
    plan = plan_remap(
        layer_numels=layers, old_ranks=old, new_ranks=new, failed=failed, placement=placement
    )
    for layer, n in layers:
        got: dict[int, tuple] = {}
        for t in plan.transfers:
            if t.layer != layer:
                continue
            for e in range(t.lo, t.hi):
                assert e not in got, "element sent twice"
                got[e] = (t.src, t.kind, t.dst)
        k_old, k_new = -(-n // dp), -(-n // len(new))
        for e in range(n):
            owner = old[e // k_old]
            src = (
                (owner, Source.DEVICE)
                if owner not in failed
                else (placement.holder[owner], Source.HOST)
            )
            assert got[e] == (*src, new[e // k_new]), (layer, e)
    moved = sum(v for (s, d), v in plan.overlap_matrix().items())
    assert moved == sum(numels)


def test_remap_refuses_owner_and_holder_lost_together():
    old = [0, 1, 2, 3]
    placement = place_snapshots(old, ranks_per_node=1)  # 0->1, 1->2, 2->3, 3->0
    with pytest.raises(Unrecoverable, match=r"owner 1, snapshot holder 2"):
        plan_remap(
            layer_numels=[(0, 100)],
            old_ranks=old,
            new_ranks=[0, 3],
            failed={1, 2},
            placement=placement,
        )


def test_shard_bounds_cover_exactly():
    for n in range(1, 30):
        for d in range(1, 7):
            spans = [shard_bounds(n, d, j) for j in range(d)]
            assert spans[0][0] == 0 and spans[-1][1] == n
            assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))


def test_plan_fail_stop_rolls_back_to_oldest_commit_and_checks_integrity():
    from elaswave.engine.recovery import next_plan, plan_digest
    from elaswave.engine.replan import plan_fail_stop

    plan = initial_plan(num_layers=6, dp=4, pp=2, global_batch=32, micro_batch=2)
    commits = {r: 7 for r in plan.ranks if r != 5} | {0: 8, 1: 8}
    decision = plan_fail_stop(plan, {5}, commits, ranks_per_node=1, snapshots=True)
    assert decision.committed_step == 7 and decision.failed == (5,)
    assert plan_digest(decision.plan) == plan_digest(next_plan(plan, {5})[0])
    assert plan_digest(decision.plan) != plan_digest(plan)
    with pytest.raises(Unrecoverable, match="owner 5"):
        plan_fail_stop(plan, {5}, commits, ranks_per_node=1, snapshots=False)
    # Snapshots go to the other stage: rank 1's is on rank 5, so losing both loses it.
    with pytest.raises(Unrecoverable, match="owner 1, snapshot holder 5"):
        plan_fail_stop(
            plan,
            {1, 5},
            {r: 7 for r in plan.ranks if r not in (1, 5)},
            ranks_per_node=1,
            snapshots=True,
        )
    with pytest.raises(ValueError, match=r"no committed step reported by surviving ranks \[7\]"):
        plan_fail_stop(
            plan,
            {5},
            {r: 7 for r in plan.ranks if r not in (5, 7)},
            ranks_per_node=1,
            snapshots=True,
        )
