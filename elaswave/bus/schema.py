"""Every message on the ElasWave bus: topics, event kinds and event schemas (the wire codec
is :mod:`elaswave.bus.codec`; what every event shares, :mod:`elaswave.bus.envelope`,
is re-exported here).

This is the only module that defines event schemas. An event is a frozen, keyword-only
dataclass deriving from :class:`Event`; each class names its :class:`EventKind` and the
:class:`Topic` it is published on. On the wire an event is a two-frame ZeroMQ multipart
message::

    [f"{topic.value}/{sender}".encode(), msgpack.packb({"event_kind": kind, <every field>...})]

The first frame is what SUB sockets filter on: a topic's every message (``b"control/"``)
or one sender's (``b"control/core"``); logs written before senders were named there
carry ``topic.value`` alone, and decode as well. The discriminator key is ``"event_kind"``
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
from dataclasses import dataclass

from elaswave.bus.envelope import CORE_SENDER as CORE_SENDER
from elaswave.bus.envelope import EVENT_TYPES as EVENT_TYPES
from elaswave.bus.envelope import FIELD_SPECS as FIELD_SPECS
from elaswave.bus.envelope import KIND_KEY as KIND_KEY
from elaswave.bus.envelope import NODES_SENDER as NODES_SENDER
from elaswave.bus.envelope import SCHEMA_VERSION as SCHEMA_VERSION
from elaswave.bus.envelope import SUPPORTED_SCHEMA_VERSIONS as SUPPORTED_SCHEMA_VERSIONS
from elaswave.bus.envelope import Event as Event
from elaswave.bus.envelope import EventKind as EventKind
from elaswave.bus.envelope import SchemaError as SchemaError
from elaswave.bus.envelope import Topic as Topic
from elaswave.bus.envelope import register
from elaswave.bus.envelope import sender_name as sender_name


class RecoveryKind(enum.StrEnum):
    """What a recovery answers: the ``kind`` of RecoveryStarted, RecoveryFinished and
    RecoveryPlan. Those fields are plain ``str`` on the wire (a member equals its value)."""

    FAIL_STOP = "fail-stop"
    """Ranks exited or were fenced."""
    FAIL_SLOW = "fail-slow"
    """The straggler detector flagged (or cleared) ranks."""
    JOIN = "join"
    """Ranks joined the job."""


# --------------------------------------------------------------------------- events


@register
@dataclass(frozen=True, kw_only=True)
class Hello(Event):
    """Bus-client handshake: a client publishes it until it hears its own ``nonce`` back."""

    KIND = EventKind.HELLO
    TOPIC = Topic.CONTROL
    nonce: str


@register
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


@register
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
    local_rank: int = -1
    """Which of its host's devices the host gave it (its ``LOCAL_RANK``): the lowest
    that no running worker of the host holds. -1 in logs written before it was recorded."""
    device: str = ""
    """The device it trains on (``cuda:3``; ``cpu`` for every CPU rank); a TP group's
    other members have their own beside it."""


@register
@dataclass(frozen=True, kw_only=True)
class WorkerFinished(Event):
    """A worker process left, cleanly (``ok``) or not (``reason`` says why)."""

    KIND = EventKind.WORKER_FINISHED
    TOPIC = Topic.LIFECYCLE
    rank: int
    ok: bool
    reason: str = ""


@register
@dataclass(frozen=True, kw_only=True)
class RunFinished(Event):
    """The run ended after ``steps_completed`` optimizer steps."""

    KIND = EventKind.RUN_FINISHED
    TOPIC = Topic.LIFECYCLE
    steps_completed: int
    ok: bool
    reason: str = ""


@register
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
    lr: float = 0.0
    """The step's learning rate (0.0 from senders before it)."""
    grad_norm: float = -1.0
    """The step's global gradient norm before clipping; negative where the job does not
    clip gradients."""
    eval_loss: float = -1.0
    """The held-out loss of the step's parameters; negative where the step did not
    evaluate (``--eval-every``)."""

    @property
    def evaluated(self) -> bool:
        """Whether the step evaluated the held-out loss (``eval_loss`` is its)."""
        return self.eval_loss >= 0

    @property
    def clipped(self) -> bool:
        """Whether the job clips gradients (``grad_norm`` is the step's)."""
        return self.grad_norm >= 0


@register
@dataclass(frozen=True, kw_only=True)
class Heartbeat(Event):
    """Periodic liveness signal from a rank."""

    KIND = EventKind.HEARTBEAT
    TOPIC = Topic.HEALTH
    rank: int
    step: int


@register
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


@register
@dataclass(frozen=True, kw_only=True)
class RecoveryStarted(Event):
    """A recovery of ``kind`` (a :class:`RecoveryKind`) began for ``ranks``."""

    KIND = EventKind.RECOVERY_STARTED
    TOPIC = Topic.RECOVERY
    step: int
    kind: str
    ranks: list[int]
    reason: str


@register
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


@register
@dataclass(frozen=True, kw_only=True)
class FailureDetected(Event):
    """The Core declares ``ranks`` dead; every survivor abandons its step."""

    KIND = EventKind.FAILURE_DETECTED
    TOPIC = Topic.RECOVERY
    ranks: list[int]
    source: str
    """How it was detected: "process-exit", "heartbeat", "comm-error"."""
    detail: str = ""
    rollback: bool = False
    """A participant failed while the plan after ``generation`` was applied: that plan
    is taken back, and every member rolls back to the state it committed under the
    plan before it (``generation``'s layout: what it kept while applying) and reports
    that state's step."""


@register
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


@register
@dataclass(frozen=True, kw_only=True)
class PauseRequest(Event):
    """Every worker stops at the boundary after committing ``after_step`` (a worker
    already in a later step abandons it) and reports with RecoveryReady; a RecoveryPlan
    follows. For planned changes: fail-slow rebalancing, scale-up."""

    KIND = EventKind.PAUSE_REQUEST
    TOPIC = Topic.RECOVERY
    after_step: int
    reason: str = ""


@register
@dataclass(frozen=True, kw_only=True)
class ScaleRequest(Event):
    """Someone (``elaswave scale``) asks the Core to add ``add`` workers to the job."""

    KIND = EventKind.SCALE_REQUEST
    TOPIC = Topic.CONTROL
    add: int
    reason: str = ""


@register
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
    torn: bool = False
    """This rank was applying the plan after ``generation`` when a participant failed
    (the change rolls it back to the state it committed before; for the log)."""


@register
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
    restore: bool = False
    """State was lost: every participant loads its part of the disk checkpoint of
    ``committed_step`` (instead of rolling back and remapping), and the job trains the
    steps after it again."""
    rollback: bool = False
    """The change rolls back a torn apply (see FailureDetected.rollback): its plan is
    planned from the layout before the torn plan, under the torn plan's generation."""
    shorten: bool = False
    """A wait for joiners ran out: the plan may have fewer stages than the one before
    (a job that waits keeps its stages otherwise)."""


@register
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


@register
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


@register
@dataclass(frozen=True, kw_only=True)
class CheckpointWritten(Event):
    """A member wrote its part of the checkpoint a CheckpointRequest asked for (a TP
    group's leader says so once every member of the group wrote its slices)."""

    KIND = EventKind.CHECKPOINT_WRITTEN
    TOPIC = Topic.RECOVERY
    rank: int
    step: int
    owners: list[int]


@register
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
    communicators: int = 0
    """Process groups the rank holds open under the new plan: its device groups, its
    pooled host links and its TP group (0: not reported)."""


@register
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


@register
@dataclass(frozen=True, kw_only=True)
class Beacon(Event):
    """A sender's last ``seq`` on each reliable topic, published every beacon interval,
    so that a receiver learns of a lost message even when nothing follows it."""

    KIND = EventKind.BEACON
    TOPIC = Topic.CONTROL
    NUMBERED = False  # the next beacon replaces a lost one
    topics: list[str]
    seqs: list[int]
    """Last seq per topic of ``topics``, in the same order."""


@register
@dataclass(frozen=True, kw_only=True)
class ResendRequest(Event):
    """Asks ``target`` to publish again its messages ``seqs`` of ``topic`` (kept in its
    sent history); the Core asks for what it missed, since no one holds a log above it."""

    KIND = EventKind.RESEND_REQUEST
    TOPIC = Topic.CONTROL
    target: str
    topic: str
    seqs: list[int]


@register
@dataclass(frozen=True, kw_only=True)
class PlanAck(Event):
    """A participant recomputed the announced plan, found ``plan_digest``, and is ready to
    apply it once the Core commits it."""

    KIND = EventKind.PLAN_ACK
    TOPIC = Topic.RECOVERY
    rank: int
    plan_digest: str
    attempt: int = 0


@register
@dataclass(frozen=True, kw_only=True)
class PlanCommit(Event):
    """Every participant acknowledged the plan ``plan_digest`` of ``generation``: apply it.
    An announcement that is never committed is superseded by a later one."""

    KIND = EventKind.PLAN_COMMIT
    TOPIC = Topic.RECOVERY
    plan_digest: str
    attempt: int = 0


# -- Node agents (one per host of a multi-host job; node 0's job host talks to them) --


@register
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


@register
@dataclass(frozen=True, kw_only=True)
class NodeHeartbeat(Event):
    """Periodic liveness of a host's agent: its silence is the loss of the host."""

    KIND = EventKind.NODE_HEARTBEAT
    TOPIC = Topic.HEALTH
    node: int
    incarnation: str


@register
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


@register
@dataclass(frozen=True, kw_only=True)
class WorkerSpawned(Event):
    """An agent started worker ``rank`` as process ``pid``, or could not (``error``)."""

    KIND = EventKind.WORKER_SPAWNED
    TOPIC = Topic.CONTROL
    node: int
    rank: int
    pid: int = 0
    error: str = ""


@register
@dataclass(frozen=True, kw_only=True)
class WorkerExited(Event):
    """Worker ``rank`` of an agent's host exited with ``code`` (``-signal`` for a
    signal)."""

    KIND = EventKind.WORKER_EXITED
    TOPIC = Topic.CONTROL
    node: int
    rank: int
    code: int


@register
@dataclass(frozen=True, kw_only=True)
class SignalWorker(Event):
    """Node 0's job host asks an agent to send ``signal`` to worker ``rank``."""

    KIND = EventKind.SIGNAL_WORKER
    TOPIC = Topic.CONTROL
    node: int
    rank: int
    signal: int


_missing_kinds = set(EventKind) - set(EVENT_TYPES)
assert not _missing_kinds, f"event kinds without a class: {_missing_kinds}"
