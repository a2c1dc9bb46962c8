"""The simulator against the runtime: an emulated-device run of a small plan, before and
after a fail-stop, takes the step times the simulator predicts for the same plans,
rotating shares included, simulated replica by replica. (A rotation-block plan, dp 3
global batch 24 under ``migrate``, measured 0.938 of its simulated step once; dp 3 runs
sit 6-8% below the simulation on this 2-core host, too close to the 10% bound under the
suite's load for CI.)"""

from __future__ import annotations

import statistics

import pytest

from elaswave.engine.plan import Plan, StagePlan, initial_plan
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
    return Plan(summary_plan.generation, global_batch, summary_plan.num_micro_batches, stages)


def _measure(runs_dir, dp, batch, micro_batch, rebalance, block):
    """(plan, median measured step, simulated step) before and after a fail-stop of an
    emulated run; ``block``: the rotation block the stage that lost a rank runs (0: no
    rotation). The job runs 1F1B, the schedule of the plans simulated here (summary.json
    does not record a plan's schedule; under ``--schedule auto`` the fault-free job
    chooses a zero-bubble list, 0.308 s a step where 1F1B's is simulated at 0.344 s)."""
    run = train(
        runs_dir / f"simv{dp}_{batch}_{rebalance}",
        *("--device", "emulated", "--dp", str(dp), "--pp", "2", "--steps", "16"),
        *("--schedule", "1f1b"),
        *("--global-batch", str(batch), "--micro-batch", str(micro_batch)),
        *("--fault", "kill:1@8:backward", "--rebalance", rebalance),
    )
    times = run.summary.step_time_s
    cfg = JobConfig()
    before = initial_plan(
        num_layers=cfg.model.num_layers, dp=dp, pp=2, global_batch=batch, micro_batch=micro_batch
    )
    (rec,) = run.summary.recoveries
    after = _plan(rec.plan, batch)
    assert after.stages[0].rotate == (block > 0)
    assert after.stages[0].block == max(block, 1)
    return [
        (plan, measured, plan_step_time(plan, cfg.layer_costs, cfg.cost_device).step_s)
        for plan, measured in (
            (before, statistics.median(times[2:8])),  # past the first steps' warm-up
            (after, statistics.median(times[rec.step + 1 :])),
        )
    ]


LAYOUTS = [
    (2, 16, 2, "resize", 0),  # 4 samples over 1 survivor
    # 3 over 2 survivors: shares 2 + 1, then 1 + 2. Six processes: on a slower 2-core
    # host (2026-11-26) the emulation could not keep the step before the loss (0.29-0.31 s
    # measured against 0.19 s modelled, quiet host, also at fa70cf4), so the ratio came
    # out 0.89-1.06 against 1.27: the host's, not the model's; scripts/test_long runs it.
    pytest.param(3, 12, 1, "resize", 1, marks=pytest.mark.long),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("dp", "batch", "micro_batch", "rebalance", "block"), LAYOUTS)
def test_a_fail_stop_changes_the_emulated_step_as_simulated(
    runs_dir, dp, batch, micro_batch, rebalance, block
):
    """The step after the recovery over the step before it, measured and simulated,
    within 10%. A ratio, because the emulated device keeps its time only as well as the
    host schedules its waits: with two busy loops beside it, a dp 3 run stepped 0.234 s
    against 0.191 s simulated (no emulation overrun: every compute block finished
    within its modelled time; the waits woke late), while the ratio after/before held
    (1.190 measured, 1.267 simulated). Absolute times: the ``long`` test below."""
    (_, mb, pb), (_, ma, pa) = _measure(runs_dir, dp, batch, micro_batch, rebalance, block)
    assert abs((pa / pb) / (ma / mb) - 1) < 0.10, (
        f"after/before: simulated {pa / pb:.3f}, ran {ma / mb:.3f} ({mb:.3f} -> {ma:.3f} s)"
    )


@pytest.mark.long
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("dp", "batch", "micro_batch", "rebalance", "block"), LAYOUTS)
def test_simulated_step_times_match_an_emulated_run_within_10_percent(
    runs_dir, dp, batch, micro_batch, rebalance, block
):
    """Absolute step times, on a host the test has to itself (``scripts/test_long``)."""
    for _, measured, predicted in _measure(runs_dir, dp, batch, micro_batch, rebalance, block):
        assert abs(predicted / measured - 1) < 0.10, (
            f"simulated {predicted:.3f} s, ran {measured:.3f} s"
        )


@pytest.mark.long
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("dp", "pp", "batch", "micro_batch"), [(2, 2, 16, 2), (1, 4, 16, 2)])
def test_the_schedule_the_planner_chooses_runs_in_the_time_it_predicts(
    runs_dir, dp, pp, batch, micro_batch
):
    """Under ``--schedule auto`` the planner picks the fault-free job's schedule by its
    simulated step (a zero-bubble list on these layouts): the emulated job steps within
    10% of that prediction (summary.json's ``predicted_step_s``, the initial plan's), on a
    host the test has to itself."""
    run = train(
        runs_dir / f"simauto{dp}x{pp}",
        *("--device", "emulated", "--dp", str(dp), "--pp", str(pp), "--steps", "12"),
        *("--global-batch", str(batch), "--micro-batch", str(micro_batch)),
    )
    predicted = run.summary.predicted_step_s
    measured = statistics.median(run.summary.step_time_s[2:])
    assert predicted is not None
    assert abs(predicted / measured - 1) < 0.10, (
        f"simulated {predicted:.3f} s, ran {measured:.3f} s"
    )
