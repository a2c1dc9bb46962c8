"""The planner inputs a plan change carries, encoded and decoded here only (pure).

A plan is never shipped, only its inputs: the Core announces them in a
:class:`~elaswave.bus.schema.RecoveryPlan` (:func:`announcement`), and every process that
must decide the same reads them back (:func:`decode`): each worker, which reruns the
pure planner and checks the announced digest before it acknowledges; replay, which
checks every plan of a run from its event log; and the Core itself, which plans from
the inputs it announces (:func:`rebalancing`).

The inputs: the failed and joining ranks, the throughput policy and the measured
slowdowns, the survivors whose parameters are newer than the committed step
(``stale``), and how layers migrate (``migration``, decided once by the Core). The
survivors' committed steps come with their RecoveryReady; the job's cost model (its
layers, device and power budget) is the job's configuration
(:mod:`elaswave.runtime.job.inputs`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from elaswave.bus.schema import CORE_SENDER, RecoveryKind, RecoveryPlan
from elaswave.engine.migration import MigrationMode
from elaswave.engine.rebalance import Policy
from elaswave.engine.recovery import Rebalancing


@dataclass(frozen=True, kw_only=True)
class PlanInputs:
    """What every process needs, besides the job's configuration and the survivors'
    reports, to compute a change's plan and to move its layers the same way."""

    failed: tuple[int, ...]
    joined: tuple[int, ...] = ()
    policy: Policy
    slowdowns: Mapping[int, float] = field(default_factory=dict)
    """The slowdowns measured on the plan's ranks (a slow rank that failed is none)."""
    stale: tuple[int, ...] = ()
    """Survivors whose parameters are not those of the committed step."""
    migration: MigrationMode = MigrationMode.NONE
    shorten: bool = False
    """A wait for joiners ran out: the pipeline may get fewer stages (a job that waits
    keeps its stages otherwise)."""


@dataclass(frozen=True, kw_only=True)
class PlanOutcome:
    """What the Core decided from the inputs, announced with them."""

    generation: int
    attempt: int
    kind: RecoveryKind
    committed_step: int
    plan_digest: str
    reason: str
    rebuild: tuple[str, ...] = ()
    """Surviving groups to rebuild (tainted on some member)."""
    restore: bool = False
    """Every participant loads the disk checkpoint of ``committed_step``."""
    rollback: bool = False
    """The change rolls back a torn apply (``State.rolled_back``)."""


def announcement(inputs: PlanInputs, outcome: PlanOutcome) -> RecoveryPlan:
    """The Core's RecoveryPlan carrying ``inputs`` and ``outcome``."""
    slow = sorted(inputs.slowdowns)
    return RecoveryPlan(
        sender=CORE_SENDER,
        generation=outcome.generation,
        failed=list(inputs.failed),
        committed_step=outcome.committed_step,
        plan_digest=outcome.plan_digest,
        reason=outcome.reason,
        rebuild=list(outcome.rebuild),
        policy=str(inputs.policy),
        slow_ranks=slow,
        slow_factors=[inputs.slowdowns[x] for x in slow],
        kind=outcome.kind,
        joined=list(inputs.joined),
        stale=list(inputs.stale),
        attempt=outcome.attempt,
        migration=str(inputs.migration),
        shorten=inputs.shorten,
        restore=outcome.restore,
        rollback=outcome.rollback,
    )


def decode(event: RecoveryPlan) -> PlanInputs:
    """The inputs ``event`` announces; ValueError for a policy or a migration mode no
    Core announces."""
    try:
        migration = MigrationMode(event.migration)
    except ValueError:
        raise ValueError(
            f"the plan of generation {event.generation} announces migration "
            f"{event.migration!r}; valid: {', '.join(MigrationMode)}"
        ) from None
    return PlanInputs(
        failed=tuple(event.failed),
        joined=tuple(event.joined),
        policy=Policy(event.policy),
        slowdowns=dict(zip(event.slow_ranks, event.slow_factors, strict=True)),
        stale=tuple(event.stale),
        migration=migration,
        shorten=event.shorten,
    )


def rebalancing(inputs: PlanInputs, job: Rebalancing) -> Rebalancing:
    """The throughput planner's inputs: the job's cost model (``job``) under the
    announced policy and slowdowns (and fewer stages allowed once a wait ran out)."""
    return dataclasses.replace(
        job,
        policy=inputs.policy,
        slowdowns=dict(inputs.slowdowns),
        shorten=job.shorten or inputs.shorten,
    )
