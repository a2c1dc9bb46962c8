"""The Core's state: the job's membership, and the plan change under way, phase by phase
(pure data; :mod:`elaswave.engine.protocol` holds the transitions).

A change leaves generation ``g`` for ``g + 1``. What every change has (its kind, its
generation, the ranks it is about, what happened in words, when) sits in
:class:`Change`; what it holds in its current phase sits in that phase's own type
(:data:`PhaseState`): :class:`Detecting`, :class:`Stopping`, :class:`Agreeing`,
:class:`Applying`, :class:`Waiting`, :class:`Checkpointing`. A field meaningful in
one phase lives only in that phase's type.

:class:`State` is exactly what the Core persists (``core_state.json``:
:func:`state_to_json` / :func:`state_from_json`, through the dataclasses' own codec,
:mod:`elaswave.engine.codec`): a restarted Core continues from it. Every map is keyed by
rank unless it says otherwise; times are wall-clock seconds, the ``now`` the shell
passes.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from elaswave.bus.schema import RecoveryKind
from elaswave.engine.codec import Forms, from_json, to_json
from elaswave.engine.plan import Plan, plan_from_dict, plan_to_dict
from elaswave.engine.record import (
    PlannedRecovery,
    RecoveryRecord,
    Streamed,
    record_from_json,
    record_to_json,
)


@dataclass(frozen=True, kw_only=True)
class Report:
    """A member's RecoveryReady: the step it committed, its parameters' step, and the
    groups its failed step left tainted."""

    committed_step: int
    params_step: int
    tainted: tuple[str, ...] = ()
    newest_step: int = -2
    """A TP member's newer committed step (see RecoveryReady.newest_step); -2: none."""

    @property
    def newest(self) -> int:
        """The newest step any process of the rank committed."""
        return max(self.committed_step, self.newest_step)


@dataclass(frozen=True, kw_only=True)
class Applied:
    """A participant's RecoveryDone (zeros: it went past the change without one)."""

    comm_s: float = 0.0
    remap_s: float = 0.0
    resume_s: float = 0.0
    bytes_sent: int = 0
    params_s: float = 0.0
    communicators: int = 0


# ----------------------------------------------------------------------------- phases


class Phase(enum.StrEnum):
    """The phases of a change (each phase type's ``TAG``)."""

    DETECTING = "detecting"
    STOPPING = "stopping"
    AGREEING = "agreeing"
    APPLYING = "applying"
    WAITING = "waiting"
    CHECKPOINTING = "checkpointing"


@dataclass(frozen=True, kw_only=True)
class Detecting:
    """Exits seen; more may follow within ``grace_s`` (one failure)."""

    TAG: ClassVar[Phase] = Phase.DETECTING
    failed: Mapping[int, int]
    """The ranks that exited so far: their exit codes."""
    deadline: float
    """When every member is asked to stop (the first exit, plus ``grace_s``)."""


@dataclass(frozen=True, kw_only=True)
class Stopping:
    """Announced: every member stops at a step boundary and reports, or is lost
    (:mod:`elaswave.engine.phases.stopping` holds its own small machine)."""

    TAG: ClassVar[Phase] = Phase.STOPPING
    generation: int
    """The generation the change leaves (a report of another is no report)."""
    members: frozenset[int]
    """Members of the plan not lost so far: each must report."""
    failed: Mapping[int, int]
    """Every rank lost so far (announced or about to be): its exit code."""
    reported: frozenset[int] = frozenset()
    """Members whose report of ``generation`` arrived."""
    announced: frozenset[int] = frozenset()
    """Failed ranks the last announcement named."""
    after_step: int | None = None
    """A pause (a join, a rebalance): the step after which members stop. None: a
    failure (members abort their step at once)."""
    deadline: float
    """When a member that has neither reported nor exited stops the job."""


@dataclass(frozen=True, kw_only=True)
class Agreeing:
    """A plan is announced (attempt ``attempt``); every participant acknowledges it."""

    TAG: ClassVar[Phase] = Phase.AGREEING
    members: frozenset[int]
    """The stopped members the plan is for (the survivors)."""
    failed: frozenset[int]
    """The plan's ranks lost: the planner's failed ranks."""
    attempt: int
    """This announcement of the plan (0: the first; a later one supersedes it)."""
    digest: str
    plan: Plan
    participants: frozenset[int]
    """Who must acknowledge and apply the plan: the survivors and the joiners."""
    acked: frozenset[int] = frozenset()
    record: PlannedRecovery
    """The change as planned (summary.json's record, before its times)."""
    planned_at: float
    completed: Mapping[int, float] = field(default_factory=dict)
    """Steps completed since a plan of the change was announced, and when (a step
    redone under it can complete before the last report of its application arrives)."""
    waited_since: float | None = None
    """When the change began to wait for joiners (None: it has not waited)."""
    deadline: float
    """When a participant that has not acknowledged is fenced."""


@dataclass(frozen=True, kw_only=True)
class Applying:
    """The plan is committed; every participant applies it."""

    TAG: ClassVar[Phase] = Phase.APPLYING
    failed: frozenset[int]
    """The ranks the plan was planned without (its announcement's failed ranks)."""
    attempt: int
    """The committed announcement."""
    digest: str
    plan: Plan
    participants: frozenset[int]
    applied: Mapping[int, Applied] = field(default_factory=dict)
    exited: Mapping[int, tuple[int, float]] = field(default_factory=dict)
    """Participants that exited before applying the plan: (code, when)."""
    record: PlannedRecovery
    planned_at: float
    committed_at: float
    completed: Mapping[int, float] = field(default_factory=dict)
    """As :attr:`Agreeing.completed`."""
    deadline: float
    """When a participant that has not applied the plan stops the job."""


@dataclass(frozen=True, kw_only=True)
class Waiting:
    """Too few ranks are left for the stages: the stopped members wait for joiners
    (:mod:`elaswave.engine.phases.waiting`)."""

    TAG: ClassVar[Phase] = Phase.WAITING
    members: frozenset[int]
    """The stopped members, their state in memory."""
    failed: frozenset[int]
    needed: int
    """Ranks still missing to fill every stage."""
    step: int
    """The step the members roll back to: what a checkpoint would write (-1: none)."""
    since: float
    """When the change began to wait."""
    attempt: int
    """The last announcement of a plan before the wait (-1: none)."""
    completed: Mapping[int, float] = field(default_factory=dict)
    """As :attr:`Agreeing.completed` (kept for the plan that follows the wait)."""
    deadline: float
    """``since`` plus the job's wait: then the members write a checkpoint."""


@dataclass(frozen=True, kw_only=True)
class Checkpointing:
    """The wait ran out: the stopped members write a checkpoint, then the job stops."""

    TAG: ClassVar[Phase] = Phase.CHECKPOINTING
    members: frozenset[int]
    failed: frozenset[int]
    needed: int
    """Ranks that were missing (the stop says so)."""
    step: int
    """The step written."""
    writers: frozenset[int]
    """The members asked to write a part."""
    written: frozenset[int] = frozenset()
    """The members that reported their part written."""
    deadline: float


PhaseState = Detecting | Stopping | Agreeing | Applying | Waiting | Checkpointing


@dataclass(frozen=True, kw_only=True)
class Change:
    """A plan change under way, from generation ``generation`` to the next."""

    kind: RecoveryKind
    generation: int
    ranks: tuple[int, ...]
    """The ranks it is about (the record's ``ranks``)."""
    detail: str
    """What happened, in words (grows as more ranks are lost)."""
    joined: tuple[int, ...] = ()
    """The joiners the plan adds."""
    seen_at: float
    origin: float
    """When the change's cause happened (a kill's own time, else when it was seen)."""
    phase: PhaseState


# ----------------------------------------------------------------------------- state


@dataclass(frozen=True, kw_only=True)
class Finishing:
    """A change whose plan runs, waiting for its redone step (MTTR ends there) and, for
    a non-blocking migration, for every rank's MigrationDone."""

    index: int
    """Its record's place in ``State.recoveries``."""
    generation: int
    redo: int
    origin: float
    planned_at: float
    done_at: float
    deadline: float
    redone_at: float | None = None
    ranks: int = 0
    """How many MigrationDone reports to wait for (0: none)."""


@dataclass(frozen=True, kw_only=True)
class State:
    plan: Plan
    alive: frozenset[int]
    """Worker processes running (the plan's, and joiners not yet in it)."""
    next_rank: int
    """The rank a spawned joiner gets."""
    codes: Mapping[int, int] = field(default_factory=dict)
    """Exit codes of the workers that exited."""
    errors: Mapping[int, str] = field(default_factory=dict)
    """A failed worker's own account of its failure."""
    killed_at: Mapping[int, float] = field(default_factory=dict)
    """When an injected fault killed the worker (its own record)."""
    fenced: Mapping[int, str] = field(default_factory=dict)
    """Ranks the Core killed, and why."""
    slowdowns: Mapping[int, float] = field(default_factory=dict)
    reports: Mapping[int, Report] = field(default_factory=dict)
    """RecoveryReady of the current generation."""
    trained: Mapping[int, int] = field(default_factory=dict)
    """The latest generation each rank trained a step under."""
    last_step: int = -1
    """The latest step a rank reported timings of."""
    done_step: int = -1
    """The latest step the job completed."""
    joiners: frozenset[int] = frozenset()
    """Joiners up and waiting for a plan that adds them."""
    later: Mapping[int, int] = field(default_factory=dict)
    """Failures seen while a change was applied, for the next change."""
    change: Change | None = None
    recoveries: tuple[RecoveryRecord, ...] = ()
    finishing: tuple[Finishing, ...] = ()
    migrated: Mapping[tuple[int, int], Streamed] = field(default_factory=dict)
    """(generation, rank) -> what the rank's MigrationDone reported."""
    joins_done: int = 0
    scales_done: int = 0
    stopped: str = ""
    """Why the job stopped (empty: it runs)."""
    checkpoints: tuple[int, ...] = ()
    """Steps of the complete disk checkpoints (restored when state is lost)."""
    rolled_back: bool = False
    """``plan`` is the layout before a torn plan (:func:`~elaswave.engine.plan.
    taken_back`): its members hold what they committed under it, kept while they
    applied the torn plan, and the change under way rolls them back to it."""


def initial_state(plan: Plan) -> State:
    return State(plan=plan, alive=frozenset(plan.ranks), next_rank=max(plan.ranks) + 1)


# ----------------------------------------------------------------------------- JSON

CORE_STATE_VERSION = 3
"""The version of ``core_state.json`` this Core writes and reads (1: before it carried
one; 2: before it carried its ``log_position``). A run's state is only read by the same
version's restarted Core."""

_META = ("version", "record_schema", "log_position")
"""The keys of ``core_state.json`` beside the state's own fields."""

_FORMS: Forms = {
    Plan: (plan_to_dict, plan_from_dict),
    RecoveryRecord: (record_to_json, record_from_json),
}
"""Types persisted in a form of their own: the plan as the store holds it, a record as
summary.json holds it (the job host summarises a run from it when the Core is lost)."""


class StateVersionError(ValueError):
    """A persisted state of another version than this Core's."""


def state_to_json(s: State, log_position: int = 0) -> dict[str, Any]:
    """``s`` as JSON data (what ``core_state.json`` holds), with its version, and the
    position in the event log up to which ``s`` has taken in the protocol's events."""
    doc: dict[str, Any] = to_json(s, State, _FORMS)
    meta = {"version": CORE_STATE_VERSION, "record_schema": RecoveryRecord.SCHEMA}
    return {**meta, "log_position": log_position, **doc}


def log_position(doc: Mapping[str, Any], source: str = "core_state.json") -> int:
    """The event log position a persisted state (:func:`state_to_json`) has taken in."""
    position = doc.get("log_position", 0)
    if type(position) is not int or position < 0:
        raise ValueError(f"{source}: log_position = {position!r}: must be an int >= 0")
    return position


def state_from_json(doc: Mapping[str, Any], source: str = "core_state.json") -> State:
    """The state :func:`state_to_json` wrote (after a JSON round trip); ``source``
    names the file in errors (:class:`StateVersionError` for another version)."""
    found = (doc.get("version", 1), doc.get("record_schema", 1))
    wanted = (CORE_STATE_VERSION, RecoveryRecord.SCHEMA)
    if found != wanted:
        raise StateVersionError(
            f"{source} holds Core state of version {found[0]} (records of schema "
            f"{found[1]}), and this Core reads version {wanted[0]} (records of schema "
            f"{wanted[1]}) only: a run's Core state is read by a restarted Core of the "
            "ElasWave version that wrote it"
        )
    body = {k: v for k, v in doc.items() if k not in _META}
    state: State = from_json(body, State, _FORMS)
    return state
