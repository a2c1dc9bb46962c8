"""The Core: hosts the bus broker and records every event the job publishes.

Every message the Core's subscriber sees, valid or not, is appended raw to
RUN_DIR/events.log (``elaswave events RUN_DIR`` prints it); invalid messages are reported
and skipped, never fatal. User code and the CLI observe the run through ``on_event``.

The Core is also the bus's memory: its log service (:mod:`elaswave.bus.logservice`)
serves workers the messages they missed, and its own client repairs its gaps by asking
senders to publish again (:mod:`elaswave.bus.reliable`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from elaswave.bus.broker import Broker
from elaswave.bus.client import BusClient
from elaswave.bus.eventlog import EventLogWriter
from elaswave.bus.keys import BusKeys
from elaswave.bus.logservice import LogIndex, LogService
from elaswave.bus.reliable import BusFaults
from elaswave.bus.schema import (
    Event,
    Heartbeat,
    MigrationDone,
    PlanAck,
    RecoveryDone,
    RecoveryReady,
    RunFinished,
    ScaleRequest,
    StepCompleted,
    StepTiming,
    WorkerFinished,
    WorkerStarted,
    encode,
)

log = structlog.get_logger(__name__)

EVENT_LOG = "events.log"


class Core:
    def __init__(
        self,
        run_dir: Path,
        *,
        on_event: Callable[[Event], None] | None = None,
        host: str = "127.0.0.1",
        keys: BusKeys | None = None,
        faults: BusFaults | None = None,
    ) -> None:
        """``host``/``keys``: where the bus binds, and its CURVE keys (required beyond
        loopback, :mod:`elaswave.bus.keys`); ``faults``: injected into what it receives."""
        self.run_dir = run_dir
        self.on_event = on_event
        self.keys = keys
        self.faults = faults
        self.broker = Broker(host, keys=keys)
        self.index = LogIndex()
        self.log_service = LogService(self.index, host, keys=keys)
        self.num_events = 0
        self.num_rejected = 0
        self.finished: dict[int, WorkerFinished] = {}
        self.run_finished: RunFinished | None = None
        self.last_heartbeat: dict[int, float] = {}
        """rank -> monotonic time its last heartbeat arrived."""
        self.recovery_events: list[Event] = []
        """RecoveryReady, PlanAck, RecoveryDone and MigrationDone events, for the
        supervisor's protocol."""
        self.steps_completed: list[tuple[int, float]] = []
        """(step, wall time it arrived) of every StepCompleted, in arrival order."""
        self.step_timings: list[StepTiming] = []
        """Every StepTiming, in arrival order (the fail-slow detector's input)."""
        self.trained_generation: dict[int, int] = {}
        """rank -> the latest plan generation it has trained a step under."""
        self.scale_requests: list[ScaleRequest] = []
        """Requests to add workers (``elaswave scale``), in arrival order."""
        self.joining: list[WorkerStarted] = []
        """WorkerStarted of every worker that joined the running job."""
        self._client: BusClient | None = None
        self._writer: EventLogWriter | None = None
        self._maintain: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()

    @property
    def publish_endpoint(self) -> str:
        return self.broker.publish_endpoint

    @property
    def subscribe_endpoint(self) -> str:
        return self.broker.subscribe_endpoint

    @property
    def fetch_endpoint(self) -> str:
        return self.log_service.endpoint

    @property
    def client(self) -> BusClient:
        assert self._client is not None, "Core used outside its context"
        return self._client

    async def __aenter__(self) -> Core:
        self.broker.start()
        self.log_service.start()
        self._writer = EventLogWriter(self.run_dir / EVENT_LOG)
        self._client = BusClient(
            "core",
            self.broker.publish_endpoint,
            self.broker.subscribe_endpoint,
            keys=self.keys,
            from_start=True,  # every other process connects after the Core
            faults=self.faults,
        )
        await self._client.connect()
        self._maintain = asyncio.create_task(self._client.maintain(), name="core-delivery")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._maintain is not None:
            self._maintain.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._maintain
        if self._client is not None:
            await self._client.close()
        if self._writer is not None:
            self._writer.close()
        self.log_service.close()
        self.broker.close()

    async def publish(self, event: Event) -> Event:
        """Publish ``event`` as the Core; it is in the log service from this moment."""
        assert self._client is not None, "Core used outside its context"
        sent = await self._client.publish(event)
        self.index.add(sent.sender, sent.TOPIC.value, sent.seq, encode(sent))
        return sent

    async def listen(self) -> None:
        """Record and dispatch events until cancelled."""
        assert self._client is not None, "Core used outside its context"
        assert self._writer is not None, "Core used outside its context"
        while True:
            frames, event, _error = await self._client.recv_raw()
            self._writer.append(frames, time.time())
            self.num_events += 1
            if event is None:  # the client has logged why; the raw frames are in the log
                self.num_rejected += 1
                continue
            self.index.add(event.sender, event.TOPIC.value, event.seq, frames)
            if isinstance(event, Heartbeat):
                self.last_heartbeat[event.rank] = time.monotonic()
            elif isinstance(event, WorkerFinished):
                self.finished[event.rank] = event
            elif isinstance(event, RunFinished):
                self.run_finished = event
            elif isinstance(event, RecoveryReady | RecoveryDone | MigrationDone | PlanAck):
                self.recovery_events.append(event)
            elif isinstance(event, StepCompleted):
                self.steps_completed.append((event.step, time.time()))
            elif isinstance(event, StepTiming):
                self.step_timings.append(event)
                trained = self.trained_generation.get(event.rank, -1)
                self.trained_generation[event.rank] = max(trained, event.generation)
            elif isinstance(event, ScaleRequest):
                self.scale_requests.append(event)
            elif isinstance(event, WorkerStarted) and event.joining:
                self.joining.append(event)
            if self.on_event is not None:
                try:
                    self.on_event(event)
                except Exception:
                    log.exception("core.on_event_failed", kind=str(event.KIND))
            self._changed.set()

    async def wait_until(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Wait until ``predicate()`` holds, or the timeout passes.

        It is re-checked after every event and at least every 0.1 s, so predicates may
        also watch state that no event announces (a process's exit code).
        """
        # An explicit deadline, not an outer asyncio.timeout: on Python 3.11 an inner
        # wait_for whose own timeout fires together with the outer cancellation turns it
        # into a TimeoutError, which the loop would swallow and then wait on forever.
        deadline = time.monotonic() + timeout_s
        while not predicate():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(0.1, left))
        return True
