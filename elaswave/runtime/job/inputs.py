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
        policy=Policy(cfg.elastic.rebalance),
        slowdowns=dict(slowdowns),
        layers=cfg.layer_costs,
        device=cfg.cost_device,
        power_budget=cfg.power_budget,
        shorten=cfg.elastic.shortens,
        schedules=cfg.schedule.pipeline_schedule.choices,
        stages=cfg.layout.pp,
        samples=cfg.layout.dp * cfg.schedule.micro_batch,
        reform=cfg.elastic.reform,
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
        cfg.elastic.migration,
        old,
        new,
        stale=stale,
        joined=joined,
        layers=cfg.layer_costs,
        device=cfg.cost_device,
        early=cfg.elastic.migration_early,
    )


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
        snapshot_copies=cfg.state.snapshot_copies,
        restore=cfg.restores_in_job,
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
        restarts=cfg.elastic.max_restarts > 0,
        shorten_after_wait=cfg.elastic.shorten_after_wait,
        resume_command=f"--resume {run_dir}",
    )
