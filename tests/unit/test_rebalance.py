"""The throughput planner (dataflow + graph + DVFS) and the plan it hands the executor."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elaswave.engine.cost import device, layer_costs
from elaswave.engine.plan import initial_plan
from elaswave.engine.rebalance import Policy, balanced_counts, rebalance, split_by_speed
from elaswave.engine.recovery import Rebalancing, next_plan, plan_digest
from elaswave.model.config import ModelConfig

pytestmark = pytest.mark.timeout(120)

MODEL = ModelConfig(num_blocks=14)  # 16 layers, the fail-stop acceptance shape
LAYERS = layer_costs(MODEL, dtype_bytes=4)
EMULATED = device("emulated")


def _plan():
    return initial_plan(num_layers=16, dp=4, pp=4, global_batch=64, micro_batch=2)


@given(st.integers(1, 12), st.lists(st.sampled_from([1.0, 1.25, 1.5, 2.0, 3.0]), min_size=1,
                                    max_size=4))  # fmt: skip
def test_split_by_speed_is_optimal(total: int, slowdowns: list[float]) -> None:
    sizes = split_by_speed(total, slowdowns)
    assert sum(sizes) == total
    best = min(
        max(s * f for s, f in zip(split, slowdowns, strict=True))
        for split in itertools.product(range(total + 1), repeat=len(slowdowns))
        if sum(split) == total
    )
    assert max(s * f for s, f in zip(sizes, slowdowns, strict=True)) == pytest.approx(best)


def test_policies_after_a_failure_improve_in_order() -> None:
    """resize-only leaves the failed stage the straggler; migration moves layers off it;
    DVFS then up-clocks what remains of the straggler, never above the maximum."""
    resized, _ = next_plan(_plan(), {5})
    worst = {}
    for policy in Policy:
        decision = rebalance(resized, layers=LAYERS, device=EMULATED, policy=policy)
        worst[policy] = max(decision.ministep_after_s)
        if policy is Policy.MIGRATE:
            assert decision.moved, "migration should move layers off the resized stage"
            assert all(a.layers != b.layers for a, b in zip(resized.stages[:2],
                                                            decision.plan.stages[:2],
                                                            strict=True))  # fmt: skip
        if policy is Policy.MIGRATE_DVFS:
            assert decision.frequencies, "DVFS should up-clock the tied stragglers"
            mhz = [s.mhz for s in decision.plan.stages if s.mhz is not None]
            assert mhz and all(EMULATED.base_mhz < m <= EMULATED.max_mhz for m in mhz)
    assert worst[Policy.NONE] == worst[Policy.RESIZE]
    assert worst[Policy.MIGRATE] < 0.8 * worst[Policy.RESIZE]
    assert worst[Policy.MIGRATE_DVFS] <= worst[Policy.MIGRATE]


def test_a_slow_rank_gets_fewer_samples_and_its_stage_fewer_layers() -> None:
    plan = _plan()
    decision = rebalance(
        plan, layers=LAYERS, device=EMULATED, policy=Policy.MIGRATE, slowdowns={5: 2.0}
    )
    stage = decision.plan.stages[1]
    assert stage.sizes[stage.ranks.index(5)] < min(
        size for rank, size in zip(stage.ranks, stage.sizes, strict=True) if rank != 5
    )
    assert sum(stage.sizes) == sum(plan.stages[1].sizes)
    assert len(stage.layers) < len(plan.stages[1].layers)
    assert decision.plan.generation == plan.generation + 1
    assert max(decision.ministep_after_s) < max(decision.ministep_before_s)


def test_nothing_to_gain_keeps_the_plan() -> None:
    counts = balanced_counts(MODEL, dp=4, pp=4, micro_batch=2, device=EMULATED)
    plan = initial_plan(
        num_layers=16, dp=4, pp=4, global_batch=64, micro_batch=2, layer_counts=counts
    )
    for policy in (Policy.RESIZE, Policy.MIGRATE):
        decision = rebalance(plan, layers=LAYERS, device=EMULATED, policy=policy)
        assert decision.plan is plan and not decision.moved


def test_workers_and_core_agree_byte_for_byte() -> None:
    """The plan is never shipped: every process recomputes it from the same inputs."""
    inputs = Rebalancing(
        policy=Policy.MIGRATE_DVFS, slowdowns={9: 1.5}, layers=LAYERS, device=EMULATED
    )
    digests = {plan_digest(next_plan(_plan(), {5}, inputs)[0]) for _ in range(3)}
    assert len(digests) == 1
    plan, reason = next_plan(_plan(), {5}, inputs)
    assert plan.generation == 1 and "ranks [5] failed" in reason


def test_policy_needs_the_cost_model() -> None:
    with pytest.raises(ValueError, match="needs the cost model"):
        next_plan(_plan(), {5}, Rebalancing(policy=Policy.MIGRATE))
    with pytest.raises(ValueError, match="not in the plan"):
        rebalance(_plan(), layers=LAYERS, device=EMULATED, policy="resize", slowdowns={99: 2.0})


def _llama7b_pp4_dp8():
    from elaswave.model.config import preset
    from elaswave.sim.policies import SimJob

    job = SimJob(preset("llama2-7b"), device("h100"), tp=1, pp=4, dp=8, micro_batch=1,
                 global_batch=64, devices_per_node=1)  # fmt: skip
    return job


@pytest.mark.parametrize("policy", [Policy.RESIZE, Policy.MIGRATE, Policy.MIGRATE_DVFS])
def test_a_returning_rank_goes_to_the_stage_that_lost_one_not_to_a_full_one(policy):
    """Regression (spot-trace simulation): stage 2 lost two ranks; a returning rank went
    to stage 0, already eight wide for eight-sample micro-batches, and took no samples
    (every stage tied on the slowest mini-step and the tie went to stage 0)."""
    from elaswave.engine.joiners import place_joiners
    from elaswave.engine.steptime import plan_step_time

    job = _llama7b_pp4_dp8()
    plan, _ = next_plan(job.plan(), [16, 17])  # stage 2 is 6 wide
    placement = place_joiners(plan, [16], layers=job.layers, device=job.device, policy=policy)
    assert placement == {16: 2}
    new, _ = next_plan(plan, [], Rebalancing(policy=policy, layers=job.layers, device=job.device),
                       joined=[16])  # fmt: skip
    if policy is Policy.MIGRATE_DVFS:
        return  # its clock heuristics are not monotone in width (a join can slow 1%)
    before = Rebalancing(policy=policy, layers=job.layers, device=job.device)
    plan, _ = next_plan(plan, [], before)  # the plan as it ran before the join
    assert (
        plan_step_time(new, job.layers, job.device).step_s
        < plan_step_time(plan, job.layers, job.device).step_s
    )


def test_joiners_never_idle_on_a_wide_stage_while_another_is_narrower():
    """Brute force over small layouts: the stage chosen never leaves the joiner without
    samples while a narrower stage exists, and its simulated step is the best among the
    stages where it would work."""
    from elaswave.engine.dataflow import add_ranks
    from elaswave.engine.joiners import place_joiners
    from elaswave.engine.steptime import plan_step_time

    for dp, failed in [(4, [5]), (4, [1, 9]), (3, [3, 4]), (4, [12, 13])]:
        plan, _ = next_plan(_plan() if dp == 4 else initial_plan(
            num_layers=16, dp=3, pp=4, global_batch=24, micro_batch=2), failed)  # fmt: skip
        (stage,) = place_joiners(plan, [99], layers=LAYERS, device=EMULATED).values()
        trial, _ = add_ranks(plan, {99: stage})
        narrowest = min(s.dp for s in plan.stages)
        idle = all(trial.stages[stage].shares(k)[-1] == 0
                   for k in range(trial.stages[stage].period))  # fmt: skip
        assert not (idle and plan.stages[stage].dp > narrowest)
        steps = {p: plan_step_time(add_ranks(plan, {99: p})[0], LAYERS, EMULATED).step_s
                 for p in range(plan.pp)}  # fmt: skip
        assert steps[stage] <= min(steps.values()) * (1 + 1e-6), (failed, stage, steps)
