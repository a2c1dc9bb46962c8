"""What a plan change carries so that every process decides the same: the planner inputs
of a :class:`~elaswave.bus.schema.RecoveryPlan`, encoded and decoded here only.

A plan is never shipped, only its inputs. The Core encodes them (:func:`rebalancing_fields`
and :func:`decide_migration`); every worker decodes them (:func:`announced_rebalancing`,
:func:`announced_migration`) and runs the same pure planner before it acknowledges; replay
decodes them from the event log and checks the Core's announcement.

The inputs a RecoveryPlan carries: the failed and joining ranks, the throughput policy
and the measured slowdowns, the survivors whose parameters are newer than the committed
step (``stale``), and how layers migrate (``migration``), decided once by the Core from
the job's ``--migration`` and the plans (:func:`decide_migration`). The survivors'
committed steps come with their RecoveryReady.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from elaswave.bus.schema import RecoveryPlan
from elaswave.engine.migration import layer_moves, plan_transition, why_blocking
from elaswave.engine.plan import Plan
from elaswave.engine.rebalance import Policy
from elaswave.engine.recovery import Rebalancing
from elaswave.runtime.config import JobConfig

NONE, BLOCKING, NONBLOCKING = "none", "blocking", "nonblocking"
"""How a change moves layers: no layer moves; parameters gathered before resuming;
streamed during the transition step (see :mod:`elaswave.engine.migration`)."""


def rebalancing_of(cfg: JobConfig, slowdowns: dict[int, float]) -> Rebalancing:
    """The throughput planner's inputs: the job's policy and the measured slowdowns."""
    return Rebalancing(
        policy=Policy(cfg.train.rebalance),
        slowdowns=dict(slowdowns),
        layers=cfg.layer_costs,
        device=cfg.cost_device,
        power_budget=cfg.power_budget,
    )


def rebalancing_fields(cfg: JobConfig, slowdowns: dict[int, float]) -> dict[str, Any]:
    """The RecoveryPlan fields that carry :func:`rebalancing_of`'s inputs."""
    ranks = sorted(slowdowns)
    return {
        "policy": cfg.train.rebalance,
        "slow_ranks": ranks,
        "slow_factors": [slowdowns[r] for r in ranks],
    }


def announced_rebalancing(cfg: JobConfig, decision: RecoveryPlan) -> Rebalancing:
    """The throughput planner's inputs as the Core announced them in ``decision``."""
    return Rebalancing(
        policy=Policy(decision.policy),
        slowdowns=dict(zip(decision.slow_ranks, decision.slow_factors, strict=True)),
        layers=cfg.layer_costs,
        device=cfg.cost_device,
        power_budget=cfg.power_budget,
    )


def decide_migration(
    cfg: JobConfig, old: Plan, new: Plan, stale: Sequence[int], joined: Sequence[int]
) -> dict[str, Any]:
    """How the change from ``old`` to ``new`` moves layers, as summary.json records it:
    ``mode`` (:data:`NONE`, :data:`BLOCKING` or :data:`NONBLOCKING`), the ``layers``
    that move, and why they move blocking or how many micro-batches keep the old
    placement. The Core decides it once and announces the mode; workers follow it."""
    moves = layer_moves(old, new)
    if not moves:
        return {"mode": NONE, "layers": []}
    layers = [m.layer for m in moves]
    why = why_blocking(
        cfg.train.migration, old, new, stale=stale, joined=joined, layers=cfg.layer_costs
    )
    if why is not None:
        return {"mode": BLOCKING, "layers": layers, "why": why}
    transition = plan_transition(
        old, new, layers=cfg.layer_costs, device=cfg.cost_device, early=cfg.train.migration_early
    )
    assert transition is not None  # why_blocking found nothing against it
    return {"mode": NONBLOCKING, "layers": layers, "early_micro_batches": transition.early}


def announced_migration(decision: RecoveryPlan) -> str:
    """The migration mode ``decision`` carries; ValueError for one no Core announces."""
    if decision.migration not in (NONE, BLOCKING, NONBLOCKING):
        raise ValueError(
            f"the plan of generation {decision.generation} announces migration "
            f"{decision.migration!r}; valid: {NONE}, {BLOCKING}, {NONBLOCKING}"
        )
    return decision.migration
