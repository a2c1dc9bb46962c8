"""The event bus: typed event schemas over a ZeroMQ XSUB/XPUB broker.

``schema`` defines every message; ``broker`` forwards them; ``client`` publishes and
receives them from asyncio code; ``eventlog`` records them for replay and reading.
Synchronous code embeds the bus through :class:`elaswave.bus.session.Session`.
"""

from elaswave.bus.broker import Broker
from elaswave.bus.client import BusClient, BusError, RawMessage
from elaswave.bus.codec import decode, encode, with_seq
from elaswave.bus.eventlog import EventLogWriter, LogRecord, format_record, read_event_log
from elaswave.bus.schema import (
    EVENT_TYPES,
    SCHEMA_VERSION,
    SUPPORTED_SCHEMA_VERSIONS,
    Event,
    EventKind,
    Heartbeat,
    Hello,
    MigrationDone,
    PauseRequest,
    RecoveryFinished,
    RecoveryStarted,
    RunFinished,
    RunStarted,
    ScaleRequest,
    SchemaError,
    StepCompleted,
    StepTiming,
    StragglerDetected,
    Topic,
    WorkerFinished,
    WorkerStarted,
)

__all__ = [
    "EVENT_TYPES",
    "SCHEMA_VERSION",
    "SUPPORTED_SCHEMA_VERSIONS",
    "Broker",
    "BusClient",
    "BusError",
    "Event",
    "EventKind",
    "EventLogWriter",
    "Heartbeat",
    "Hello",
    "LogRecord",
    "MigrationDone",
    "PauseRequest",
    "RawMessage",
    "RecoveryFinished",
    "RecoveryStarted",
    "RunFinished",
    "RunStarted",
    "ScaleRequest",
    "SchemaError",
    "StepCompleted",
    "StepTiming",
    "StragglerDetected",
    "Topic",
    "WorkerFinished",
    "WorkerStarted",
    "decode",
    "encode",
    "format_record",
    "read_event_log",
    "with_seq",
]
