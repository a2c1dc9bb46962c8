"""Pipeline schedules as data: every list the planners make is one the runtime can run
(checked), ZB-H1 has 1F1B's activation bound and a smaller simulated bubble, bad lists
are refused by name, and plans carry their schedule."""

import dataclasses
import re

import pytest

from elaswave.engine.cost import device, stage_memory
from elaswave.engine.dataflow import resize_after_failure
from elaswave.engine.plan import Plan, initial_plan, plan_from_dict, plan_to_dict
from elaswave.engine.rebalance import Policy, rebalance
from elaswave.engine.recovery import Rebalancing, fits, next_plan, plan_digest, with_schedule
from elaswave.engine.schedule import (
    Op,
    OpCosts,
    Schedule,
    check,
    equal_costs,
    finish_times,
    max_held,
    max_in_flight,
    one_f_one_b,
    span,
    stage_actions,
    zb_h1,
    zero_bubble,
)
from elaswave.engine.steptime import (
    StageTimes,
    held_limits,
    plan_lists,
    plan_step_time,
    simulate_step,
)
from elaswave.model.config import PRESETS
from elaswave.runtime.job.config import JobConfig
from elaswave.runtime.job.inputs import rebalancing_of
from elaswave.runtime.job.sections import InjectionConfig, LayoutConfig, ScheduleConfig
from elaswave.sim.policies import SimJob


@pytest.mark.parametrize("schedule", [s for s in Schedule if not s.priced])
def test_every_list_is_valid_and_within_the_activation_bound(schedule: Schedule) -> None:
    """The lists of the schedules that depend on the pipeline's shape only (zb-cost's
    are planned for a plan: checked below, and refused here)."""
    with pytest.raises(ValueError, match="plan_lists"):
        stage_actions(Schedule.ZB_COST, num_stages=2, stage=0, num_micro_batches=2)
    for p in range(1, 7):
        for m in range(1, 13):
            for s in range(p):
                acts = stage_actions(schedule, num_stages=p, stage=s, num_micro_batches=m)
                check(acts, num_stages=p, stage=s, num_micro_batches=m)
                assert max_in_flight(acts) <= min(p - s, m)


def _text(actions: list[tuple[Op, int]]) -> str:
    return " ".join(f"{op}{mb}" for op, mb in actions)


def test_zb_h1_defers_each_stages_weight_halves_by_its_index() -> None:
    """The paper's handcrafted ZB-H1 (torch's ScheduleInterleavedZeroBubble builds the
    same lists at one stage per rank: these are its lists for 2 and 4 stages)."""
    lists = [_text(zb_h1(num_stages=2, stage=s, num_micro_batches=4)) for s in range(2)]
    assert lists == [
        "F0 F1 I0 W0 F2 I1 W1 F3 I2 W2 I3 W3",
        "F0 I0 F1 I1 W0 F2 I2 W1 F3 I3 W2 W3",
    ]
    last = _text(zb_h1(num_stages=4, stage=3, num_micro_batches=8))
    assert last == "F0 I0 F1 I1 F2 I2 F3 I3 W0 F4 I4 W1 F5 I5 W2 F6 I6 W3 F7 I7 W4 W5 W6 W7"
    first = _text(zb_h1(num_stages=4, stage=0, num_micro_batches=8))
    assert first.startswith("F0 F1 F2 F3 I0 W0 F4 I1 W1")


@pytest.mark.parametrize("p", range(1, 9))
def test_zb_h1_reaches_the_zero_bubble_step_within_1f1b_peak_memory(p: int) -> None:
    """At equal costs (the first stage's backward all weight half) ZB-H1's step is
    3M + P - 1 units, a bubble of (P - 1)/3M, for every M >= P; below, never longer
    than the list scheduler's; no stage holds more than P micro-batches (1F1B's peak,
    on its first stage), and each stage keeps 1F1B's activation bound."""
    costs = equal_costs(p)
    for m in range(1, 25):
        lists = [zb_h1(num_stages=p, stage=s, num_micro_batches=m) for s in range(p)]
        for s, acts in enumerate(lists):
            check(acts, num_stages=p, stage=s, num_micro_batches=m)
            assert max_held(acts) <= min(p, m)
        planned = zero_bubble(num_micro_batches=m, costs=costs)
        assert span(lists, costs) <= span(planned, costs)
        if m >= p:
            assert span(lists, costs) == 3 * m + p - 1
            assert span(planned, costs) >= 3 * m + p - 1 + (p > 1 and m > 1)


def test_span_times_lists_by_their_dependencies() -> None:
    """Two stages, two micro-batches, 1F1B, by hand: stage 0 (F 1, backward 2, all of it
    the weight half; activations take 0.3 to send), stage 1 (F 1.5, backward 2.5;
    gradients take 0.4). Stage 1: F0 1.3-2.8, B0 -5.3, F1 -6.8, B1 -9.3; stage 0: F0 0-1,
    F1 -2, B0 5.7-7.7, B1 9.7-11.7. steptime's simulation is these times plus the DP
    collectives."""
    costs = [OpCosts(1.0, 0.0, 2.0, send_fwd_s=0.3), OpCosts(1.5, 1.25, 1.25, send_bwd_s=0.4)]
    lists = [one_f_one_b(num_stages=2, stage=s, num_micro_batches=2) for s in range(2)]
    assert finish_times(lists, costs) == pytest.approx([11.7, 9.3])
    assert span(lists, costs) == pytest.approx(11.7)
    stages = [StageTimes(1.0, 2.0, 0.3, 0.0, sync_s=0.5), StageTimes(1.5, 2.5, 0.0, 0.4, 0.1)]
    sim = simulate_step(stages, 2, Schedule.ONE_F_ONE_B)
    assert sim.compute_end_s == pytest.approx((11.7, 9.3)) and sim.step_s == pytest.approx(12.2)
    with pytest.raises(ValueError, match="wait on each other"):
        span(
            [[(Op.FORWARD, 0), (Op.INPUT, 0), (Op.WEIGHT, 0)], [(Op.INPUT, 0), (Op.FORWARD, 0)]],
            equal_costs(2),
        )
    with pytest.raises(ValueError, match="0 stages"):
        simulate_step([], 4)


@pytest.mark.parametrize(("p", "m"), [(2, 8), (4, 8), (4, 16), (6, 12)])
def test_zb_h1_predicted_step_is_shorter_than_1f1b(p: int, m: int) -> None:
    stages = [StageTimes(1.0, 2.0, 0.0, 0.0, 0.0)] * p
    one = simulate_step(stages, m, Schedule.ONE_F_ONE_B)
    zb = simulate_step(stages, m, Schedule.ZB_H1)
    assert one.step_s == pytest.approx(3 * (m + p - 1))  # 1F1B: (p - 1) bubbles of F + B
    assert zb.step_s < one.step_s
    if (p, m) == (4, 8):
        assert one.step_s / zb.step_s >= 1.15


def test_uneven_stage_costs_plan_a_valid_list() -> None:
    """A stage carrying half a share more after a loss (its neighbours wait for it): the
    planner's lists stay valid and in the activation bound."""
    costs = [OpCosts(), OpCosts(1.5, 1.5, 1.5), OpCosts(), OpCosts()]
    lists = zero_bubble(num_micro_batches=8, costs=costs)
    for s, acts in enumerate(lists):
        check(acts, num_stages=4, stage=s, num_micro_batches=8)


@pytest.mark.parametrize(
    ("actions", "why"),
    [
        ([("F", 0), ("W", 0), ("I", 0)], "it must come after FI"),
        ([("F", 0), ("F", 0), ("B", 0)], "it must come after nothing"),
        ([("F", 0), ("B", 0), ("F", 1)], "micro-batches [1] are not forwarded and backwarded"),
        ([("F", 0), ("F", 1), ("B", 0), ("B", 1)], "2 micro-batches in flight on stage 1"),
        ([("F", 0), ("X", 0)], "unknown operation 'X' (F, B, I or W)"),
        ([("F", 0), ("B", 2)], "micro-batch out of 0..1"),
    ],
)
def test_a_bad_list_is_refused_naming_why(actions, why: str) -> None:
    with pytest.raises(ValueError, match=re.escape(why)):
        check(actions, num_stages=2, stage=1, num_micro_batches=2)


def test_one_f_one_b_is_unchanged() -> None:
    assert one_f_one_b(num_stages=2, stage=0, num_micro_batches=3) == [
        (Op.FORWARD, 0), (Op.FORWARD, 1), (Op.BACKWARD, 0), (Op.FORWARD, 2),
        (Op.BACKWARD, 1), (Op.BACKWARD, 2),
    ]  # fmt: skip


def test_plans_carry_their_schedule_and_1f1b_plans_keep_their_documents() -> None:
    plan = initial_plan(num_layers=6, dp=2, pp=2, global_batch=8, micro_batch=1)
    doc = plan_to_dict(plan)
    assert "schedule" not in doc  # plans before schedules: same document, same digest
    zb = dataclasses.replace(plan, schedule=Schedule.ZB_H1)
    assert plan_to_dict(zb)["schedule"] == "zb-h1"
    assert plan_from_dict(plan_to_dict(zb)) == zb and plan_from_dict(doc) == plan
    assert plan_digest(zb) != plan_digest(plan)
    with pytest.raises(
        ValueError, match=re.escape("schedule 'zb-h9' (known: 1f1b, zb-h1, zb-cost)")
    ):
        plan_from_dict({**doc, "schedule": "zb-h9"})


def test_a_fault_in_the_weight_half_needs_a_split_schedule() -> None:
    def job(schedule: str) -> JobConfig:
        return JobConfig(
            layout=LayoutConfig(dp=1, pp=2),
            schedule=ScheduleConfig(
                steps=4, global_batch=4, micro_batch=1, pipeline_schedule=schedule
            ),
            injection=InjectionConfig(faults=("kill:1@2:weight",)),
        )

    with pytest.raises(ValueError, match=r"phase weight is the weight-gradient half .*zb-h1"):
        job("1f1b")
    assert job("zb-h1").plan().schedule is Schedule.ZB_H1
    valid = "pipeline_schedule = 'zb': valid values are auto, 1f1b, zb-h1"
    with pytest.raises(ValueError, match=re.escape(valid)):
        job("zb")


def test_auto_takes_the_schedule_simulated_faster_initially_and_at_a_change() -> None:
    """``--schedule auto``: the initial plan of a pipeline takes zb-cost, which simulates
    faster than ZB-H1 (more ``W`` pending where memory holds them); a job of one stage
    keeps 1F1B (a tie: nothing to hide in bubbles); the plan after a loss is chosen
    again, and workers and replay choose the same (the choice is a pure function of the
    plan and the job's cost model)."""

    def job(pp: int, setting: str = "auto") -> JobConfig:
        return JobConfig(
            layout=LayoutConfig(dp=2, pp=pp, device="emulated"),
            schedule=ScheduleConfig(global_batch=16, micro_batch=1, pipeline_schedule=setting),
        )

    first = job(4).plan()
    assert first.schedule is Schedule.ZB_COST
    cfg4 = job(4)
    zb = dataclasses.replace(first, schedule=Schedule.ZB_H1)
    assert (
        plan_step_time(first, cfg4.layer_costs, cfg4.cost_device).step_s
        < plan_step_time(zb, cfg4.layer_costs, cfg4.cost_device).step_s
    )
    assert job(4, "zb-h1").plan().schedule is Schedule.ZB_H1
    assert job(1).plan().schedule is Schedule.ONE_F_ONE_B
    assert job(4, "1f1b").plan().schedule is Schedule.ONE_F_ONE_B
    cfg = job(4)
    choosing = rebalancing_of(cfg, {})
    assert choosing.schedules == tuple(Schedule)
    start = dataclasses.replace(cfg.plan(), schedule=Schedule.ONE_F_ONE_B)
    after, reason = next_plan(start, [1], choosing)
    assert after.schedule is Schedule.ZB_COST and "schedule zb-cost (simulated faster)" in reason
    assert next_plan(start, [1], choosing) == (after, reason)
    fixed = dataclasses.replace(choosing, schedules=(Schedule.ONE_F_ONE_B,))
    assert next_plan(start, [1], fixed)[0].schedule is Schedule.ONE_F_ONE_B


def test_auto_keeps_1f1b_where_the_deferred_weight_halves_do_not_fit() -> None:
    """ZB-H1 holds each micro-batch until its weight half: on a device whose memory holds
    only 1F1B's activations, auto never takes ZB-H1 although it simulates faster (it
    keeps 1F1B, or zb-cost, whose lists hold no more than memory does)."""
    cfg = JobConfig(
        layout=LayoutConfig(dp=1, pp=4, device="emulated"),
        schedule=ScheduleConfig(global_batch=16, micro_batch=2, pipeline_schedule="auto"),
    )
    plan, layers, dev = cfg.plan(), cfg.layer_costs, cfg.cost_device
    assert plan.schedule is Schedule.ZB_COST and fits(plan, layers, dev)
    plan = dataclasses.replace(plan, schedule=Schedule.ZB_H1)
    assert fits(plan, layers, dev)
    one = dataclasses.replace(plan, schedule=Schedule.ONE_F_ONE_B)
    need = max(
        stage_memory(
            [layers[i] for i in st.layers], micro_batch=st.load, dp=st.dp, stage=st.stage,
            num_stages=plan.pp,
        )
        for st in one.stages
    )  # fmt: skip
    small = dataclasses.replace(dev, memory_bytes=int(need) + 1)
    assert fits(one, layers, small) and not fits(plan, layers, small)
    choosing = Rebalancing(layers=layers, device=small, schedules=tuple(Schedule))
    chosen = with_schedule(one, choosing)
    assert chosen.schedule is not Schedule.ZB_H1 and fits(chosen, layers, small)
    only = dataclasses.replace(choosing, schedules=(Schedule.ONE_F_ONE_B, Schedule.ZB_H1))
    assert with_schedule(one, only).schedule is Schedule.ONE_F_ONE_B


def test_zb_cost_lists_are_valid_fit_memory_and_never_simulate_slower_than_zb_h1() -> None:
    """zb-cost searches zero-bubble lists for the plan at hand (the survivors of a loss
    carry larger, rotating shares): every list runs (in flight within what memory
    holds), fits, is the same on a second call, and its step is at most ZB-H1's."""
    cfg = JobConfig(
        layout=LayoutConfig(dp=3, pp=4, device="emulated"),
        schedule=ScheduleConfig(global_batch=24, micro_batch=1, pipeline_schedule="auto"),
    )
    layers, dev = cfg.layer_costs, cfg.cost_device
    start = dataclasses.replace(cfg.plan(), schedule=Schedule.ZB_H1)
    for failed in ([0], [3], [0, 3, 6]):
        after, _ = next_plan(start, failed, rebalancing_of(cfg, {}))
        zc = dataclasses.replace(after, schedule=Schedule.ZB_COST)
        lists = plan_lists(zc, layers, dev)
        assert lists == plan_lists(zc, layers, dev)
        held = held_limits(zc, layers, dev)
        for s, acts in enumerate(lists):
            check(acts, num_stages=4, stage=s, num_micro_batches=zc.num_micro_batches,
                  in_flight=held[s])  # fmt: skip
            assert max_held(acts) <= held[s]
        assert fits(zc, layers, dev)
        zb = dataclasses.replace(after, schedule=Schedule.ZB_H1)
        assert plan_step_time(zc, layers, dev).step_s <= plan_step_time(zb, layers, dev).step_s
    with pytest.raises(ValueError, match="needs the cost model's layers and device"):
        plan_lists(zc)


def test_a_change_plans_layers_and_clocks_under_each_schedule_it_may_take() -> None:
    """Llama2-7B on 24 H100s (tp1 pp4 dp6) losing a rank in each of stages 0-2, with
    layer migration and DVFS: the layers and clocks that step fastest under 1F1B (what
    a rebalancing under the running plan's 1F1B picks) are not those under zb-cost. The
    planner rebalances under every schedule the job may take and keeps the fastest:
    faster than rebalancing under the running schedule and then choosing the schedule
    (0.925 of the fault-free job against 0.952, simulated), never slower than any one
    schedule's own rebalancing."""
    job = SimJob(PRESETS["llama2-7b"], device("h100"), tp=1, pp=4, dp=6, micro_batch=1,
                 global_batch=384, schedules=tuple(Schedule))  # fmt: skip
    choosing = Rebalancing(
        policy=Policy.MIGRATE_DVFS, layers=job.layers, device=job.device,
        power_budget=job.power_budget, schedules=job.schedules,
    )  # fmt: skip
    start, failed = job.plan(), [0, 6, 12]
    assert start.schedule is Schedule.ONE_F_ONE_B

    def step(plan: Plan) -> float:
        return plan_step_time(plan, job.layers, job.device).step_s

    after, reason = next_plan(start, failed, choosing)
    assert "layers and clocks planned under zb-cost" in reason
    resized, _ = resize_after_failure(start, failed)
    kw = {"layers": job.layers, "device": job.device, "policy": Policy.MIGRATE_DVFS,
          "power_budget": job.power_budget}  # fmt: skip
    under_running = with_schedule(rebalance(resized, **kw).plan, choosing)
    assert step(after) < step(under_running) / 1.02
    for schedule in Schedule:
        alone = rebalance(dataclasses.replace(resized, schedule=schedule), **kw).plan
        assert step(after) <= step(alone) * (1 + 1e-9)
