"""Ring schedules, ring links and membership-change plans of the dynamic communicator."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.rebuild import RebuildStrategy, plan_rebuild
from elaswave.comm.abort import AbortSignal, StepAborted
from elaswave.comm.dynamic import ChangePlan, is_dp_group, links_used, plan_change, shrink_specs
from elaswave.comm.links import pair
from elaswave.comm.ring import (
    RingGroup,
    all_gather_schedule,
    reduce_scatter_schedule,
    ring_neighbours,
    ring_pairs,
    ring_tag,
)
from elaswave.comm.spec import GroupSpec, p2p_tag
from elaswave.engine.plan import initial_plan, snapshot_group_specs
from elaswave.engine.recovery import next_plan

pytestmark = pytest.mark.timeout(60)

EDIT, PARTIAL, FULL = RebuildStrategy.EDIT, RebuildStrategy.PARTIAL, RebuildStrategy.FULL


def _layout(dp: int, pp: int) -> list[GroupSpec]:
    plan = initial_plan(num_layers=pp, dp=dp, pp=pp, global_batch=dp, micro_batch=1)
    return plan.group_specs()


# --------------------------------------------------------------------------- ring helpers


def test_ring_pairs_by_size() -> None:
    assert ring_pairs([7]) == []
    assert ring_pairs([5, 2]) == [(2, 5)]
    assert ring_pairs([3, 1, 2]) == [(1, 2), (1, 3), (2, 3)]
    assert ring_pairs([0, 4, 8, 12]) == [(0, 4), (0, 12), (4, 8), (8, 12)]
    assert ring_neighbours([0, 4, 8, 12], 0) == (12, 4)
    assert ring_neighbours([0, 4, 8, 12], 12) == (8, 0)
    with pytest.raises(ValueError, match="distinct"):
        pair(3, 3)


@given(st.integers(2, 12), st.data())
def test_reduce_scatter_schedule_sums_every_chunk_once(size: int, data: st.DataObject) -> None:
    # Simulate the ring step by step; each chunk is a set of contributing ranks.
    acc = [[frozenset({rank}) for _ in range(size)] for rank in range(size)]
    schedules = [reduce_scatter_schedule(i, size) for i in range(size)]
    for step in range(size - 1):
        sent = [acc[i][schedules[i][step][0]] for i in range(size)]
        for i in range(size):
            prev = (i - 1) % size
            recv = schedules[i][step][1]
            assert schedules[prev][step][0] == recv, "sender and receiver disagree on the chunk"
            assert not acc[i][recv] & sent[prev], "a contribution would be added twice"
            acc[i][recv] = acc[i][recv] | sent[prev]
    for i in range(size):
        assert acc[i][i] == frozenset(range(size))


@given(st.integers(2, 12))
def test_all_gather_schedule_delivers_every_chunk(size: int) -> None:
    have = [{i} for i in range(size)]
    schedules = [all_gather_schedule(i, size) for i in range(size)]
    for step in range(size - 1):
        for i in range(size):
            prev = (i - 1) % size
            send, recv = schedules[prev][step][0], schedules[i][step][1]
            assert send == recv
            assert send in have[prev], "sending a chunk not yet received"
            have[i].add(recv)
    assert all(h == set(range(size)) for h in have)


def test_ring_tags_stay_clear_of_p2p_tags_and_int32() -> None:
    top = p2p_tag(63, 1023, (1 << 14) - 1)
    tags = {ring_tag(g, k, c) for g in (0, 5, 63) for k in (0, 15) for c in (0, 1, (1 << 20) - 1)}
    assert len(tags) == 18
    assert all(top < t < 1 << 31 for t in tags)
    assert ring_tag(1, 0, 0) != ring_tag(2, 0, 0), "a re-formed ring must not match old tags"


# --------------------------------------------------------------------------- plans


def test_shrink_keeps_ring_survivors_and_drops_broken_links() -> None:
    specs = [
        GroupSpec("dp.s0", (0, 1, 2)),
        GroupSpec("dp.s1", (3,)),
        GroupSpec("link.1-3", (1, 3)),
        GroupSpec("link.2-4", (2, 4)),
    ]
    assert shrink_specs(specs, {1, 3}) == [
        GroupSpec("dp.s0", (0, 2)),
        GroupSpec("link.2-4", (2, 4)),
    ]


@given(st.integers(4, 16), st.data())
def test_edit_one_failure_creates_one_link_between_the_neighbours(
    size: int, data: st.DataObject
) -> None:
    ranks = tuple(data.draw(st.permutations(range(100, 100 + size))))
    failed = data.draw(st.sampled_from(ranks))
    spec = GroupSpec("dp.s0", ranks)
    prev, nxt = ring_neighbours(ranks, failed)
    created = set()
    for rank in ranks:
        if rank == failed:
            continue
        mine = [p for p in ring_pairs(ranks) if rank in p]
        plan = plan_change(
            rank=rank, current=[spec], pooled=mine, specs=shrink_specs([spec], {failed}),
            removed={failed},
        )  # fmt: skip
        assert plan.reuse == ()
        assert plan.drop == ("dp.s0",)
        assert plan.groups == ()
        assert [s.ranks for s in plan.rings] == [tuple(r for r in ranks if r != failed)]
        assert plan.retire_links == tuple(p for p in mine if failed in p)
        assert len(plan.kept_links) + len(plan.new_links) == 2
        created.update(plan.new_links)
        assert bool(plan.new_links) == (rank in (prev, nxt))
    assert created == {pair(prev, nxt)}


def test_edit_small_rings_need_no_new_link() -> None:
    for ranks in [(0, 1, 2), (0, 1)]:
        spec = GroupSpec("dp.s0", ranks)
        for rank in ranks[1:]:
            plan = plan_change(
                rank=rank,
                current=[spec],
                pooled=[p for p in ring_pairs(ranks) if rank in p],
                specs=shrink_specs([spec], {0}),
                removed={0},
            )
            assert plan.new_links == ()
            assert len(plan.rings) == 1


def _strategy_plans(strategy: RebuildStrategy, dp: int = 4, pp: int = 3, failed: int = 5):
    specs = _layout(dp, pp)
    new = shrink_specs(specs, {failed})
    plans = {}
    for rank in range(dp * pp):
        if rank == failed:
            continue
        mine = [s for s in specs if rank in s.ranks]
        pooled = {p for s in mine if is_dp_group(s) for p in ring_pairs(s.ranks) if rank in p}
        plans[rank] = plan_rebuild(
            rank=rank, current=mine, pooled=pooled, specs=new, removed={failed}, strategy=strategy
        )
    return specs, plans


def test_edit_reuses_every_untouched_group() -> None:
    specs, plans = _strategy_plans(EDIT)
    # rank 5 = stage 1, replica 1: dp.s1 = (4, 5, 6, 7); links 1-5 and 5-9.
    assert plans[4].rings == (GroupSpec("dp.s1", (4, 6, 7), collectives=True),)
    assert plans[4].new_links == ((4, 6),)
    assert plans[6].new_links == ((4, 6),)
    assert plans[7].new_links == ()
    assert plans[1].drop == ("link.1-5",)
    assert plans[9].drop == ("link.5-9",)
    for rank, plan in plans.items():
        assert plan.groups == ()
        mine = {s.name for s in specs if rank in s.ranks}
        untouched = {s.name for s in specs if rank in s.ranks and 5 not in s.ranks}
        assert set(plan.reuse) == untouched
        assert set(plan.drop) == mine - untouched


def test_edit_serves_every_pair_from_one_link_whatever_its_purpose() -> None:
    """dp=4 x pp=4, rank 6 (stage 1) fails; the recovery plan's groups (resized routes,
    re-placed snapshots) need new pairs only where no link serves the pair yet."""
    plan = initial_plan(num_layers=4, dp=4, pp=4, global_batch=8, micro_batch=2)
    new_plan, _ = next_plan(plan, {6})
    old = plan.group_specs() + snapshot_group_specs(plan, 1)
    new = new_plan.group_specs() + snapshot_group_specs(new_plan, 1)
    builds = {r: plan_change(rank=r, current=[], pooled=[], specs=old) for r in plan.ranks}
    # One link per pair: ring (4, 5), (5, 6); pipeline (1, 5), (5, 9); snapshots to and
    # from other stages (rank 5's on 13, rank 10's on 5).
    assert builds[5].new_links == ((1, 5), (4, 5), (5, 6), (5, 9), (5, 10), (5, 13))
    assert {s.name for s in builds[5].pairs} == {"link.1-5", "link.5-9", "snap.10-5", "snap.5-13"}
    created = {}
    for r in new_plan.ranks:
        change = plan_change(
            rank=r,
            current=[s for s in old if r in s.ranks],
            pooled=builds[r].new_links,
            specs=new,
            removed={6},
        )
        assert change.groups == ()
        created[r] = change.new_links
    # Rank 5 takes part of rank 6's samples: its ring neighbour is now 7 and it needs the
    # failed rank's upstream peer 2; its snapshots stay where they were (rendezvous
    # placement moves only those rank 6 held).
    assert created[5] == ((2, 5), (5, 7))
    assert max(len(c) for c in created.values()) == 2


def test_partial_and_full_rebuild_as_full_groups() -> None:
    specs, partial = _strategy_plans(PARTIAL)
    assert partial[4].groups == (GroupSpec("dp.s1", (4, 6, 7), collectives=True),)
    assert partial[4].rings == () and partial[4].new_links == ()
    assert partial[0].groups == () and "dp.s0" in partial[0].reuse
    assert partial[6].retire_links == ((5, 6),)
    _, full = _strategy_plans(FULL)
    for plan in full.values():
        assert plan.reuse == () and plan.rings == ()
        # torch's way: every rank takes part in creating every group of the job.
        assert plan.groups == tuple(sorted(shrink_specs(specs, {5}), key=lambda s: s.name))
        assert plan.world == tuple(r for r in range(12) if r != 5)
        assert len(plan.retire_links) == 2
    assert partial[4].world == ()


def test_the_baselines_edit_is_elaswaves_plan_and_every_strategy_checks_the_change() -> None:
    specs, plans = _strategy_plans(EDIT)
    new = shrink_specs(specs, {5})
    for rank, plan in plans.items():
        mine = [s for s in specs if rank in s.ranks]
        pooled = {p for s in mine if is_dp_group(s) for p in ring_pairs(s.ranks) if rank in p}
        edit = plan_change(rank=rank, current=mine, pooled=pooled, specs=new, removed={5})
        assert edit == ChangePlan(
            **{f.name: getattr(plan, f.name) for f in dataclasses.fields(ChangePlan)}
        )
        assert plan.strategy is EDIT and plan.world == ()
    spec = GroupSpec("dp.s0", (0, 1, 2))
    for strategy in RebuildStrategy:
        with pytest.raises(ValueError, match="still contain removed"):
            plan_rebuild(
                rank=0, current=[spec], pooled=[], specs=[spec], removed={1}, strategy=strategy
            )
        with pytest.raises(ValueError, match="only survivors"):
            plan_rebuild(
                rank=1, current=[spec], pooled=[], specs=[], removed={1}, strategy=strategy
            )


def test_rebuild_reforms_a_ring_over_its_links() -> None:
    spec = GroupSpec("dp.s0", (0, 1, 2, 3))
    plan = plan_change(
        rank=0, current=[spec], pooled=[(0, 1), (0, 3)], specs=[spec], rebuild=is_dp_group
    )
    assert plan.rings == (spec,) and plan.new_links == () and plan.kept_links == ((0, 1), (0, 3))


def test_scale_up_connects_only_the_joiner() -> None:
    old, new = GroupSpec("dp.s0", (0, 1, 2, 3)), GroupSpec("dp.s0", (0, 1, 9, 2, 3))
    links = {r: [p for p in ring_pairs(old.ranks) if r in p] for r in old.ranks}
    plans = {r: plan_change(rank=r, current=[old], pooled=links[r], specs=[new]) for r in links}
    plans[9] = plan_change(rank=9, current=[], pooled=[], specs=[new])
    assert plans[1].new_links == ((1, 9),)
    assert plans[2].new_links == ((2, 9),)
    assert plans[0].new_links == () and plans[3].new_links == ()
    assert plans[9].new_links == ((1, 9), (2, 9))


def test_plan_rejects_inconsistent_changes() -> None:
    spec = GroupSpec("dp.s0", (0, 1, 2))
    with pytest.raises(ValueError, match="still contain removed"):
        plan_change(rank=0, current=[spec], pooled=[], specs=[spec], removed={1})
    with pytest.raises(ValueError, match="only survivors"):
        plan_change(rank=1, current=[spec], pooled=[], specs=[], removed={1})
    with pytest.raises(ValueError, match="duplicate"):
        plan_change(rank=0, current=[], pooled=[], specs=[spec, spec])


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 5),
    st.integers(1, 4),
    st.data(),
    st.sampled_from(list(RebuildStrategy)),
)
def test_every_member_agrees_and_creation_never_deadlocks(
    dp: int, pp: int, data: st.DataObject, strategy: RebuildStrategy
) -> None:
    """Brute force: every unit (full group or link) a change creates is planned by exactly
    its members, and creating units in each rank's plan order always completes."""
    world = dp * pp
    specs = _layout(dp, pp)
    builds = {r: plan_rebuild(rank=r, current=[], pooled=[], specs=specs) for r in range(world)}
    pools = {r: set(b.new_links) for r, b in builds.items()}
    removed = set(data.draw(st.sets(st.integers(0, world - 1), max_size=world - 1)))
    new = shrink_specs(specs, removed)
    plans = {
        r: plan_rebuild(
            rank=r,
            current=[s for s in specs if r in s.ranks],
            pooled=pools[r],
            specs=new,
            removed=removed,
            strategy=strategy,
        )
        for r in range(world)
        if r not in removed
    }
    for plans_of in (builds, plans):
        # A unit is created by its members; under FULL by the whole world (new_group).
        queues = {
            r: [("g", s.name, p.world or s.ranks) for s in p.groups]
            + [("l", lk, lk) for lk in p.new_links]
            for r, p in plans_of.items()
        }
        for unit in {u for q in queues.values() for u in q}:
            assert {r for r, q in queues.items() if unit in q} == set(unit[2])
        while any(queues.values()):
            heads = {q[0] for q in queues.values() if q}
            ready = [u for u in heads if all(queues[r] and queues[r][0] == u for r in u[2])]
            assert ready, f"deadlock: heads {sorted(heads)}"
            for unit in ready:
                for r in unit[2]:
                    queues[r].pop(0)


class _PairLink:
    """Stands in for a pooled link: an abort before the first send needs no transport."""

    def __init__(self, pair: tuple[int, int]) -> None:
        self.pair = pair

    def index_of(self, rank: int) -> int:
        return self.pair.index(rank)


class _Links:
    def get(self, a: int, b: int) -> _PairLink:
        return _PairLink((min(a, b), max(a, b)))


@pytest.mark.parametrize("collective", ["reduce_scatter", "all_gather", "all_reduce"])
def test_a_collective_aborted_after_reserving_leaves_the_ring_tainted(collective: str) -> None:
    """A member aborted between reserving its tag counter and posting anything has moved
    its counter past its peers'. Reporting the ring untainted let the recovery reuse it,
    and the redone step's collective then waited forever on tags no peer would send
    (a dp3 x pp2 SIGKILL test hung that way once in a loaded suite)."""
    signal = AbortSignal()
    ring = RingGroup(GroupSpec("dp.s0", (0, 1, 2)), 1, _Links(), timeout=timedelta(seconds=5),
                     generation=0, abort=signal)  # type: ignore[arg-type]  # fmt: skip
    signal.set("rank 3 failed")
    run = {
        "reduce_scatter": lambda: ring.reduce_scatter(torch.zeros(2), torch.zeros(6)),
        "all_gather": lambda: ring.all_gather(torch.zeros(6), torch.zeros(2)),
        "all_reduce": lambda: ring.all_reduce(torch.zeros(6)),
    }[collective]
    with pytest.raises(StepAborted):
        run()
    assert ring.tainted, "the ring's counter moved: it must be rebuilt, not reused"


# ------------------------------------------------------------------ links that go unused


def test_a_link_no_group_uses_any_more_is_retired_on_both_ends() -> None:
    """A change's remap link, or a route the new plan does not keep, is retired when the
    next change no longer uses it, though both ends live: a survivor's links follow its
    plan (on a GPU, churn left a survivor 16 gloo links more than the last joiner)."""
    ring = GroupSpec("dp.s0", (0, 1, 2, 3))
    remap = GroupSpec("remap.0-2", (0, 2))
    pooled = {(0, 1), (0, 3), (0, 2)}  # ring neighbours, and last change's remap link
    for rank in (0, 2):
        mine = {p for p in pooled | {(1, 2), (2, 3)} if rank in p}
        plan = plan_change(rank=rank, current=[ring, remap], pooled=mine, specs=[ring])
        assert plan.retire_links == ((0, 2),), rank
        assert plan.drop == ("remap.0-2",)
        kept = plan_change(rank=rank, current=[ring, remap], pooled=mine, specs=[ring, remap])
        assert kept.retire_links == () and kept.reuse == ("dp.s0", "remap.0-2")


_specs = st.lists(
    st.tuples(st.booleans(), st.lists(st.integers(0, 7), min_size=2, max_size=6, unique=True)),
    max_size=8,
).map(
    lambda raw: [
        GroupSpec(f"{'dp' if ring else 'x'}.{i}", tuple(ranks if ring else ranks[:2]))
        for i, (ring, ranks) in enumerate(raw)
    ]
)


@settings(max_examples=300, deadline=None)
@given(_specs)
def test_both_ends_of_a_pair_agree_whether_it_is_used(specs: list[GroupSpec]) -> None:
    """Keeping or retiring a link needs no message: both ends decide alike."""
    for a in range(8):
        for b in range(a + 1, 8):
            on_a = (a, b) in links_used(a, specs)
            on_b = (a, b) in links_used(b, specs)
            assert on_a == on_b, (a, b, specs)
