"""Replay: recompute a run's recovery plans from its event log and check each one.

The planners are pure functions of (plan, event inputs), and every input the Core used is
on the bus: the failed and joining ranks, the policy and the measured slowdowns (in each
:class:`~elaswave.bus.schema.RecoveryPlan`), and the survivors' committed steps (their
:class:`~elaswave.bus.schema.RecoveryReady`). Starting from the job's initial plan
(RUN_DIR/job.json), :func:`replay_run` feeds them through
:func:`~elaswave.engine.recovery.plan_fail_stop` in log order and compares what comes out
with what the Core announced: the plan's digest (SHA-256 of its canonical JSON, so equal
digests mean byte-identical plans), the step every survivor resumed after, and the
reason. The first divergence stops the replay (later plans build on the diverging one)
and names the event that caused the recovery.

A generation may be announced more than once (``attempt`` 0, 1, ...: a participant failed
or did not acknowledge before the commit). Every announcement is replayed from the same
base; the next generation builds on the one the Core committed (its
:class:`~elaswave.bus.schema.PlanCommit`).

Workers do the same for every plan they apply, so a plan is never shipped, only its
inputs (:mod:`elaswave.engine.plan_inputs` encodes and decodes them for all three; the
job's cost model comes from :mod:`elaswave.runtime.job.inputs`). Replay also checks the
migration mode the Core decided for the change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from elaswave.bus.eventlog import LogRecord, format_record, read_event_log
from elaswave.bus.schema import (
    CORE_SENDER,
    FailureDetected,
    PauseRequest,
    PlanCommit,
    RecoveryPlan,
    RecoveryReady,
    ScaleRequest,
    StragglerDetected,
)
from elaswave.engine.migration import MigrationMode
from elaswave.engine.plan import Plan, taken_back
from elaswave.engine.plan_inputs import decode
from elaswave.engine.recovery import plan_digest
from elaswave.engine.replan import plan_fail_stop, plan_restore
from elaswave.fabric.errors import Unrecoverable
from elaswave.rundir import EVENT_LOG, JOB
from elaswave.runtime.job.config import JobConfig, JobSpec
from elaswave.runtime.job.inputs import announced_rebalancing, decide_migration

_CAUSES = (FailureDetected, StragglerDetected, ScaleRequest, PauseRequest)
"""Events that start a recovery: the divergence report names the latest one."""


@dataclass(frozen=True)
class Replayed:
    """One recovery plan, as announced and as replayed."""

    generation: int
    attempt: int
    kind: str
    failed: tuple[int, ...]
    joined: tuple[int, ...]
    digest: str
    """The digest the Core announced."""
    replayed_digest: str | None
    """The digest replay computed (None: replay could not plan; see ``problems``)."""
    problems: tuple[str, ...]
    """Each field that differs, as 'what: announced X, replayed Y'; empty when equal."""
    event: str
    """The announcement, formatted as ``elaswave events`` prints it."""
    cause: str | None
    """The latest event before it that starts a recovery, formatted likewise."""

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class ReplayResult:
    plans: tuple[Replayed, ...]
    """Every announced plan up to and including the first divergence, in log order."""
    unreadable: tuple[str, ...] = field(default=())
    """Log records that did not decode (skipped; the Core logged them too)."""
    ignored: tuple[str, ...] = field(default=())
    """Recovery plans from a sender other than the Core (not plans: skipped)."""

    @property
    def diverged(self) -> Replayed | None:
        return next((p for p in self.plans if not p.ok), None)


def replay_run(run_dir: Path) -> ReplayResult:
    """Replay every recovery plan of ``run_dir``; ValueError when it is not a run."""
    if not (run_dir / JOB).is_file():
        raise ValueError(f"{str(run_dir)!r} has no {JOB}: not a run directory")
    log_path = run_dir / EVENT_LOG
    if not log_path.is_file():
        raise ValueError(f"{str(run_dir)!r} has no {EVENT_LOG}: the run recorded no events")
    cfg = JobSpec.read(run_dir).config  # ValueError when job.json does not describe a job
    initial = cfg.plan()
    settled: dict[int, Plan] = {initial.generation: initial}
    """generation -> the plan it settled on: the committed attempt (else the latest)."""
    attempts: dict[tuple[int, int], Plan] = {}
    floors: dict[int, int] = {
        initial.generation: cfg.state.resume_step if cfg.state.resume_step is not None else -1
    }
    """generation -> the step its settled plan's survivors cannot roll back before."""
    bases: dict[int, Plan] = {}
    """generation -> the plan its plan was planned from (a rollback plans from the
    layout before the torn plan: :func:`~elaswave.engine.plan.taken_back`)."""
    announced: dict[tuple[int, int], int] = {}  # (generation, attempt) -> committed step
    committed: set[int] = set()
    ready: dict[int, dict[int, RecoveryReady]] = {}  # generation -> rank -> latest report
    cause: LogRecord | None = None
    out: list[Replayed] = []
    unreadable: list[str] = []
    ignored: list[str] = []
    for record in read_event_log(log_path):
        event = record.event
        if event is None:
            unreadable.append(format_record(record))
            continue
        if isinstance(event, RecoveryReady):
            ready.setdefault(event.generation, {})[event.rank] = event
        elif isinstance(event, _CAUSES):
            cause = record
        elif isinstance(event, PlanCommit) and event.sender == CORE_SENDER:
            key = (event.generation, event.attempt)
            if key in attempts:
                settled[event.generation] = attempts[key]
                floors[event.generation] = announced[key]
                committed.add(event.generation)
        elif isinstance(event, RecoveryPlan) and event.sender != CORE_SENDER:
            ignored.append(format_record(record))  # only the Core announces plans
        elif isinstance(event, RecoveryPlan) and (event.generation, event.attempt) not in attempts:
            base = _base(event, settled, bases)
            digest, problems, new_plan = _replay_one(
                cfg, base, event, ready.get(event.generation - 1, {}),
                floors.get(event.generation - 1, -1),
            )  # fmt: skip
            out.append(
                Replayed(
                    generation=event.generation,
                    attempt=event.attempt,
                    kind=event.kind,
                    failed=tuple(event.failed),
                    joined=tuple(event.joined),
                    digest=event.plan_digest,
                    replayed_digest=digest,
                    problems=problems,
                    event=format_record(record),
                    cause=None if cause is None else format_record(cause),
                )
            )
            if new_plan is None:
                break
            bases[event.generation] = base  # type: ignore[assignment]  # not None: planned
            attempts[(event.generation, event.attempt)] = new_plan
            announced[(event.generation, event.attempt)] = event.committed_step
            if event.generation not in committed:
                settled[event.generation] = new_plan
                floors[event.generation] = event.committed_step
    return ReplayResult(tuple(out), tuple(unreadable), tuple(ignored))


def _base(event: RecoveryPlan, settled: dict[int, Plan], bases: dict[int, Plan]) -> Plan | None:
    """The plan ``event``'s plan is planned from: the one its generation follows, or for
    a rollback the layout that plan was planned from, taken back."""
    torn = event.generation - 1
    if not event.rollback:
        return settled.get(torn)
    before = bases.get(torn)
    return None if before is None else taken_back(before, torn)


def _replay_one(
    cfg: JobConfig,
    plan: Plan | None,
    event: RecoveryPlan,
    reports: dict[int, RecoveryReady],
    floor: int,
) -> tuple[str | None, tuple[str, ...], Plan | None]:
    """(replayed digest, problems, the plan to go on from: None after a divergence)."""
    if plan is None:
        return None, (
            f"generation: announced {event.generation}, but no plan of generation "
            f"{event.generation - 1} is in the log (a plan between them is missing)",
        ), None  # fmt: skip
    survivors = set(plan.ranks) - set(event.failed)
    commits = {r: e.committed_step for r, e in reports.items() if r in survivors}
    newest = {r: max(e.committed_step, e.newest_step) for r, e in reports.items() if r in survivors}
    try:
        inputs = decode(event)
        rebalance = announced_rebalancing(cfg, inputs)
        try:
            decision = plan_fail_stop(
                plan,
                inputs.failed,
                commits,
                newest=newest,
                ranks_per_node=cfg.layout.units_per_node,
                snapshots=cfg.state.snapshots,
                copies=cfg.state.snapshot_copies,
                rebalancing=rebalance,
                joined=inputs.joined,
                floor=floor,
            )
        except Unrecoverable as lost:
            # no member left: the joiners took the job's newest checkpoint (not bounded here)
            bound = min(commits.values(), default=event.committed_step)
            if not event.restore or event.committed_step > bound:
                raise
            decision = plan_restore(
                plan, inputs.failed, event.committed_step, lost, rebalance, inputs.joined
            )
        else:
            if event.restore:
                return None, ("restore: announced, but the replayed plan loses no state",), None
    except (ValueError, Unrecoverable) as exc:
        return None, (f"inputs: replay cannot plan from the logged events ({exc})",), None
    digest = plan_digest(decision.plan)
    problems = []
    if digest != event.plan_digest:
        problems.append(f"plan digest: announced {event.plan_digest}, replayed {digest}")
    if decision.committed_step != event.committed_step:
        problems.append(
            f"committed step: announced {event.committed_step}, replayed {decision.committed_step}"
        )
    if decision.reason != event.reason:
        problems.append(f"reason: announced {event.reason!r}, replayed {decision.reason!r}")
    mode = (
        MigrationMode.NONE  # a restore reads every layer from the checkpoint
        if event.restore
        else decide_migration(cfg, plan, decision.plan, inputs.stale, inputs.joined).mode
    )
    if mode != inputs.migration:
        problems.append(f"migration: announced {event.migration!r}, replayed {str(mode)!r}")
    return digest, tuple(problems), None if problems else decision.plan
