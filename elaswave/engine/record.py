"""The record of a plan change, typed: summary.json's ``recoveries`` entries.

The Core plans a change (:class:`PlannedRecovery`: what it decided, kept while the plan
is agreed and applied) and records it once every participant has applied the plan
(:class:`RecoveryRecord`: with the change's times and what its application moved). Its
migration (:class:`MigrationRecord`) gains what a non-blocking migration streamed once
every rank has reported it; its phase times (:class:`PhaseTimes`) gain the redone
step's once that step completes.

:func:`record_to_json` writes a record exactly as summary.json holds it (the same keys,
in the same order, with the same values); :func:`record_from_json` reads it back. Both
are the only place the record's JSON form is spelled (:attr:`RecoveryRecord.SCHEMA`
names its version; the Core's persisted state, which holds records in this form, carries
it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from elaswave.bus.schema import RecoveryKind
from elaswave.engine.migration import MigrationDecision, MigrationMode
from elaswave.engine.plan import Plan, plan_summary
from elaswave.engine.schedule import Schedule


@dataclass(frozen=True, kw_only=True)
class Streamed:
    """What a non-blocking migration streamed: bytes sent, and how long a target
    waited for them (one rank's MigrationDone, or a change's total)."""

    bytes_streamed: int
    waited_s: float


@dataclass(frozen=True, kw_only=True)
class MigrationRecord:
    """How a change moved layers: the Core's decision, and what streamed."""

    decision: MigrationDecision
    streamed: Streamed | None = None
    """Every rank's MigrationDone summed (bytes) and maxed (wait); None: none came."""


@dataclass(frozen=True, kw_only=True)
class PhaseTimes:
    """How long each phase of a change took (seconds; MTTR's parts)."""

    detect: float
    """From the cause (a kill's own time) to the Core seeing it."""
    plan: float
    """From seeing it to announcing the plan that ran."""
    ack: float
    """From that announcement to its commit."""
    comm: float
    remap: float
    resume: float
    """The slowest participant's communicator rebuild, state remap and resume."""
    redo: float | None = None
    """From the plan applied to the redone step completed (None: it has not)."""


@dataclass(frozen=True, kw_only=True)
class StageSummary:
    """One stage of a plan as summary.json records it."""

    layers: tuple[int, int]
    """[first layer, last layer + 1)."""
    ranks: tuple[int, ...]
    sizes: tuple[int, ...]
    rotate: bool
    block: int
    mhz: float | None


@dataclass(frozen=True, kw_only=True)
class PlanSummary:
    """A plan as summary.json records it (:func:`elaswave.engine.plan.plan_summary`)."""

    generation: int
    num_micro_batches: int
    stages: tuple[StageSummary, ...]
    schedule: Schedule | None = None
    """The pipeline schedule the plan runs; None in a summary written before it was
    recorded (2026-11-28), which says nothing of it."""

    @classmethod
    def of(cls, plan: Plan) -> PlanSummary:
        return _summary_from_json(plan_summary(plan))


@dataclass(frozen=True, kw_only=True)
class PlannedRecovery:
    """A change as the Core planned it: the record before its times."""

    step: int
    """The step redone first under the new plan."""
    kind: RecoveryKind
    ranks: tuple[int, ...]
    """The ranks the change is about (failed, slow or joining)."""
    generation: int
    """The new plan's generation."""
    committed_step: int
    """The step every survivor resumed after."""
    reason: str
    superseded: int
    """Announcements of the plan superseded before this one (its attempt)."""
    migration: MigrationRecord
    plan: PlanSummary
    joined: tuple[int, ...]
    waited_s: float | None = None
    """How long the change waited for joiners (None: it did not wait)."""
    restored: bool = False
    """State was lost: every participant restored the disk checkpoint of
    ``committed_step`` inside the job (the steps after it are trained again)."""
    rolled_back: bool = False
    """A participant failed while the others applied the plan: it never became current;
    every member rolled back to the plan before it, and the next change answers both
    failures."""


@dataclass(frozen=True, kw_only=True)
class RecoveryRecord(PlannedRecovery):
    """A change recorded once every participant applied its plan."""

    SCHEMA: ClassVar[int] = 1
    """The version of the record's JSON form (:func:`record_to_json`)."""
    mttr_s: float
    """From the cause to the redone step completed (until then, to the plan applied)."""
    phases: PhaseTimes
    bytes_moved: int
    """Bytes the participants sent to remap state."""
    params_s: float
    """The slowest participant's parameter gather."""
    communicators: int = 0
    """The most process groups a participant holds open under the plan (0: none
    reported)."""


def recorded(
    planned: PlannedRecovery, *, mttr_s: float, phases: PhaseTimes, bytes_moved: int,
    params_s: float, communicators: int = 0,
) -> RecoveryRecord:  # fmt: skip
    """``planned``'s record with its times."""
    return RecoveryRecord(
        step=planned.step,
        kind=planned.kind,
        ranks=planned.ranks,
        generation=planned.generation,
        committed_step=planned.committed_step,
        reason=planned.reason,
        superseded=planned.superseded,
        migration=planned.migration,
        plan=planned.plan,
        joined=planned.joined,
        waited_s=planned.waited_s,
        restored=planned.restored,
        rolled_back=planned.rolled_back,
        mttr_s=mttr_s,
        phases=phases,
        bytes_moved=bytes_moved,
        params_s=params_s,
        communicators=communicators,
    )


# ----------------------------------------------------------------------------- JSON


def record_to_json(record: RecoveryRecord) -> dict[str, Any]:
    """``record`` exactly as summary.json holds it."""
    doc: dict[str, Any] = {
        "step": record.step,
        "kind": str(record.kind),
        "ranks": list(record.ranks),
        "generation": record.generation,
        "committed_step": record.committed_step,
        "reason": record.reason,
        "superseded": record.superseded,
        "migration": _migration_to_json(record.migration),
        "plan": _summary_to_json(record.plan),
        "joined": list(record.joined),
    }
    if record.waited_s is not None:
        doc["waited_s"] = record.waited_s
    if record.restored:
        doc["restored"] = True
    if record.rolled_back:
        doc["rolled_back"] = True
    p = record.phases
    doc["mttr_s"] = record.mttr_s
    doc["phases"] = {
        "detect": p.detect,
        "plan": p.plan,
        "ack": p.ack,
        "comm": p.comm,
        "remap": p.remap,
        "resume": p.resume,
        "redo": p.redo,
    }
    doc["bytes_moved"] = record.bytes_moved
    doc["params_s"] = record.params_s
    doc["communicators"] = record.communicators
    return doc


def record_from_json(doc: Mapping[str, Any]) -> RecoveryRecord:
    """The record :func:`record_to_json` wrote (after a JSON round trip); ValueError
    naming what is malformed."""
    try:
        p = doc["phases"]
        return RecoveryRecord(
            step=int(doc["step"]),
            kind=RecoveryKind(doc["kind"]),
            ranks=tuple(int(r) for r in doc["ranks"]),
            generation=int(doc["generation"]),
            committed_step=int(doc["committed_step"]),
            reason=str(doc["reason"]),
            superseded=int(doc["superseded"]),
            migration=_migration_from_json(doc["migration"]),
            plan=_summary_from_json(doc["plan"]),
            joined=tuple(int(r) for r in doc["joined"]),
            waited_s=_maybe_number(doc.get("waited_s")),
            restored=bool(doc.get("restored", False)),
            rolled_back=bool(doc.get("rolled_back", False)),
            mttr_s=_number(doc["mttr_s"]),
            phases=PhaseTimes(
                detect=_number(p["detect"]),
                plan=_number(p["plan"]),
                ack=_number(p["ack"]),
                comm=_number(p["comm"]),
                remap=_number(p["remap"]),
                resume=_number(p["resume"]),
                redo=_maybe_number(p["redo"]),
            ),
            bytes_moved=int(doc["bytes_moved"]),
            params_s=_number(doc["params_s"]),
            communicators=int(doc.get("communicators", 0)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed recovery record: {exc!r}") from None


def _migration_to_json(m: MigrationRecord) -> dict[str, Any]:
    d = m.decision
    doc: dict[str, Any] = {"mode": str(d.mode), "layers": list(d.layers)}
    if d.why is not None:
        doc["why"] = d.why
    if d.early_micro_batches is not None:
        doc["early_micro_batches"] = d.early_micro_batches
    if m.streamed is not None:
        doc["bytes_streamed"] = m.streamed.bytes_streamed
        doc["waited_s"] = m.streamed.waited_s
    return doc


def _migration_from_json(doc: Mapping[str, Any]) -> MigrationRecord:
    early = doc.get("early_micro_batches")
    decision = MigrationDecision(
        mode=MigrationMode(doc["mode"]),
        layers=tuple(int(x) for x in doc["layers"]),
        why=None if doc.get("why") is None else str(doc["why"]),
        early_micro_batches=None if early is None else int(early),
    )
    streamed = None
    if "bytes_streamed" in doc:
        streamed = Streamed(
            bytes_streamed=int(doc["bytes_streamed"]), waited_s=_number(doc["waited_s"])
        )
    return MigrationRecord(decision=decision, streamed=streamed)


def _summary_to_json(plan: PlanSummary) -> dict[str, Any]:
    schedule = {} if plan.schedule is None else {"schedule": plan.schedule.value}
    return {
        "generation": plan.generation,
        "num_micro_batches": plan.num_micro_batches,
        **schedule,
        "stages": [
            {
                "layers": list(s.layers),
                "ranks": list(s.ranks),
                "sizes": list(s.sizes),
                "rotate": s.rotate,
                "block": s.block,
                "mhz": s.mhz,
            }
            for s in plan.stages
        ],
    }


def _summary_from_json(doc: Mapping[str, Any]) -> PlanSummary:
    return PlanSummary(
        generation=int(doc["generation"]),
        num_micro_batches=int(doc["num_micro_batches"]),
        schedule=Schedule(doc["schedule"]) if "schedule" in doc else None,
        stages=tuple(
            StageSummary(
                layers=(int(s["layers"][0]), int(s["layers"][1])),
                ranks=tuple(int(r) for r in s["ranks"]),
                sizes=tuple(int(n) for n in s["sizes"]),
                rotate=bool(s["rotate"]),
                block=int(s["block"]),
                mhz=_maybe_number(s["mhz"]),
            )
            for s in doc["stages"]
        ),
    )


def _number(value: Any) -> float:
    """A JSON number as it was written (an int stays one: the record writes it back
    the same)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{value!r} is not a number")
    return value


def _maybe_number(value: Any) -> float | None:
    return None if value is None else _number(value)
