"""Every message on the ElasWave bus: topics, event kinds and event schemas (the wire codec
is :mod:`elaswave.bus.codec`).

This is the only module that defines event schemas. An event is a frozen, keyword-only
dataclass deriving from :class:`Event`; each class names its :class:`EventKind` and the
:class:`Topic` it is published on. On the wire an event is a two-frame ZeroMQ multipart
message::

    [topic.value.encode(), msgpack.packb({"event_kind": kind, <every dataclass field>...})]

The first frame is what SUB sockets filter on. The discriminator key is ``"event_kind"``
rather than ``"kind"`` because recovery events have a field named ``kind``; no event
class may define a field called ``event_kind``.

Schemas evolve like protobuf: new fields are appended *with defaults*, never retyped or
removed; a receiver ignores fields it does not know and refuses a ``schema_version``
newer than :data:`SCHEMA_VERSION` (its meaning may have changed).

:func:`~elaswave.bus.codec.decode` never trusts its input: every problem raises one
:class:`SchemaError` whose message names the offending value, so that the bus can log it
and skip the message.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar, TypeVar

from elaswave.bus.fields import FieldSpec, checker, type_name

SCHEMA_VERSION = 1
"""Version written into every event this code produces."""

SUPPORTED_SCHEMA_VERSIONS: frozenset[int] = frozenset(range(1, SCHEMA_VERSION + 1))
"""Versions :func:`decode` accepts; newer ones are refused."""

KIND_KEY = "event_kind"
"""Payload key holding the :class:`EventKind` value."""


class SchemaError(ValueError):
    """A message on the bus does not match any event schema this process understands."""


class Topic(enum.StrEnum):
    """Bus topics; the first frame of every message, used for SUB filtering."""

    LIFECYCLE = "lifecycle"
    METRICS = "metrics"
    HEALTH = "health"
    RECOVERY = "recovery"
    CONTROL = "control"


class EventKind(enum.StrEnum):
    """One member per event class; the ``"event_kind"`` key of every payload."""

    HELLO = "hello"
    RUN_STARTED = "run_started"
    WORKER_STARTED = "worker_started"
    WORKER_FINISHED = "worker_finished"
    RUN_FINISHED = "run_finished"
    STEP_COMPLETED = "step_completed"
    HEARTBEAT = "heartbeat"
    RECOVERY_STARTED = "recovery_started"
    RECOVERY_FINISHED = "recovery_finished"
    FAILURE_DETECTED = "failure_detected"
    RECOVERY_READY = "recovery_ready"
    RECOVERY_PLAN = "recovery_plan"
    RECOVERY_DONE = "recovery_done"
    STEP_TIMING = "step_timing"
    STRAGGLER_DETECTED = "straggler_detected"
    PAUSE_REQUEST = "pause_request"
    SCALE_REQUEST = "scale_request"
    MIGRATION_DONE = "migration_done"
    BEACON = "beacon"
    RESEND_REQUEST = "resend_request"
    PLAN_ACK = "plan_ack"
    PLAN_COMMIT = "plan_commit"
    WAITING_FOR_NODES = "waiting_for_nodes"
    CHECKPOINT_REQUEST = "checkpoint_request"
    CHECKPOINT_WRITTEN = "checkpoint_written"
    NODE_JOINED = "node_joined"
    NODE_HEARTBEAT = "node_heartbeat"
    SPAWN_WORKER = "spawn_worker"
    WORKER_SPAWNED = "worker_spawned"
    WORKER_EXITED = "worker_exited"
    SIGNAL_WORKER = "signal_worker"


class RecoveryKind(enum.StrEnum):
    """What a recovery answers: the ``kind`` of RecoveryStarted, RecoveryFinished and
    RecoveryPlan. Those fields are plain ``str`` on the wire (a member equals its value)."""

    FAIL_STOP = "fail-stop"
    """Ranks exited or were fenced."""
    FAIL_SLOW = "fail-slow"
    """The straggler detector flagged (or cleared) ranks."""
    JOIN = "join"
    """Ranks joined the job."""


CORE_SENDER = "core"
"""The Core's name on the bus."""


def sender_name(rank: int, member: int = 0) -> str:
    """A worker's name on the bus: ``rank3``, or ``rank3.1`` for TP member 1 of rank 3
    (member 0 speaks for its tensor-parallel group)."""
    return f"rank{rank}" if member == 0 else f"rank{rank}.{member}"


@dataclass(frozen=True, kw_only=True)
class Event:
    """Fields every event carries.

    ``sender`` names the publishing process (:data:`CORE_SENDER`, or
    :func:`sender_name` of a worker: ``"rank3"``); ``seq`` is the
    sender's message counter on the event's topic (stamped by the bus client, 1, 2, ...
    per topic, so that a subscriber of a topic sees every number; 0 means unsequenced);
    ``generation`` is the plan generation the sender was executing; ``time`` is the
    sender's wall clock in seconds (stamped on publish when left at 0).
    """

    KIND: ClassVar[EventKind]
    TOPIC: ClassVar[Topic]

    sender: str
    seq: int = 0
    generation: int = 0
    time: float = 0.0
    schema_version: int = SCHEMA_VERSION


_E = TypeVar("_E", bound=Event)

# kind -> class, and kind -> how to check each field when decoding.
_REGISTRY: dict[EventKind, type[Event]] = {}
_FIELD_SPECS: dict[EventKind, tuple[FieldSpec, ...]] = {}

EVENT_TYPES: Mapping[EventKind, type[Event]] = MappingProxyType(_REGISTRY)
FIELD_SPECS: Mapping[EventKind, tuple[FieldSpec, ...]] = MappingProxyType(_FIELD_SPECS)
"""Each kind's fields, checked on decoding (:mod:`elaswave.bus.codec`)."""
"""Read-only map from every :class:`EventKind` to its event class."""


def _register(cls: type[_E]) -> type[_E]:
    """Class decorator: add an event class to the registry (once per kind)."""
    kind = cls.__dict__.get("KIND")
    if not isinstance(kind, EventKind) or not isinstance(cls.__dict__.get("TOPIC"), Topic):
        raise TypeError(f"{cls.__name__} must define KIND: EventKind and TOPIC: Topic")
    hints = typing.get_type_hints(cls)
    if KIND_KEY in hints:
        raise TypeError(f"{cls.__name__} may not define a field named {KIND_KEY!r}")
    if kind in _REGISTRY:
        raise TypeError(f"event kind {kind.value!r} registered twice ({_REGISTRY[kind].__name__})")
    specs = []
    for field in dataclasses.fields(cls):
        required = (
            field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
        )
        tp = hints[field.name]
        specs.append(FieldSpec(field.name, checker(tp), type_name(tp), required))
    _REGISTRY[kind] = cls
    _FIELD_SPECS[kind] = tuple(specs)
    return cls


# --------------------------------------------------------------------------- events


@_register
@dataclass(frozen=True, kw_only=True)
class Hello(Event):
    """Bus-client handshake: a client publishes it until it hears its own ``nonce`` back."""

    KIND = EventKind.HELLO
    TOPIC = Topic.CONTROL
    nonce: str


@_register
@dataclass(frozen=True, kw_only=True)
class RunStarted(Event):
    """The core launched a training run."""

    KIND = EventKind.RUN_STARTED
    TOPIC = Topic.LIFECYCLE
    run_id: str
    world_size: int
    dp: int
    pp: int
    steps: int
    global_batch: int
    device: str
    tp: int = 1
    """Processes per (stage, replica); ``world_size`` counts processes."""


@_register
@dataclass(frozen=True, kw_only=True)
class WorkerStarted(Event):
    """A worker process joined: its rank and its place (stage, replica) in the mesh."""

    KIND = EventKind.WORKER_STARTED
    TOPIC = Topic.LIFECYCLE
    rank: int
    stage: int
    replica: int
    pid: int
    host: str
    joining: bool = False
    """A worker added to a running job: it has no place yet (stage and replica -1)."""


@_register
@dataclass(frozen=True, kw_only=True)
class WorkerFinished(Event):
    """A worker process left, cleanly (``ok``) or not (``reason`` says why)."""

    KIND = EventKind.WORKER_FINISHED
    TOPIC = Topic.LIFECYCLE
    rank: int
    ok: bool
    reason: str = ""


@_register
@dataclass(frozen=True, kw_only=True)
class RunFinished(Event):
    """The run ended after ``steps_completed`` optimizer steps."""

    KIND = EventKind.RUN_FINISHED
    TOPIC = Topic.LIFECYCLE
    steps_completed: int
    ok: bool
    reason: str = ""


@_register
@dataclass(frozen=True, kw_only=True)
class StepCompleted(Event):
    """A rank finished optimizer step ``step``."""

    KIND = EventKind.STEP_COMPLETED
    TOPIC = Topic.METRICS
    rank: int
    step: int
    loss: float
    step_time_s: float
    samples: int


@_register
@dataclass(frozen=True, kw_only=True)
class Heartbeat(Event):
    """Periodic liveness signal from a rank."""

    KIND = EventKind.HEARTBEAT
    TOPIC = Topic.HEALTH
    rank: int
    step: int


@_register
@dataclass(frozen=True, kw_only=True)
class StepTiming(Event):
    """How long a rank's compute took in one step, for the fail-slow detector.

    ``compute_s`` is forward plus backward seconds over the step's ``micro_batches``
    (modelled under ``--device emulated``, else measured); ``expected_s`` is the cost
    model's time for the same work at the nominal clock without slowdown (0 when the
    rank has no model of its device).
    """

    KIND = EventKind.STEP_TIMING
    TOPIC = Topic.HEALTH
    rank: int
    step: int
    compute_s: float
    expected_s: float
    micro_batches: int
    overruns: int = 0
    """Emulated compute blocks whose real compute overran the model (see
    :mod:`elaswave.runtime.worker.emulation`)."""


@_register
@dataclass(frozen=True, kw_only=True)
class RecoveryStarted(Event):
    """A recovery of ``kind`` (a :class:`RecoveryKind`) began for ``ranks``."""

    KIND = EventKind.RECOVERY_STARTED
    TOPIC = Topic.RECOVERY
    step: int
    kind: str
    ranks: list[int]
    reason: str


@_register
@dataclass(frozen=True, kw_only=True)
class RecoveryFinished(Event):
    """A recovery ended: the redone step completed. ``mttr_s``: seconds from the failure
    (the kill when known, else its detection) to that completion."""

    KIND = EventKind.RECOVERY_FINISHED
    TOPIC = Topic.RECOVERY
    step: int
    kind: str
    ranks: list[int]
    mttr_s: float
    joined: list[int] = dataclasses.field(default_factory=list)
    """Ranks the change added (a join's, or joiners a waiting recovery planned with)."""


# The fail-stop protocol. ``generation`` (base field) is the plan generation the event
# refers to: the failing one for FailureDetected/RecoveryReady, the new one afterwards.


@_register
@dataclass(frozen=True, kw_only=True)
class FailureDetected(Event):
    """The Core declares ``ranks`` dead; every survivor abandons its step."""

    KIND = EventKind.FAILURE_DETECTED
    TOPIC = Topic.RECOVERY
    ranks: list[int]
    source: str
    """How it was detected: "process-exit", "heartbeat", "comm-error"."""
    detail: str = ""


@_register
@dataclass(frozen=True, kw_only=True)
class StragglerDetected(Event):
    """The fail-slow detector's verdict changed: ``ranks`` are slow by ``factors`` (the
    same order); ``recovered`` are back to normal speed."""

    KIND = EventKind.STRAGGLER_DETECTED
    TOPIC = Topic.HEALTH
    step: int
    ranks: list[int]
    factors: list[float]
    recovered: list[int] = dataclasses.field(default_factory=list)
    reason: str = ""


@_register
@dataclass(frozen=True, kw_only=True)
class PauseRequest(Event):
    """Every worker stops at the boundary after committing ``after_step`` (a worker
    already in a later step abandons it) and reports with RecoveryReady; a RecoveryPlan
    follows. For planned changes: fail-slow rebalancing, scale-up."""

    KIND = EventKind.PAUSE_REQUEST
    TOPIC = Topic.RECOVERY
    after_step: int
    reason: str = ""


@_register
@dataclass(frozen=True, kw_only=True)
class ScaleRequest(Event):
    """Someone (``elaswave scale``) asks the Core to add ``add`` workers to the job."""

    KIND = EventKind.SCALE_REQUEST
    TOPIC = Topic.CONTROL
    add: int
    reason: str = ""


@_register
@dataclass(frozen=True, kw_only=True)
class RecoveryReady(Event):
    """A survivor has stopped at a step boundary; its last committed step."""

    KIND = EventKind.RECOVERY_READY
    TOPIC = Topic.RECOVERY
    rank: int
    committed_step: int
    tainted: list[str] = dataclasses.field(default_factory=list)
    """Groups of this rank with a collective that did not complete."""
    params_step: int = -2
    """The step whose update this rank's parameters hold (-1: the initial ones; -2:
    unknown, e.g. a layer still streaming in)."""
    newest_step: int = -2
    """With tp > 1, the newest step a TP member of this rank committed when it is newer
    than ``committed_step`` (the members' earliest): that member keeps no step before
    ``newest_step - 1``, so neither can the rank roll back further. -2 when the members
    agree (and without TP)."""


@_register
@dataclass(frozen=True, kw_only=True)
class RecoveryPlan(Event):
    """The Core's decision. Workers recompute the plan from these inputs with the same
    pure planner and check ``plan_digest`` before applying it."""

    KIND = EventKind.RECOVERY_PLAN
    TOPIC = Topic.RECOVERY
    failed: list[int]
    committed_step: int
    plan_digest: str
    reason: str
    rebuild: list[str] = dataclasses.field(default_factory=list)
    """Surviving groups to rebuild (tainted on some member); all others are reused."""
    policy: str = "resize"
    """The throughput planner's policy (see :mod:`elaswave.engine.rebalance`)."""
    slow_ranks: list[int] = dataclasses.field(default_factory=list)
    """Ranks the straggler detector measured as slow ..."""
    slow_factors: list[float] = dataclasses.field(default_factory=list)
    """... and their slowdown factors, in the same order."""
    kind: str = RecoveryKind.FAIL_STOP.value
    """What the plan answers (a :class:`RecoveryKind`)."""
    joined: list[int] = dataclasses.field(default_factory=list)
    """Ranks joining the job (they read the current plan from the store)."""
    stale: list[int] = dataclasses.field(default_factory=list)
    """Survivors whose parameters are not those of ``committed_step``: layers migrate
    blocking, after a gather (see :mod:`elaswave.engine.migration`)."""
    attempt: int = 0
    """0 for a generation's first announcement; a later one (same generation) supersedes
    it: a participant did not acknowledge in time, or failed before the commit."""
    migration: str = "none"
    """How layers move, decided once by the Core: ``none``, ``blocking`` (gathered before
    resuming) or ``nonblocking`` (streamed during the transition step); workers follow
    it, replay checks it."""


@_register
@dataclass(frozen=True, kw_only=True)
class WaitingForNodes(Event):
    """Too few ranks are left to form a pipeline: every stopped member keeps its state in
    memory and waits (up to ``wait_s`` seconds from ``since``) for joiners; a
    RecoveryPlan of ``generation`` follows, or the job stops naming how to resume. Sent
    again when a joiner arrives and more are still needed."""

    KIND = EventKind.WAITING_FOR_NODES
    TOPIC = Topic.RECOVERY
    needed: int
    """Ranks still missing to fill every stage."""
    wait_s: float
    since: float
    """Core wall-clock time the wait began."""
    reason: str


@_register
@dataclass(frozen=True, kw_only=True)
class CheckpointRequest(Event):
    """A wait for joiners ran out: before the job stops, the stopped members write a
    checkpoint of ``step`` from what they hold in memory. ``owners[i]``'s shard is
    written by ``writers[i]``: its own state, or the host snapshot it holds of a lost
    (or a step ahead) owner; ``--resume`` then continues the job from it."""

    KIND = EventKind.CHECKPOINT_REQUEST
    TOPIC = Topic.RECOVERY
    step: int
    owners: list[int]
    writers: list[int]


@_register
@dataclass(frozen=True, kw_only=True)
class CheckpointWritten(Event):
    """A member wrote its part of the checkpoint a CheckpointRequest asked for."""

    KIND = EventKind.CHECKPOINT_WRITTEN
    TOPIC = Topic.RECOVERY
    rank: int
    step: int
    owners: list[int]


@_register
@dataclass(frozen=True, kw_only=True)
class RecoveryDone(Event):
    """A survivor applied the plan; seconds spent per executor phase."""

    KIND = EventKind.RECOVERY_DONE
    TOPIC = Topic.RECOVERY
    rank: int
    comm_s: float
    remap_s: float
    resume_s: float
    bytes_sent: int = 0
    """Optimizer-state bytes this rank sent (live remap and layer migration)."""
    params_s: float = 0.0
    """Of ``remap_s``, seconds spent delivering parameters before resuming (a gather,
    and a blocking layer migration's copy); non-blocking migration streams them later."""


@_register
@dataclass(frozen=True, kw_only=True)
class MigrationDone(Event):
    """A rank finished the transition step of a non-blocking layer migration."""

    KIND = EventKind.MIGRATION_DONE
    TOPIC = Topic.RECOVERY
    rank: int
    step: int
    early: int
    """Micro-batches that ran on the old layer placement (shadows on the sources)."""
    bytes_streamed: int
    """Parameter-stream and payback bytes this rank sent."""
    waited_s: float
    """Seconds the step waited for incoming layer parameters."""


# Delivery (see :mod:`elaswave.bus.reliable`).


@_register
@dataclass(frozen=True, kw_only=True)
class Beacon(Event):
    """A sender's last ``seq`` on each reliable topic, published every beacon interval,
    so that a receiver learns of a lost message even when nothing follows it."""

    KIND = EventKind.BEACON
    TOPIC = Topic.CONTROL
    topics: list[str]
    seqs: list[int]
    """Last seq per topic of ``topics``, in the same order."""


@_register
@dataclass(frozen=True, kw_only=True)
class ResendRequest(Event):
    """Asks ``target`` to publish again its messages ``seqs`` of ``topic`` (kept in its
    sent history); the Core asks for what it missed, since no one holds a log above it."""

    KIND = EventKind.RESEND_REQUEST
    TOPIC = Topic.CONTROL
    target: str
    topic: str
    seqs: list[int]


@_register
@dataclass(frozen=True, kw_only=True)
class PlanAck(Event):
    """A participant recomputed the announced plan, found ``plan_digest``, and is ready to
    apply it once the Core commits it."""

    KIND = EventKind.PLAN_ACK
    TOPIC = Topic.RECOVERY
    rank: int
    plan_digest: str
    attempt: int = 0


@_register
@dataclass(frozen=True, kw_only=True)
class PlanCommit(Event):
    """Every participant acknowledged the plan ``plan_digest`` of ``generation``: apply it.
    An announcement that is never committed is superseded by a later one."""

    KIND = EventKind.PLAN_COMMIT
    TOPIC = Topic.RECOVERY
    plan_digest: str
    attempt: int = 0


# -- Node agents (one per host of a multi-host job; node 0's job host talks to them) --


@_register
@dataclass(frozen=True, kw_only=True)
class NodeJoined(Event):
    """A host's agent is up and offers ``slots`` worker processes; ``incarnation``
    names this start of it (a host that returns comes back with a new one)."""

    KIND = EventKind.NODE_JOINED
    TOPIC = Topic.CONTROL
    node: int
    slots: int
    incarnation: str
    host: str = ""


@_register
@dataclass(frozen=True, kw_only=True)
class NodeHeartbeat(Event):
    """Periodic liveness of a host's agent: its silence is the loss of the host."""

    KIND = EventKind.NODE_HEARTBEAT
    TOPIC = Topic.HEALTH
    node: int
    incarnation: str


@_register
@dataclass(frozen=True, kw_only=True)
class SpawnWorker(Event):
    """Node 0's job host asks the agent ``(node, incarnation)`` to start worker ``rank``
    (``join``: a worker added to the running job)."""

    KIND = EventKind.SPAWN_WORKER
    TOPIC = Topic.CONTROL
    node: int
    incarnation: str
    rank: int
    join: bool = False


@_register
@dataclass(frozen=True, kw_only=True)
class WorkerSpawned(Event):
    """An agent started worker ``rank`` as process ``pid``, or could not (``error``)."""

    KIND = EventKind.WORKER_SPAWNED
    TOPIC = Topic.CONTROL
    node: int
    rank: int
    pid: int = 0
    error: str = ""


@_register
@dataclass(frozen=True, kw_only=True)
class WorkerExited(Event):
    """Worker ``rank`` of an agent's host exited with ``code`` (``-signal`` for a
    signal)."""

    KIND = EventKind.WORKER_EXITED
    TOPIC = Topic.CONTROL
    node: int
    rank: int
    code: int


@_register
@dataclass(frozen=True, kw_only=True)
class SignalWorker(Event):
    """Node 0's job host asks an agent to send ``signal`` to worker ``rank``."""

    KIND = EventKind.SIGNAL_WORKER
    TOPIC = Topic.CONTROL
    node: int
    rank: int
    signal: int


_missing_kinds = set(EventKind) - set(_REGISTRY)
assert not _missing_kinds, f"event kinds without a class: {_missing_kinds}"
