"""What every message on the ElasWave bus shares: its topic, its kind, the base fields of
:class:`Event`, the schema version, and the registry that maps a kind to its class.

The event classes themselves, and the wire format, are in :mod:`elaswave.bus.schema`
(which re-exports everything here): an event class derives from :class:`Event`, names its
:class:`EventKind` and :class:`Topic`, and is added to the registry by :func:`register`,
which also records how :mod:`elaswave.bus.codec` checks each of its fields.
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
"""Versions :func:`~elaswave.bus.codec.decode` accepts; newer ones are refused."""

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


CORE_SENDER = "core"
"""The Core's name on the bus."""
NODES_SENDER = "host-nodes"
"""The name on the bus of node 0's view of a multi-host job's hosts: it asks the other
hosts' agents to start and signal workers (SpawnWorker, SignalWorker)."""


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
    NUMBERED: ClassVar[bool] = True
    """Whether the bus client numbers it (``seq``) on a reliable topic. A kind whose lost
    message the next one replaces (a beacon) goes out unnumbered: numbered, it took a
    number that a receiver then had to repair when it was lost, and that a restarted
    Core had to find in the event log."""

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
"""Read-only map from every :class:`EventKind` to its event class."""
FIELD_SPECS: Mapping[EventKind, tuple[FieldSpec, ...]] = MappingProxyType(_FIELD_SPECS)
"""Each kind's fields, checked on decoding (:mod:`elaswave.bus.codec`)."""


def register(cls: type[_E]) -> type[_E]:
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
