"""Where joining ranks go (pure): the stage whose taking a joiner gives the shortest
simulated step, never one where it would idle while a narrower stage exists."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from elaswave.engine.cost import DeviceSpec, LayerCost
from elaswave.engine.dataflow import add_ranks
from elaswave.engine.plan import Plan
from elaswave.engine.rebalance import Policy, rebalance
from elaswave.engine.steptime import plan_step_time


def place_joiners(
    plan: Plan,
    joined: Sequence[int],
    *,
    layers: Sequence[LayerCost] | None = None,
    device: DeviceSpec | None = None,
    policy: Policy | str = Policy.RESIZE,
    slowdowns: Mapping[int, float] | None = None,
) -> dict[int, int]:
    """The stage each joining rank goes to, one rank at a time.

    With a cost model: the stage whose taking it (and the rebalancing ``policy`` then
    allows) gives the shortest simulated step (:func:`~elaswave.engine.steptime.
    plan_step_time`, the step model the planner prices rotations with). A stage where
    the joiner would take no samples is a candidate only when no stage is narrower (a
    ninth replica of an eight-sample micro-batch idles, while a stage that lost ranks
    stays the bottleneck). Steps within :data:`_TIE` of the shortest tie; a tie goes to
    the narrowest stage, then the slowest stage before the join, then the lower stage.
    Without a cost model: the narrowest stage, ties to the lower stage."""
    placement: dict[int, int] = {}
    current = plan
    slow = dict(slowdowns or {})
    for rank in joined:
        if layers and device is not None:
            stage = _best_stage(current, rank, layers, device, Policy(policy), slow)
        else:
            stage = min(range(current.pp), key=lambda p: (current.stages[p].dp, p))
        placement[rank] = stage
        current, _ = add_ranks(current, {rank: stage})
    return placement


_TIE = 1e-6
"""Relative difference under which two simulated steps are the same."""


def _best_stage(
    plan: Plan,
    rank: int,
    layers: Sequence[LayerCost],
    device: DeviceSpec,
    policy: Policy,
    slowdowns: Mapping[int, float],
) -> int:
    """The stage :func:`place_joiners` puts ``rank`` on (see there)."""
    known = {r: f for r, f in slowdowns.items() if r in plan.ranks}
    before = rebalance(
        plan, layers=layers, device=device, policy=Policy.NONE, slowdowns=known
    ).ministep_before_s
    narrowest = min(s.dp for s in plan.stages)
    priced: dict[int, float] = {}
    for p in range(plan.pp):
        trial, _ = add_ranks(plan, {rank: p})
        if policy is not Policy.NONE:
            trial = rebalance(
                trial, layers=layers, device=device, policy=policy, slowdowns=slowdowns
            ).plan
        idle = not any(trial.stages[p].shares(ph)[trial.stages[p].ranks.index(rank)]
                       for ph in range(trial.stages[p].period))  # fmt: skip
        if idle and plan.stages[p].dp > narrowest:
            continue
        priced[p] = plan_step_time(trial, layers, device, slowdowns=slowdowns).step_s
    best = min(priced.values())
    tied = [p for p, t in priced.items() if t <= best * (1 + _TIE)]
    return min(tied, key=lambda p: (plan.stages[p].dp, -before[p], p))
