"""The simulator against the runtime: an emulated-device run of a small plan, before and
after a fail-stop, takes the step times the simulator predicts for the same plans,
rotating shares included, simulated replica by replica. (A rotation-block plan, dp 3
global batch 24 under ``migrate``, measured 0.938 of its simulated step once; dp 3 runs
sit 6-8% below the simulation on this 2-core host, too close to the 10% bound under the
suite's load for CI.)"""

from __future__ import annotations

import statistics

import pytest

from elaswave.engine.plan import Plan, StagePlan
from elaswave.engine.record import PlanSummary
from elaswave.engine.steptime import plan_step_time
from elaswave.runtime.job.config import JobConfig
from tests.runs import train


def _plan(summary_plan: PlanSummary, global_batch: int) -> Plan:
    stages = tuple(
        StagePlan(
            i,
            s.layers[0],
            s.layers[1],
            tuple(s.ranks),
            tuple(s.sizes),
            s.mhz,
            s.rotate,
            s.block,
        )
        for i, s in enumerate(summary_plan.stages)
    )
    assert summary_plan.schedule is not None, "summary.json records each plan's schedule"
    return Plan(
        summary_plan.generation,
        global_batch,
        summary_plan.num_micro_batches,
        stages,
        summary_plan.schedule,
    )


def _measure(runs_dir, dp, batch, micro_batch, rebalance, block, schedule):
    """(median measured step, simulated step) before and after a fail-stop of an
    emulated run under ``--schedule schedule``; ``block``: the rotation block the stage
    that lost a rank runs (0: no rotation). Before: the planner's simulation of the
    initial plan (summary.json's ``predicted_step_s``); after: the simulation of the
    recovery's plan as summary.json records it, its schedule included."""
    run = train(
        runs_dir / f"simv{dp}_{batch}_{rebalance}_{schedule}",
        *("--device", "emulated", "--dp", str(dp), "--pp", "2", "--steps", "16"),
        *("--schedule", schedule),
        *("--global-batch", str(batch), "--micro-batch", str(micro_batch)),
        *("--fault", "kill:1@8:backward", "--rebalance", rebalance),
    )
    times = run.summary.step_time_s
    cfg = JobConfig()
    (rec,) = run.summary.recoveries
    after = _plan(rec.plan, batch)
    assert after.stages[0].rotate == (block > 0)
    assert after.stages[0].block == max(block, 1)
    assert run.summary.predicted_step_s is not None
    return [
        (statistics.median(times[2:8]), run.summary.predicted_step_s),  # past the warm-up
        (
            statistics.median(times[rec.step + 1 :]),
            plan_step_time(after, cfg.layer_costs, cfg.cost_device).step_s,
        ),
    ]


LAYOUTS = [
    (2, 16, 2, "resize", 0),  # 4 samples over 1 survivor
    # 3 over 2 survivors: shares 2 + 1, then 1 + 2. Six processes: on a slower 2-core
    # host (2026-11-26) the emulation could not keep the step before the loss (0.29-0.31 s
    # measured against 0.19 s modelled, quiet host, also at fa70cf4), so the ratio came
    # out 0.89-1.06 against 1.27: the host's, not the model's; scripts/test_long runs it.
    pytest.param(3, 12, 1, "resize", 1, marks=pytest.mark.long),
]


SCHEDULES = ["1f1b", pytest.param("auto", marks=pytest.mark.long)]
"""1F1B, and what the planner chooses (zero-bubble lists on these layouts)."""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize(("dp", "batch", "micro_batch", "rebalance", "block"), LAYOUTS)
def test_a_fail_stop_changes_the_emulated_step_as_simulated(
    runs_dir, dp, batch, micro_batch, rebalance, block, schedule
):
    """The step after the recovery over the step before it, measured and simulated,
    within 10%. A ratio, because the emulated device keeps its time only as well as the
    host schedules its waits: with two busy loops beside it, a dp 3 run stepped 0.234 s
    against 0.191 s simulated (no emulation overrun: every compute block finished
    within its modelled time; the waits woke late), while the ratio after/before held
    (1.190 measured, 1.267 simulated). Absolute times: the ``long`` test below."""
    (mb, pb), (ma, pa) = _measure(runs_dir, dp, batch, micro_batch, rebalance, block, schedule)
    assert abs((pa / pb) / (ma / mb) - 1) < 0.10, (
        f"after/before: simulated {pa / pb:.3f}, ran {ma / mb:.3f} ({mb:.3f} -> {ma:.3f} s)"
    )


@pytest.mark.long
@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["1f1b", "auto"])
@pytest.mark.parametrize(("dp", "batch", "micro_batch", "rebalance", "block"), LAYOUTS)
def test_simulated_step_times_match_an_emulated_run_within_10_percent(
    runs_dir, dp, batch, micro_batch, rebalance, block, schedule
):
    """Absolute step times, on a host the test has to itself (``scripts/test_long``)."""
    measures = _measure(runs_dir, dp, batch, micro_batch, rebalance, block, schedule)
    for measured, predicted in measures:
        assert abs(predicted / measured - 1) < 0.10, (
            f"simulated {predicted:.3f} s, ran {measured:.3f} s"
        )


@pytest.mark.long
@pytest.mark.timeout(300)
def test_the_schedule_the_planner_chooses_on_pp4_runs_in_the_time_it_predicts(runs_dir):
    """Under ``--schedule auto`` the planner picks the fault-free job's schedule by its
    simulated step (a zero-bubble list): on pp4 with 8 micro-batches too, the emulated
    job steps within 10% of that prediction (summary.json's ``predicted_step_s``), on a
    host the test has to itself."""
    run = train(
        runs_dir / "simauto1x4",
        *("--device", "emulated", "--dp", "1", "--pp", "4", "--steps", "12"),
        *("--global-batch", "16", "--micro-batch", "2"),
    )
    predicted = run.summary.predicted_step_s
    measured = statistics.median(run.summary.step_time_s[2:])
    assert predicted is not None
    assert abs(predicted / measured - 1) < 0.10, (
        f"simulated {predicted:.3f} s, ran {measured:.3f} s"
    )
