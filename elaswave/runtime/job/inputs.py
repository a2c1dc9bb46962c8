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
from pathlib import Path
from typing import Any

from elaswave.bus.schema import RecoveryPlan
from elaswave.engine import migration
from elaswave.engine.change import Rules
from elaswave.engine.migration import BLOCKING, NONBLOCKING, NONE
from elaswave.engine.plan import Plan
from elaswave.engine.rebalance import Policy
from elaswave.engine.recovery import Rebalancing
from elaswave.runtime.job.config import JobConfig
from elaswave.runtime.job.faults import FaultKind, validate_faults


def rebalancing_of(cfg: JobConfig, slowdowns: dict[int, float]) -> Rebalancing:
    """The throughput planner's inputs: the job's policy and the measured slowdowns."""
    return Rebalancing(
        policy=Policy(cfg.elastic.rebalance),
        slowdowns=dict(slowdowns),
        layers=cfg.layer_costs,
        device=cfg.cost_device,
        power_budget=cfg.power_budget,
        shorten=cfg.elastic.shortens,
    )


def rebalancing_fields(cfg: JobConfig, slowdowns: dict[int, float]) -> dict[str, Any]:
    """The RecoveryPlan fields that carry :func:`rebalancing_of`'s inputs."""
    ranks = sorted(slowdowns)
    return {
        "policy": cfg.elastic.rebalance,
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
        shorten=cfg.elastic.shortens,
        power_budget=cfg.power_budget,
    )


def decide_migration(
    cfg: JobConfig, old: Plan, new: Plan, stale: Sequence[int], joined: Sequence[int]
) -> dict[str, Any]:
    """:func:`elaswave.engine.migration.decide_migration` with the job's settings."""
    return migration.decide_migration(
        cfg.elastic.migration,
        old,
        new,
        stale=stale,
        joined=joined,
        layers=cfg.layer_costs,
        device=cfg.cost_device,
        early=cfg.elastic.migration_early,
    )


def announced_migration(decision: RecoveryPlan) -> str:
    """The migration mode ``decision`` carries; ValueError for one no Core announces."""
    if decision.migration not in (NONE, BLOCKING, NONBLOCKING):
        raise ValueError(
            f"the plan of generation {decision.generation} announces migration "
            f"{decision.migration!r}; valid: {NONE}, {BLOCKING}, {NONBLOCKING}"
        )
    return decision.migration


def rules_of(cfg: JobConfig, run_dir: Path, *, can_spawn: bool) -> Rules:
    """The change protocol's rules for the job ``cfg`` running in ``run_dir``."""
    faults = validate_faults(
        cfg.injection.faults,
        world_size=cfg.layout.num_ranks,
        ranks_per_node=cfg.layout.ranks_per_node,
        steps=cfg.schedule.steps,
    )
    resume = (
        f"resume from its latest checkpoint with --resume {run_dir}"
        if cfg.state.checkpoint_every
        else "it wrote no checkpoint (train with --checkpoint-every K to be able to resume)"
    )
    return Rules(
        steps=cfg.schedule.steps,
        recovery=cfg.elastic.recovery,
        ranks_per_node=cfg.layout.units_per_node,
        snapshots=cfg.state.snapshots,
        rebalancing=rebalancing_of(cfg, {}),
        migration=cfg.elastic.migration,
        migration_early=cfg.elastic.migration_early,
        stop_timeout_s=max(30.0, cfg.liveness.comm_timeout_s),
        ack_timeout_s=cfg.liveness.plan_ack_timeout_s,
        join_steps=tuple(sorted(f.step for f in faults if f.kind is FaultKind.JOIN)),
        can_spawn=can_spawn,
        resume_hint=resume,
        first_step=cfg.state.resume_step if cfg.state.resume_step is not None else -1,
        wait_for_nodes_s=cfg.elastic.wait_for_nodes_s,
        resume_command=f"--resume {run_dir}",
    )
