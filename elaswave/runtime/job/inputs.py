"""What a plan change carries that needs the job's configuration: the cost model
(layers, device, power budget) the planners price, and the job's migration settings.

The planner inputs a :class:`~elaswave.bus.schema.RecoveryPlan` announces are encoded and
decoded by one pure codec, :mod:`elaswave.engine.plan_inputs`: the Core plans from the
inputs it announces; every worker decodes them and runs the same pure planner before it
acknowledges (:func:`announced_rebalancing` adds the job's cost model); replay decodes
them from the event log and checks the Core's announcement, migration mode included
(:func:`decide_migration` with the job's ``--migration``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from elaswave.engine import migration
from elaswave.engine.migration import MigrationDecision
from elaswave.engine.plan import Plan
from elaswave.engine.plan_inputs import PlanInputs, rebalancing
from elaswave.engine.rebalance import Policy
from elaswave.engine.recovery import Rebalancing
from elaswave.engine.rules import Rules
from elaswave.runtime.job.config import JobConfig
from elaswave.runtime.job.faults import FaultKind, validate_faults


def rebalancing_of(cfg: JobConfig, slowdowns: dict[int, float]) -> Rebalancing:
    """The throughput planner's inputs: the job's policy and the measured slowdowns."""
    return Rebalancing(
        policy=Policy(cfg.train.rebalance),
        slowdowns=dict(slowdowns),
        layers=cfg.layer_costs,
        device=cfg.cost_device,
        power_budget=cfg.power_budget,
        shorten=cfg.train.shortens,
    )


def announced_rebalancing(cfg: JobConfig, inputs: PlanInputs) -> Rebalancing:
    """The throughput planner's inputs as the Core announced them (``inputs``, decoded
    by :func:`elaswave.engine.plan_inputs.decode`), with the job's cost model."""
    return rebalancing(inputs, rebalancing_of(cfg, {}))


def decide_migration(
    cfg: JobConfig, old: Plan, new: Plan, stale: Sequence[int], joined: Sequence[int]
) -> MigrationDecision:
    """:func:`elaswave.engine.migration.decide_migration` with the job's settings."""
    return migration.decide_migration(
        cfg.train.migration,
        old,
        new,
        stale=stale,
        joined=joined,
        layers=cfg.layer_costs,
        device=cfg.cost_device,
        early=cfg.train.migration_early,
    )


def rules_of(cfg: JobConfig, run_dir: Path, *, can_spawn: bool) -> Rules:
    """The change protocol's rules for the job ``cfg`` running in ``run_dir``."""
    t = cfg.train
    faults = validate_faults(
        t.faults, world_size=t.num_ranks, ranks_per_node=t.ranks_per_node, steps=t.steps
    )
    resume = (
        f"resume from its latest checkpoint with --resume {run_dir}"
        if t.checkpoint_every
        else "it wrote no checkpoint (train with --checkpoint-every K to be able to resume)"
    )
    return Rules(
        steps=t.steps,
        recovery=t.recovery,
        ranks_per_node=t.units_per_node,
        snapshots=t.snapshots,
        rebalancing=rebalancing_of(cfg, {}),
        migration=t.migration,
        migration_early=t.migration_early,
        stop_timeout_s=max(30.0, t.comm_timeout_s),
        ack_timeout_s=t.plan_ack_timeout_s,
        join_steps=tuple(sorted(f.step for f in faults if f.kind is FaultKind.JOIN)),
        can_spawn=can_spawn,
        resume_hint=resume,
        first_step=t.resume_step if t.resume_step is not None else -1,
        wait_for_nodes_s=t.wait_for_nodes_s,
        resume_command=f"--resume {run_dir}",
    )
