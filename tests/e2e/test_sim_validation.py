"""The simulator against the runtime: an emulated-device run of a small plan, before and
after a fail-stop, takes the step times the simulator predicts for the same plans."""

from __future__ import annotations

import statistics

import pytest

from elaswave.engine.plan import Plan, StagePlan, initial_plan
from elaswave.runtime.config import JobConfig
from elaswave.sim.pipeline import plan_step_time
from tests.runs import train


def _plan(summary_plan: dict, global_batch: int, num_micro_batches: int) -> Plan:
    stages = tuple(
        StagePlan(i, s["layers"][0], s["layers"][1], tuple(s["ranks"]), tuple(s["sizes"]), s["mhz"])
        for i, s in enumerate(summary_plan["stages"])
    )
    return Plan(summary_plan["generation"], global_batch, num_micro_batches, stages)


@pytest.mark.timeout(300)
def test_simulated_step_times_match_an_emulated_run_within_10_percent(runs_dir):
    run = train(
        runs_dir / "simv",
        *("--device", "emulated", "--dp", "2", "--pp", "2", "--steps", "12"),
        *("--global-batch", "16", "--micro-batch", "2", "--fault", "kill:1@5:backward"),
    )
    times = run.summary["step_time_s"]
    cfg = JobConfig()
    before = initial_plan(
        num_layers=cfg.model.num_layers, dp=2, pp=2, global_batch=16, micro_batch=2
    )
    (rec,) = run.summary["recoveries"]
    after = _plan(rec["plan"], 16, before.num_micro_batches)
    for plan, measured in (
        (before, statistics.median(times[1:5])),
        (after, statistics.median(times[rec["step"] + 1 :])),
    ):
        predicted = plan_step_time(plan, cfg.layer_costs, cfg.cost_device).step_s
        assert abs(predicted / measured - 1) < 0.10, (
            f"simulated {predicted:.3f} s, ran {measured:.3f} s"
        )
