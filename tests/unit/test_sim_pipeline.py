"""The simulated pipeline step against closed forms."""

from __future__ import annotations

import dataclasses

import pytest

from elaswave.engine.cost import device, layer_costs
from elaswave.engine.plan import initial_plan
from elaswave.model.config import ModelConfig
from elaswave.sim.pipeline import StageTimes, plan_step_time, simulate_step

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
