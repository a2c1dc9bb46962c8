"""The next plan with every stage keeping its ranks (pure): micro-batch resizing over the
survivors, joiners placed where they help, then the throughput planner's rebalancing
under the job's policy (:mod:`elaswave.engine.rebalance`). A stage that loses every
rank raises Unrecoverable here; :mod:`elaswave.engine.replan` then lets ranks change
stage. :func:`plan_digest` names a plan: workers rerun the planner themselves and
compare digests with the Core's, so a plan is never shipped, only its inputs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from elaswave.engine.cost import DeviceSpec, LayerCost, stage_memory
from elaswave.engine.dataflow import add_ranks, resize_after_failure
from elaswave.engine.graph import Infeasible
from elaswave.engine.joiners import place_joiners
from elaswave.engine.plan import Plan, plan_to_dict
from elaswave.engine.rebalance import Policy, rebalance
from elaswave.engine.schedule import Schedule, max_held
from elaswave.engine.steptime import plan_lists, plan_step_time
from elaswave.fabric.errors import Unrecoverable


def plan_digest(plan: Plan) -> str:
    doc = json.dumps(plan_to_dict(plan), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


@dataclass(frozen=True, kw_only=True)
class Rebalancing:
    """What the throughput planner may change after the failures are absorbed."""

    policy: Policy = Policy.RESIZE
    slowdowns: Mapping[int, float] = dataclasses.field(default_factory=dict)
    """Per-rank compute slowdown factors the straggler detector measured (>= 1)."""
    layers: Sequence[LayerCost] = ()
    """The cost model's layers (needed unless the policy is resize or none)."""
    device: DeviceSpec | None = None
    """The device the cost model prices (needed unless the policy is resize or none)."""
    power_budget: float | None = None
    """What DVFS may draw, in ranks at the base clock (:func:`~elaswave.engine.rebalance.
    power`): the job's launch size, so that survivors spend what lost ranks freed. None:
    only each device's maximum clock limits DVFS."""
    shorten: bool = False
    """Whether fewer ranks than stages may run on a pipeline of fewer stages
    (:func:`elaswave.engine.replan.replan`); else the job waits for joiners, or stops."""
    schedules: tuple[Schedule, ...] = ()
    """The pipeline schedules the planner may choose from (:func:`with_schedule`); none:
    every plan keeps its schedule."""
    stages: int | None = None
    """The job's own number of stages: a pipeline that lost stages grows back towards it
    when joiners come and a longer pipeline prices lower (:func:`elaswave.engine.replan.
    replan`); None: a change adds no stage."""
    samples: int | None = None
    """The job's own samples per global micro-batch, which a re-formed pipeline goes back
    to where they fit (None: the plan's)."""
    reform: bool = False
    """Whether a change may re-form damaged replicas into a pipeline of fewer, full
    stages when that prices lower (:func:`elaswave.engine.reshape.reformed`)."""


def with_schedule(plan: Plan, rebalancing: Rebalancing | None) -> Plan:
    """``plan`` under the schedule of ``rebalancing.schedules`` whose simulated step
    (:func:`~elaswave.engine.steptime.plan_step_time`) is shortest, among those that
    :func:`fits` the device's memory (``plan``'s own always may); ties keep the earlier
    one in that order. ``plan`` itself without choices or a cost model."""
    if rebalancing is None or len(rebalancing.schedules) < 2 or rebalancing.device is None:
        return plan
    if not rebalancing.layers:
        return plan
    found = _fastest(plan, rebalancing, kept=plan.schedule)
    return plan if found is None else found[1]


def _fastest(plan: Plan, rebalancing: Rebalancing, *, kept: Schedule) -> tuple[float, Plan] | None:
    """(simulated step, plan) of ``plan`` under the fastest of ``rebalancing.schedules``
    that fits the device's memory or is ``kept`` (ties: the earlier); None when none is.
    ``rebalancing`` has the cost model's layers and device."""
    layers, device = rebalancing.layers, rebalancing.device
    assert device is not None
    slowdowns = {r: f for r, f in rebalancing.slowdowns.items() if r in plan.ranks}
    trials = [dataclasses.replace(plan, schedule=s) for s in rebalancing.schedules]
    timed = [
        (plan_step_time(trial, layers, device, slowdowns=slowdowns).step_s, index, trial)
        for index, trial in enumerate(trials)
        if trial.schedule is kept or fits(trial, layers, device)
    ]
    if not timed:
        return None
    step, _, best = min(timed, key=lambda t: (t[0], t[1]))
    return step, best


def fits(plan: Plan, layers: Sequence[LayerCost], device: DeviceSpec) -> bool:
    """Whether every stage of ``plan`` holds what its schedule keeps in flight (every
    micro-batch until its weight gradients, :func:`~elaswave.engine.schedule.max_held`)
    within ``device``'s memory."""
    return lists_fit(plan, plan_lists(plan, layers, device), layers, device)


def lists_fit(
    plan: Plan,
    lists: Sequence[Sequence[tuple[str, int]]],
    layers: Sequence[LayerCost],
    device: DeviceSpec,
) -> bool:
    """Whether every stage of ``plan`` running its list of ``lists`` holds what it keeps
    in flight within ``device``'s memory (see :func:`fits`)."""
    cost = {c.index: c for c in layers}
    for st in plan.stages:
        actions = lists[st.stage]
        need = stage_memory(
            [cost[i] for i in st.layers], micro_batch=st.load, dp=st.dp, stage=st.stage,
            num_stages=plan.pp, live=max_held(actions),
        )  # fmt: skip
        if need > device.memory_bytes:
            return False
    return True


def next_plan(
    plan: Plan,
    failed: Collection[int],
    rebalancing: Rebalancing | None = None,
    joined: Sequence[int] = (),
) -> tuple[Plan, str]:
    """The plan after ``failed`` leave (micro-batch resizing) and ``joined`` arrive (each
    to the slowest stage), rebalanced as asked.

    The result is one generation after ``plan`` whatever changed, or ``plan`` itself
    when nothing did.
    """
    resized, reason = resize_after_failure(plan, failed)
    if joined:
        model = rebalancing if rebalancing is not None and rebalancing.device is not None else None
        placement = place_joiners(
            resized,
            joined,
            layers=model.layers if model is not None else None,
            device=model.device if model is not None else None,
            policy=rebalancing.policy if rebalancing is not None else Policy.RESIZE,
            slowdowns=model.slowdowns if model is not None else None,
        )
        resized, why = add_ranks(resized, placement)
        reason = f"{reason}; {why}"
    policy = Policy.NONE if rebalancing is None else rebalancing.policy
    if policy in (Policy.MIGRATE, Policy.MIGRATE_DVFS) or (
        policy is Policy.RESIZE and rebalancing is not None and rebalancing.slowdowns
    ):
        assert rebalancing is not None
        chosen, why = _rebalanced(resized, rebalancing)
        reason = f"{reason}; {why}"
    else:
        chosen = with_schedule(resized, rebalancing)
        if chosen.schedule is not resized.schedule:
            reason = f"{reason}; schedule {chosen.schedule} (simulated faster)"
    if chosen == plan:
        return plan, reason
    return dataclasses.replace(chosen, generation=plan.generation + 1), reason


def _rebalanced(plan: Plan, rebalancing: Rebalancing) -> tuple[Plan, str]:
    """``plan`` rebalanced (layers, clocks, dataflow) and its schedule chosen, together:
    the rebalancing compares its candidates by their simulated step under one schedule,
    and the layers and clocks that step fastest under 1F1B are not those that do under a
    zero-bubble list (whose weight halves fill the bubbles a short-handed stage leaves).
    So each schedule the job may run gets its own rebalancing (``plan``'s own first),
    each result its fastest schedule (another than ``plan``'s only where it fits), and
    the shortest simulated step wins; ties keep the earlier."""
    device = _device(rebalancing)
    layers = rebalancing.layers
    choices = [plan.schedule]
    if len(rebalancing.schedules) > 1:
        choices += [s for s in rebalancing.schedules if s is not plan.schedule]
    options: list[tuple[float, Plan, str, Schedule]] = []
    for schedule in choices:
        try:
            decision = rebalance(
                dataclasses.replace(plan, schedule=schedule), layers=layers, device=device,
                policy=rebalancing.policy, slowdowns=rebalancing.slowdowns,
                power_budget=rebalancing.power_budget,
            )  # fmt: skip
        except Infeasible as exc:  # the survivors' memory cannot hold their layers
            if schedule is not plan.schedule:
                continue
            raise Unrecoverable(f"the surviving ranks run out of memory: {exc}") from None
        if len(choices) == 1:  # nothing to choose: the plan keeps its schedule
            return decision.plan, decision.reason
        found = _fastest(decision.plan, rebalancing, kept=plan.schedule)
        if found is None:  # no schedule of this rebalancing fits memory
            continue
        step, chosen = found
        why = decision.reason
        if chosen.schedule is not plan.schedule:
            why = f"{why}; schedule {chosen.schedule} (simulated faster)"
        options.append((step, chosen, why, schedule))
    best = min(range(len(options)), key=lambda i: (options[i][0], i))
    _, chosen, why, under = options[best]
    if best > 0:
        steps = ", ".join(f"{s} {t * 1e3:.1f} ms" for t, _, _, s in options)
        why = (
            f"{why}; layers and clocks planned under {under} (simulated steps of the plans "
            f"rebalanced under each schedule: {steps})"
        )
    return chosen, why


def _device(rebalancing: Rebalancing) -> DeviceSpec:
    if rebalancing.device is None or not rebalancing.layers:
        raise ValueError(f"policy {rebalancing.policy} needs the cost model's layers and device")
    return rebalancing.device
