"""The vocabulary of the Core's change protocol: its state, the events it takes, the
actions it asks for and the job's rules (pure data; :mod:`elaswave.engine.protocol`
holds the transitions).

:class:`State` is exactly what the Core persists (``core_state.json``,
:func:`state_to_dict` / :func:`state_from_dict`): a restarted Core continues from it.
Every map is keyed by rank; times are wall-clock seconds, the ``now`` the shell passes.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from elaswave.bus.schema import Event, RecoveryKind
from elaswave.engine.plan import Plan, plan_from_dict, plan_to_dict
from elaswave.engine.recovery import Rebalancing
from elaswave.engine.stopping import Stopping

Record = Mapping[str, Any]
"""One change as summary.json records it (JSON data)."""


# ----------------------------------------------------------------------------- rules


@dataclass(frozen=True, kw_only=True)
class Rules:
    """What the job fixes for the whole run: the protocol's constants."""

    steps: int
    recovery: bool = True
    """False: the first failure stops the job."""
    ranks_per_node: int = 1
    snapshots: bool = True
    rebalancing: Rebalancing = field(default_factory=Rebalancing)
    """The throughput planner's inputs without the measured slowdowns (the state's)."""
    migration: str = "nonblocking"
    migration_early: int | None = None
    stop_timeout_s: float = 30.0
    """How long members may take to stop at a step boundary, or to apply a plan."""
    ack_timeout_s: float = 10.0
    """How long a participant may take to acknowledge a plan before it is fenced."""
    join_steps: tuple[int, ...] = ()
    """Steps at which the job starts a joiner (``join@STEP`` faults), sorted."""
    can_spawn: bool = True
    """Whether the job can start workers (joiners)."""
    resume_hint: str = ""
    """How to resume after the job stops (names a checkpoint, or says there is none)."""
    first_step: int = -1
    """The step a resumed job starts after (its checkpoint's; -1: a new job): no rank
    can roll back before it."""
    grace_s: float = 0.02
    """Exits this close together are one failure."""
    exit_grace_s: float = 0.5
    """How long a participant that exited while applying a plan is given for its
    report to arrive before its exit stops the job."""
    migrated_wait_s: float = 2.0
    """How long a finished non-blocking migration's reports are waited for."""
    wait_for_nodes_s: float = 0.0
    """How long a job with too few ranks left for its stages waits for joiners, its
    state in memory, before it writes a checkpoint and stops (0: it stops at once)."""
    resume_command: str = ""
    """The flag that resumes this job from a checkpoint it writes (``--resume RUN``)."""


# ----------------------------------------------------------------------------- state


class Phase(enum.StrEnum):
    DETECTING = "detecting"
    """Exits seen; more may follow within ``grace_s`` (one failure)."""
    STOPPING = "stopping"
    """Announced: every member stops at a step boundary and reports."""
    AGREEING = "agreeing"
    """A plan is announced; every participant acknowledges it."""
    APPLYING = "applying"
    """The plan is committed; every participant applies it."""
    WAITING = "waiting"
    """Too few ranks are left for the stages: the stopped members wait for joiners."""
    CHECKPOINTING = "checkpointing"
    """The wait ran out: the stopped members write a checkpoint, then the job stops."""


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


@dataclass(frozen=True, kw_only=True)
class Change:
    """A plan change under way, from generation ``generation`` to the next."""

    kind: RecoveryKind
    phase: Phase
    generation: int
    ranks: tuple[int, ...]
    """The ranks it is about (the record's ``ranks``)."""
    detail: str
    """What happened, in words (grows as more ranks are lost)."""
    stop: Stopping
    """The stop phase: members, failed ranks, reports, what was announced."""
    joined: tuple[int, ...] = ()
    after_step: int = -1
    """A pause: the step after which members stop (-1: a failure, abort at once)."""
    seen_at: float
    origin: float
    """When the change's cause happened (a kill's own time, else when it was seen)."""
    deadline: float
    attempt: int = -1
    """The announcement of the plan under agreement (-1: none yet)."""
    digest: str = ""
    plan: Plan | None = None
    participants: frozenset[int] = frozenset()
    """Who must acknowledge and apply the plan: the survivors and the joiners."""
    acked: frozenset[int] = frozenset()
    applied: Mapping[int, Applied] = field(default_factory=dict)
    exited: Mapping[int, tuple[int, float]] = field(default_factory=dict)
    """Participants that exited before applying the plan: (code, when)."""
    planned_at: float = 0.0
    committed_at: float = 0.0
    record: Record = field(default_factory=dict)
    """The record of the plan under agreement (summary.json's, without timings)."""
    completed: Mapping[int, float] = field(default_factory=dict)
    """Steps completed since the plan was announced, and when (a step redone under it
    can complete before the last report of its application arrives)."""
    needed: int = 0
    """Waiting: ranks still missing to fill every stage."""
    waiting_since: float = -1.0
    """When the change began to wait for joiners (-1: it has not waited)."""
    checkpoint_step: int = -1
    """Checkpointing: the step written."""
    writers: frozenset[int] = frozenset()
    """Checkpointing: the members asked to write a part."""
    written: frozenset[int] = frozenset()
    """Checkpointing: the members that reported their part written."""


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
    recoveries: tuple[Record, ...] = ()
    finishing: tuple[Finishing, ...] = ()
    migrated: Mapping[str, tuple[int, float]] = field(default_factory=dict)
    """``"generation:rank"`` -> (bytes streamed, seconds waited) of MigrationDone."""
    joins_done: int = 0
    scales_done: int = 0
    stopped: str = ""
    """Why the job stopped (empty: it runs)."""


def initial_state(plan: Plan) -> State:
    return State(plan=plan, alive=frozenset(plan.ranks), next_rank=max(plan.ranks) + 1)


# ----------------------------------------------------------------------------- events


@dataclass(frozen=True)
class Exited:
    """A worker process exited (code 0: it finished; negative: killed by a signal)."""

    rank: int
    code: int
    why: str = ""
    killed_at: float | None = None


@dataclass(frozen=True)
class Silent:
    """A worker sent no heartbeat for too long: fence it."""

    rank: int
    why: str


@dataclass(frozen=True)
class Joining:
    """A joiner is up and waits for a plan that adds it."""

    rank: int


@dataclass(frozen=True)
class ScaleUp:
    """The ``index``-th ScaleRequest of the run asks for ``add`` more workers."""

    index: int
    add: int


@dataclass(frozen=True)
class Straggling:
    """The fail-slow detector flagged (or cleared) ranks at ``step``."""

    step: int
    slowdowns: Mapping[int, float]
    recovered: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class Ready:
    rank: int
    generation: int
    report: Report


@dataclass(frozen=True)
class Acked:
    rank: int
    generation: int
    attempt: int
    digest: str


@dataclass(frozen=True)
class Done:
    """A participant applied the plan of ``generation`` (RecoveryDone)."""

    rank: int
    generation: int
    applied: Applied


@dataclass(frozen=True)
class Trained:
    """A rank trained ``step`` under ``generation`` (StepTiming)."""

    rank: int
    generation: int
    step: int


@dataclass(frozen=True)
class StepDone:
    """The job completed ``step`` (StepCompleted arrived at ``at``)."""

    step: int
    at: float


@dataclass(frozen=True)
class Migrated:
    rank: int
    generation: int
    bytes_streamed: int
    waited_s: float


@dataclass(frozen=True)
class Checkpointed:
    """A member wrote its part of the checkpoint of ``step`` (CheckpointWritten)."""

    rank: int
    generation: int
    step: int


@dataclass(frozen=True)
class Tick:
    """Time passed (deadlines)."""


@dataclass(frozen=True)
class Restarted:
    """This Core took over from a predecessor's persisted state; ``present``: the
    workers the host has."""

    present: frozenset[int]


Input = (
    Exited | Silent | Joining | ScaleUp | Straggling | Ready | Acked | Done | Trained
    | StepDone | Migrated | Checkpointed | Tick | Restarted
)  # fmt: skip


# ----------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class Publish:
    event: Event


@dataclass(frozen=True)
class Kill:
    """SIGKILL the worker (fenced)."""

    rank: int


@dataclass(frozen=True)
class Terminate:
    """Ask a joiner to leave (the job is over)."""

    rank: int


@dataclass(frozen=True)
class Spawn:
    """Start a worker that joins the running job as ``rank``."""

    rank: int


@dataclass(frozen=True)
class SharePlan:
    """Put the current plan where joiners read it (the store)."""

    plan: Plan


@dataclass(frozen=True)
class Note:
    """A log line: ``event`` with ``fields``."""

    event: str
    fields: Mapping[str, Any]


@dataclass(frozen=True)
class Stop:
    """The job cannot go on: stop it with ``reason``."""

    reason: str


Action = Publish | Kill | Terminate | Spawn | SharePlan | Note | Stop


class Stopped(Exception):
    """The job cannot go on (internal to the transitions: becomes a :class:`Stop`)."""


# ----------------------------------------------------------------------------- JSON


def _ints(doc: Mapping[str, Any], conv: Any = None) -> dict[int, Any]:
    return {int(k): (conv(v) if conv else v) for k, v in doc.items()}


def _strs(doc: Mapping[int, Any], conv: Any = None) -> dict[str, Any]:
    return {str(k): (conv(v) if conv else v) for k, v in doc.items()}


def _stopping_to_dict(s: Stopping) -> dict[str, Any]:
    return {
        "generation": s.generation,
        "members": sorted(s.members),
        "failed": _strs(s.failed),
        "reported": sorted(s.reported),
        "announced": sorted(s.announced),
    }


def _stopping_from_dict(d: Mapping[str, Any]) -> Stopping:
    return Stopping(
        generation=d["generation"],
        members=frozenset(d["members"]),
        failed=_ints(d["failed"]),
        reported=frozenset(d["reported"]),
        announced=frozenset(d["announced"]),
    )


def _change_to_dict(c: Change) -> dict[str, Any]:
    doc = {f.name: getattr(c, f.name) for f in dataclasses.fields(c)}
    doc.update(
        ranks=list(c.ranks),
        joined=list(c.joined),
        stop=_stopping_to_dict(c.stop),
        plan=plan_to_dict(c.plan) if c.plan is not None else None,
        participants=sorted(c.participants),
        acked=sorted(c.acked),
        writers=sorted(c.writers),
        written=sorted(c.written),
        applied=_strs(c.applied, dataclasses.asdict),
        exited=_strs(c.exited, list),
        record=dict(c.record),
        completed=_strs(c.completed),
    )
    return doc


def _change_from_dict(d: Mapping[str, Any]) -> Change:
    return Change(
        **{
            **d,
            "kind": RecoveryKind(d["kind"]),
            "phase": Phase(d["phase"]),
            "ranks": tuple(d["ranks"]),
            "joined": tuple(d["joined"]),
            "stop": _stopping_from_dict(d["stop"]),
            "plan": plan_from_dict(d["plan"]) if d["plan"] is not None else None,
            "participants": frozenset(d["participants"]),
            "acked": frozenset(d["acked"]),
            "writers": frozenset(d["writers"]),
            "written": frozenset(d["written"]),
            "applied": _ints(d["applied"], lambda a: Applied(**a)),
            "exited": _ints(d["exited"], tuple),
            "completed": _ints(d["completed"]),
        }
    )


def state_to_dict(s: State) -> dict[str, Any]:
    """``s`` as JSON data (what ``core_state.json`` holds)."""
    return {
        "plan": plan_to_dict(s.plan),
        "alive": sorted(s.alive),
        "next_rank": s.next_rank,
        "codes": _strs(s.codes),
        "errors": _strs(s.errors),
        "killed_at": _strs(s.killed_at),
        "fenced": _strs(s.fenced),
        "slowdowns": _strs(s.slowdowns),
        "reports": _strs(s.reports, lambda r: {**dataclasses.asdict(r), "tainted": r.tainted}),
        "trained": _strs(s.trained),
        "last_step": s.last_step,
        "done_step": s.done_step,
        "joiners": sorted(s.joiners),
        "later": _strs(s.later),
        "change": _change_to_dict(s.change) if s.change is not None else None,
        "recoveries": [dict(r) for r in s.recoveries],
        "finishing": [dataclasses.asdict(f) for f in s.finishing],
        "migrated": {k: list(v) for k, v in s.migrated.items()},
        "joins_done": s.joins_done,
        "scales_done": s.scales_done,
        "stopped": s.stopped,
    }


def state_from_dict(d: Mapping[str, Any]) -> State:
    """The state :func:`state_to_dict` wrote (after a JSON round trip)."""
    return State(
        plan=plan_from_dict(d["plan"]),
        alive=frozenset(d["alive"]),
        next_rank=d["next_rank"],
        codes=_ints(d["codes"]),
        errors=_ints(d["errors"]),
        killed_at=_ints(d["killed_at"]),
        fenced=_ints(d["fenced"]),
        slowdowns=_ints(d["slowdowns"]),
        reports=_ints(d["reports"], lambda r: Report(**{**r, "tainted": tuple(r["tainted"])})),
        trained=_ints(d["trained"]),
        last_step=d["last_step"],
        done_step=d["done_step"],
        joiners=frozenset(d["joiners"]),
        later=_ints(d["later"]),
        change=_change_from_dict(d["change"]) if d["change"] is not None else None,
        recoveries=tuple(d["recoveries"]),
        finishing=tuple(Finishing(**f) for f in d["finishing"]),
        migrated={k: (v[0], v[1]) for k, v in d["migrated"].items()},
        joins_done=d["joins_done"],
        scales_done=d["scales_done"],
        stopped=d["stopped"],
    )
