"""Rotating shares: a micro-batch the survivors do not divide.

After a failure leaves ``n`` replicas for a ``b``-sample micro-batch with ``n`` not
dividing ``b``, the shares rotate over the replicas from one micro-batch to the next;
every sample of every micro-batch still has exactly one replica and one route. What
that costs lies between the mean and the largest share and depends on the pipeline:
the planner prices candidates in between and keeps the one whose step simulates
shortest, replica by replica. DVFS then up-clocks the stages that tie as stragglers,
within the job's power budget.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elaswave.data.sampler import spread_split
from elaswave.engine import rebalance as rebalance_module
from elaswave.engine.cost import device, layer_costs
from elaswave.engine.dataflow import resize_after_failure, split_shares
from elaswave.engine.plan import initial_plan, plan_from_dict, plan_to_dict
from elaswave.engine.rebalance import Policy, power, rebalance
from elaswave.engine.recovery import Rebalancing, next_plan
from elaswave.engine.steptime import plan_step_time
from elaswave.model.config import PRESETS, ModelConfig
from elaswave.sim.policies import Layout, SimJob

pytestmark = pytest.mark.timeout(120)

LAYERS = layer_costs(ModelConfig(num_blocks=14), dtype_bytes=4)
EMULATED = device("emulated")


@given(st.integers(1, 64), st.integers(1, 12))
def test_spread_split_keeps_every_window_within_one_of_its_mean(total, parts):
    sizes = spread_split(total, parts)
    assert sum(sizes) == total and max(sizes) - min(sizes) <= 1
    for w in range(1, parts + 1):
        for k in range(parts):
            window = sum(sizes[(k + i) % parts] for i in range(w))
            assert math.floor(w * total / parts) <= window <= math.ceil(w * total / parts)


@given(st.integers(2, 6), st.integers(1, 4), st.data())
def test_rotated_routes_cover_every_sample_once_and_even_out(dp, micro_batch, data):
    plan = initial_plan(num_layers=8, dp=dp, pp=3, global_batch=dp * micro_batch * 6,
                        micro_batch=micro_batch)  # fmt: skip
    failed = data.draw(st.sets(st.sampled_from(plan.ranks), max_size=dp - 1))
    new, _ = resize_after_failure(plan, failed)
    total = dp * micro_batch
    for stage in new.stages:
        assert stage.rotate == (total % stage.dp != 0 and total >= stage.dp)
        # Over one period every replica runs the same number of samples.
        runs = [sum(stage.shares(mb)[j] for mb in range(stage.dp)) for j in range(stage.dp)]
        assert runs == [total] * stage.dp
        assert stage.load == max(stage.sizes)  # the largest share gates each micro-batch
    links = {g.name for g in new.group_specs()}
    for s in range(new.pp - 1):
        for mb in range(12):
            routes = new.routes(s, mb)
            covered = sorted(o for r in routes for o in range(r.lo, r.hi))
            assert covered == list(range(total)), f"stage {s} micro-batch {mb}"
            for r in routes:  # every route of every micro-batch of the step has its link
                assert mb >= new.num_micro_batches or f"link.{r.src}-{r.dst}" in links
                a = new.stages[s].offsets(mb)[new.stages[s].ranks.index(r.src)]
                b = new.stages[s + 1].offsets(mb)[new.stages[s + 1].ranks.index(r.dst)]
                assert a[0] <= r.lo < r.hi <= a[1] and b[0] <= r.lo < r.hi <= b[1]


def test_three_samples_over_two_survivors_rotate():
    plan = initial_plan(num_layers=16, dp=3, pp=2, global_batch=12, micro_batch=1)
    new, reason = resize_after_failure(plan, {0})
    stage = new.stages[0]
    assert stage.sizes == (2, 1) and stage.rotate and stage.load == 2
    assert [stage.shares(mb) for mb in range(3)] == [(2, 1), (1, 2), (2, 1)]
    assert "in rotation (1.5 each on average)" in reason
    assert split_shares(4, 2) == {"sizes": (2, 2), "rotate": False, "block": 1}
    assert split_shares(1, 2) == {"sizes": (1, 0), "rotate": False, "block": 1}


def test_plan_documents_keep_the_rotation_and_refuse_a_bad_flag():
    new, _ = resize_after_failure(
        initial_plan(num_layers=6, dp=3, pp=2, global_batch=12, micro_batch=1), {4}
    )
    doc = plan_to_dict(new)
    assert plan_from_dict(doc) == new
    doc["stages"][1]["rotate"] = "yes"
    with pytest.raises(ValueError, match="rotate = 'yes': must be true or false"):
        plan_from_dict(doc)


def test_a_slow_rank_stops_the_rotation_and_takes_less():
    plan = initial_plan(num_layers=16, dp=4, pp=2, global_batch=32, micro_batch=2)
    resized, _ = resize_after_failure(plan, {7})
    assert resized.stages[1].sizes == (3, 3, 2) and resized.stages[1].rotate
    decision = rebalance(
        resized, layers=LAYERS, device=EMULATED, policy=Policy.RESIZE, slowdowns={4: 2.0}
    )
    stage = decision.plan.stages[1]
    assert not stage.rotate, "a slow rank must keep its smaller share in every micro-batch"
    assert stage.sizes[stage.ranks.index(4)] < min(
        n for r, n in zip(stage.ranks, stage.sizes, strict=True) if r != 4
    )


def test_dvfs_upclocks_tied_stragglers_within_the_power_budget():
    plan = initial_plan(num_layers=16, dp=2, pp=4, global_batch=32, micro_batch=2)
    mhz = {}
    for budget in (None, 6.0, 5.0):
        rebalancing = Rebalancing(
            policy=Policy.MIGRATE_DVFS, layers=LAYERS, device=EMULATED, power_budget=budget
        )
        new, reason = next_plan(plan, {0, 2, 4}, rebalancing)  # one rank of stages 0-2
        mhz[budget] = [s.mhz for s in new.stages]
        if budget is not None:
            assert power(new.stages, EMULATED) <= budget + 1e-9, reason
    # Migration leaves stages 0-2 tied: all three up-clock, not just the slowest.
    assert [m is not None for m in mhz[None]] == [True, True, True, False]
    assert all(m is None or m <= EMULATED.max_mhz for m in mhz[None])
    # 6 ranks' power for 5 survivors: lower clocks than without a budget.
    upclocked = [(a, b) for a, b in zip(mhz[6.0], mhz[None], strict=True) if a is not None]
    assert upclocked and all(EMULATED.base_mhz < a < b for a, b in upclocked)
    # The survivors alone (5 ranks at base clock) leave no headroom: nothing up-clocks.
    assert mhz[5.0] == [None] * 4


def test_the_planner_keeps_the_rotation_price_whose_step_simulates_shortest(monkeypatch):
    """Llama2-7B on 96 simulated devices loses node 0 (replica-major): pricing stage 0's
    rotating shares halfway to the mean finds a layer partition and clocks whose
    simulated step is shorter than those priced at the largest share (the only price
    before)."""
    job = SimJob(
        PRESETS["llama2-7b"], device("ascend-910b"), tp=4, pp=3, dp=8,
        micro_batch=4, global_batch=8192, layout=Layout.REPLICA_MAJOR,
    )  # fmt: skip
    resized, _ = resize_after_failure(job.plan(), job.ranks_of_node(0))
    assert any(s.rotate for s in resized.stages)

    def step(prices):
        monkeypatch.setattr(rebalance_module, "ROTATION_PRICES", prices)
        decision = rebalance(
            resized, layers=job.layers, device=job.device, policy="migrate+dvfs",
            power_budget=job.power_budget,
        )  # fmt: skip
        return plan_step_time(decision.plan, job.layers, job.device).step_s, decision.reason

    chosen, reason = step((1.0, 0.5, 0.0))
    alone = {price: step((price,))[0] for price in (1.0, 0.5, 0.0)}
    assert chosen == min(alone.values())
    assert chosen < alone[1.0] * 0.995, (chosen, alone)
    assert "rotating 32-sample shares priced at 1 -> step" in reason and "0.5 chosen" in reason
