"""The simulated pipeline step against closed forms and a plain event loop."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elaswave.engine.cost import compute_time, device, layer_costs, p2p_time, ring_allreduce_time
from elaswave.engine.dataflow import resize_after_failure
from elaswave.engine.plan import Plan, StagePlan, initial_plan
from elaswave.engine.schedule import Op, Schedule, one_f_one_b
from elaswave.engine.steptime import (
    StageTimes,
    plan_step_time,
    simulate_step,
    stage_times,
    step_lower_bound,
)
from elaswave.model.config import ModelConfig

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(("p", "m"), [(1, 1), (1, 8), (4, 1), (4, 8), (3, 16)])
def test_a_uniform_pipeline_takes_m_plus_p_minus_1_mini_steps(p, m):
    got = simulate_step([StageTimes(1.0, 2.0, 0.0, 0.0, 0.0)] * p, m)
    assert got.step_s == pytest.approx((m + p - 1) * 3.0)
    assert got.bubble == pytest.approx((p - 1) / (m + p - 1))


def test_transfers_delay_the_fill_and_drain_and_collectives_end_the_step():
    # Two stages, one micro-batch: F0, send, F1, B1, send back, B0, then the sync.
    st = StageTimes(1.0, 2.0, 0.5, 0.25, 0.0)
    got = simulate_step([st, StageTimes(1.0, 2.0, 0.5, 0.25, 4.0)], 1)
    assert got.compute_end_s == pytest.approx((1 + 0.5 + 1 + 2 + 0.25 + 2, 1 + 0.5 + 1 + 2))
    assert got.step_s == pytest.approx(max(6.75, 4.5 + 4.0))


def test_the_slowest_stage_sets_the_steady_state():
    fast, slow = StageTimes(1.0, 2.0, 0, 0, 0), StageTimes(2.0, 4.0, 0, 0, 0)
    m = 64
    got = simulate_step([fast, slow, fast], m)
    assert got.step_s == pytest.approx(m * 6.0 + 2 * 3.0, rel=0.02)


def test_a_slow_rank_or_a_lower_clock_lengthens_the_plan_step():
    layers = layer_costs(ModelConfig(num_blocks=14), dtype_bytes=4)
    dev = device("emulated")
    plan = initial_plan(num_layers=16, dp=4, pp=4, global_batch=64, micro_batch=2)
    base = plan_step_time(plan, layers, dev).step_s
    assert plan_step_time(plan, layers, dev, slowdowns={5: 2.0}).step_s > 1.5 * base
    stages = list(plan.stages)
    stages[1] = dataclasses.replace(stages[1], mhz=dev.min_mhz)
    slower = dataclasses.replace(plan, stages=tuple(stages))
    assert plan_step_time(slower, layers, dev).step_s > base


def _reference(plan: Plan, layers, dev, slow) -> float:
    """Replica-by-replica event loop over :meth:`Plan.routes`, one action at a time."""
    cost = {c.index: c for c in layers}
    p, m = plan.pp, plan.num_micro_batches
    acts = [one_f_one_b(num_stages=p, stage=s, num_micro_batches=m) for s in range(p)]
    end: dict = {}
    free = {r: 0.0 for r in plan.ranks}
    done = dict(free)
    nxt = {r: 0 for r in plan.ranks}
    where = {r: plan.locate(r) for r in plan.ranks}
    live = {
        r
        for stage in plan.stages
        for j, r in enumerate(stage.ranks)
        if any(stage.shares(mb)[j] for mb in range(stage.period))
    }

    def per_sample(stage, backward):
        f = sum(
            (c.bwd_flops_per_sample if backward else c.fwd_flops_per_sample)
            for c in (cost[i] for i in stage.layers)
        )
        return compute_time(f, dev, stage.mhz or dev.base_mhz)

    def transfer(s, route):
        return p2p_time(
            (route.hi - route.lo) * cost[plan.stages[s].layer_stop - 1].output_bytes_per_sample, dev
        )

    progressed = True
    while progressed:
        progressed = False
        for r in sorted(live):
            s, j = where[r]
            stage = plan.stages[s]
            while nxt[r] < len(acts[s]):
                op, mb = acts[s][nxt[r]]
                if op is Op.FORWARD:
                    deps = (
                        []
                        if s == 0
                        else [
                            ((op, rt.src, mb), transfer(s - 1, rt))
                            for rt in plan.routes(s - 1, mb)
                            if rt.dst == r
                        ]
                    )
                else:
                    deps = (
                        [((Op.FORWARD, r, mb), 0.0)]
                        if s == p - 1
                        else [
                            ((op, rt.dst, mb), transfer(s, rt))
                            for rt in plan.routes(s, mb)
                            if rt.src == r
                        ]
                    )
                if any(k not in end for k, _ in deps):
                    break
                ready = max((end[k] + t for k, t in deps), default=0.0)
                dur = stage.shares(mb)[j] * per_sample(stage, op is Op.BACKWARD) * slow.get(r, 1.0)
                free[r] = end[(op, r, mb)] = max(free[r], ready) + dur
                done[r] = max(done[r], free[r])
                sends = (
                    plan.routes(s, mb)
                    if op is Op.FORWARD and s < p - 1
                    else plan.routes(s - 1, mb)
                    if op is Op.BACKWARD and s > 0
                    else []
                )
                for rt in sends:
                    if r in (rt.src, rt.dst) and rt.src != rt.dst:
                        side = s if op is Op.FORWARD else s - 1
                        if (rt.src if op is Op.FORWARD else rt.dst) == r:
                            done[r] = max(done[r], free[r] + transfer(side, rt))
                nxt[r] += 1
                progressed = True
    assert all(nxt[r] == len(acts[where[r][0]]) for r in live)
    return max(
        max(done[r] for r in stage.ranks if r in live)
        + (
            ring_allreduce_time(sum(cost[i].params for i in stage.layers) * 4, dev, dp=stage.dp)
            if stage.dp > 1
            else 0.0
        )
        for stage in plan.stages
    )


@st.composite
def _plans(draw):
    pp = draw(st.integers(2, 4))
    total = draw(st.integers(1, 6))
    bounds = sorted(
        draw(st.lists(st.integers(1, 15), min_size=pp - 1, max_size=pp - 1, unique=True))
    )
    bounds = [0, *bounds, 16]
    stages, rank = [], 0
    for s in range(pp):
        dp = draw(st.integers(1, 4))
        cuts = sorted(draw(st.lists(st.integers(0, total), min_size=dp - 1, max_size=dp - 1)))
        edges = [0, *cuts, total]
        sizes = tuple(edges[i + 1] - edges[i] for i in range(dp))
        rotate = dp > 1 and min(sizes) > 0 and draw(st.booleans())
        mhz = draw(st.sampled_from([None, 1500.0]))
        ranks = tuple(range(rank, rank + dp))
        rank += dp
        stages.append(StagePlan(s, bounds[s], bounds[s + 1], ranks, sizes, mhz, rotate))
    m = draw(st.integers(1, 6))
    slow = draw(st.dictionaries(st.integers(0, rank - 1), st.sampled_from([1.5, 3.0])))
    return Plan(0, total * m, m, tuple(stages)), slow


@settings(max_examples=60, deadline=None)
@given(_plans())
def test_the_vectorised_replica_simulation_matches_an_event_loop_over_the_routes(case):
    plan, slow = case
    layers = layer_costs(ModelConfig(num_blocks=14), dtype_bytes=4)
    dev = device("emulated")
    got = plan_step_time(plan, layers, dev, slowdowns=slow).step_s
    assert got == pytest.approx(_reference(plan, layers, dev, slow), rel=1e-9)


@settings(max_examples=80, deadline=None)
@given(_plans(), st.sampled_from(list(Schedule)))
def test_no_schedule_steps_faster_than_the_lower_bound(case, schedule):
    """The bound a planner skips candidates by holds under every schedule's lists,
    slowdowns and rotations; on a pipeline of one stage (nothing to wait for) it is
    the step."""
    plan, slow = case
    plan = dataclasses.replace(plan, schedule=schedule)
    layers = layer_costs(ModelConfig(num_blocks=14), dtype_bytes=4)
    dev = device("emulated")
    bound = step_lower_bound(plan, layers, dev, slowdowns=slow)
    assert 0 < bound <= plan_step_time(plan, layers, dev, slowdowns=slow).step_s
    one = initial_plan(num_layers=16, dp=2, pp=1, global_batch=8, micro_batch=1)
    one = dataclasses.replace(one, schedule=schedule)
    assert step_lower_bound(one, layers, dev) == pytest.approx(
        plan_step_time(one, layers, dev).step_s, rel=1e-8
    )


def test_rotating_shares_cost_between_their_mean_and_their_largest():
    """3 samples over 2 survivors rotate (2 + 1, then 1 + 2): the replica simulation lies
    between the stage-level step with every replica at the largest share and at the
    mean share (rotation's gain), and equals the stage-level step without rotation."""
    layers = layer_costs(ModelConfig(num_blocks=14), dtype_bytes=4)
    dev = device("emulated")
    before = initial_plan(num_layers=16, dp=3, pp=2, global_batch=48, micro_batch=1)
    plan, _ = resize_after_failure(before, [1])
    assert plan.stages[0].rotate and plan.stages[0].sizes == (2, 1)
    got = plan_step_time(plan, layers, dev).step_s
    largest = simulate_step(stage_times(plan, layers, dev), plan.num_micro_batches).step_s
    base = stage_times(plan, layers, dev)
    mean = [
        dataclasses.replace(base[0], fwd_s=base[0].fwd_s * 0.75, bwd_s=base[0].bwd_s * 0.75),
        base[1],
    ]
    low = simulate_step(mean, plan.num_micro_batches).step_s
    assert low < got < largest
    assert (got - low) < 0.5 * (largest - low)  # 16 micro-batches: close to the mean
    assert plan_step_time(before, layers, dev).step_s == pytest.approx(
        simulate_step(stage_times(before, layers, dev), before.num_micro_batches).step_s
    )
