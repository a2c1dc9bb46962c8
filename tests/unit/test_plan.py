import pytest
from hypothesis import given
from hypothesis import strategies as st

from elaswave.data.sampler import GlobalBatchSampler, even_split
from elaswave.engine.plan import Plan, StagePlan, even_partition, initial_plan


def test_initial_plan_stage_major_ranks_and_even_layers():
    plan = initial_plan(num_layers=6, dp=2, pp=4, global_batch=16, micro_batch=2)
    assert [s.ranks for s in plan.stages] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [len(s.layers) for s in plan.stages] == [2, 2, 1, 1]
    assert plan.num_micro_batches == 4
    assert plan.locate(5) == (2, 1)
    names = [g.name for g in plan.group_specs()]
    assert names[:4] == ["dp.s0", "dp.s1", "dp.s2", "dp.s3"]
    assert "link.1-3" in names and "link.0-3" not in names


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_layers": 3, "dp": 1, "pp": 4, "global_batch": 4, "micro_batch": 1}, "only 3 layers"),
        ({"num_layers": 6, "dp": 2, "pp": 1, "global_batch": 10, "micro_batch": 4}, "multiple of"),
        ({"num_layers": 6, "dp": 0, "pp": 1, "global_batch": 8, "micro_batch": 1}, "at least 1"),
    ],
)
def test_initial_plan_rejects_bad_layouts(kwargs, message):
    with pytest.raises(ValueError, match=message):
        initial_plan(**kwargs)


def _plan_with(sizes_a, sizes_b):
    total = sum(sizes_a)
    a = StagePlan(0, 0, 1, tuple(range(len(sizes_a))), tuple(sizes_a))
    b_ranks = tuple(range(len(sizes_a), len(sizes_a) + len(sizes_b)))
    b = StagePlan(1, 1, 2, b_ranks, tuple(sizes_b))
    return Plan(generation=0, global_batch=total, num_micro_batches=1, stages=(a, b))


sizes = st.lists(st.integers(0, 5), min_size=1, max_size=5)


@given(sizes, st.data())
def test_routes_match_brute_force_sample_ownership(sizes_a, data):
    """Every sample offset flows exactly from its owner in stage 0 to its owner in stage 1."""
    total = sum(sizes_a)
    n_b = data.draw(st.integers(1, 5))
    cuts = sorted(data.draw(st.lists(st.integers(0, total), min_size=n_b - 1, max_size=n_b - 1)))
    bounds = [0, *cuts, total]
    sizes_b = [bounds[i + 1] - bounds[i] for i in range(n_b)]
    plan = _plan_with(sizes_a, sizes_b)

    def owner(stage, offset):
        for rank, (lo, hi) in zip(stage.ranks, stage.offsets(), strict=True):
            if lo <= offset < hi:
                return rank
        raise AssertionError(offset)

    expected = [(owner(plan.stages[0], o), owner(plan.stages[1], o)) for o in range(total)]
    got = [None] * total
    for route in plan.routes(0):
        assert route.lo < route.hi
        for o in range(route.lo, route.hi):
            assert got[o] is None, "sample routed twice"
            got[o] = (route.src, route.dst)
    assert got == expected


@given(st.integers(1, 200), st.integers(1, 50))
def test_even_split(total, parts):
    out = even_split(total, parts)
    assert sum(out) == total and max(out) - min(out) <= 1 and list(out) == sorted(out, reverse=True)


def test_even_partition_rejects_more_stages_than_layers():
    with pytest.raises(ValueError, match="pp = 7"):
        even_partition(6, 7)


def test_sampler_slots_cover_step_exactly_with_uneven_sizes():
    sampler = GlobalBatchSampler(global_batch=24, num_micro_batches=4)
    slots = sampler.slots(step=3, replica_sizes=[3, 0, 2, 1])
    ids = sorted(i for replica in slots for slot in replica for i in slot.sample_ids)
    assert ids == list(sampler.step_ids(3))
    assert [s.size for s in slots[0]] == [3, 3, 3, 3] and slots[1][0].size == 0
    with pytest.raises(ValueError, match="sum to 6"):
        sampler.slots(step=0, replica_sizes=[3, 2])
