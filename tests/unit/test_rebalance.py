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
