"""The Core: hosts the bus broker and records every event the job publishes.

Every message the Core's subscriber sees, valid or not, is appended raw to
RUN_DIR/events.log (``elaswave events RUN_DIR`` prints it), but for the liveness
plumbing (:meth:`Core._sink`): beacons are not logged, and the chatter no one reads back
(the step timings that tell the change protocol nothing new, node agents' heartbeats,
and of a sender's heartbeats one every :data:`BEAT_LOG_S` after its first) goes to the
rolling log RUN_DIR/health, which keeps its newest records only
(:mod:`elaswave.bus.rolling`); invalid messages are reported and skipped, never fatal.
User code and the CLI observe the run through ``on_event``.

The supervisor reads the run through a small API: :meth:`Core.protocol_events` (the
events the change protocol takes, a predecessor's first), :meth:`Core.forget_worker`
(an exited worker's missing messages will never come), :meth:`Core.reset_silence` (a
period the Core did not watch), and the state :meth:`Core._dispatch` keeps
(``last_heartbeat``, ``step_timings``, ``announcements``, ``finished``).

The Core is also the bus's memory: its log service (:mod:`elaswave.bus.logservice`)
serves workers the messages they missed, and its own client repairs its gaps by asking
senders to publish again (:mod:`elaswave.bus.reliable`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import msgpack
import structlog

from elaswave.bus.broker import Broker
from elaswave.bus.client import BusClient
from elaswave.bus.codec import decode
from elaswave.bus.eventlog import EventLogWriter
from elaswave.bus.keys import BusKeys
from elaswave.bus.logservice import LogIndex, LogService
from elaswave.bus.reliable import BusFaults
from elaswave.bus.rolling import RollingLogWriter
from elaswave.bus.schema import (
    CORE_SENDER,
    Beacon,
    Event,
    FailureDetected,
    Heartbeat,
    Hello,
    NodeHeartbeat,
    PauseRequest,
    PlanCommit,
    RecoveryPlan,
    RunFinished,
    ScaleRequest,
    SchemaError,
    StepTiming,
    WorkerFinished,
    WorkerStarted,
    sender_name,
)
from elaswave.rundir import EVENT_LOG, HEALTH_LOG, RESTORE_POINT
from elaswave.runtime.core.observe import NewTimings, takes
from elaswave.runtime.core.restorepoint import (
    RECENT_FRAMES,
    RESTORE_EVERY,
    Carried,
    RestorePoint,
    log_tail,
    read_point,
    write_point,
)

log = structlog.get_logger(__name__)

BEAT_LOG_S = 5.0
"""A sender's heartbeats the logs keep: its first (in the event log: a restarted Core
learns a TP group's members from it), then one every this many seconds (in the health
log). Every worker beats five times a second and beacons four: with both logged whole
they were nine records in ten of a steady job's log (about 10 GB a day at 64 ranks), all
read back by a restarted Core. What a heartbeat proves is in the log all the same: a rank
fenced as hung has its FailureDetected name the seconds it was silent."""


class Sink(enum.Enum):
    """Where the Core logs a message (:meth:`Core._sink`)."""

    EVENTS = "events"
    """The event log: kept for the run's life, read back by restore, replay, the summary."""
    HEALTH = "health"
    """The health log: liveness and timing chatter, its newest records kept."""
    NOWHERE = "nowhere"
    """Not logged: beacons, and heartbeats between those kept."""


HEALTH_CHATTER = (StepTiming, NodeHeartbeat)
"""What goes to the health log: every node agent's heartbeats (five a second a node) and
the step timings that tell the change protocol nothing new
(:class:`~elaswave.runtime.core.observe.NewTimings`): every
rank's timing of every step was nine records in ten of a steady job's event log (1.2 GB
a day at 64 ranks and a step a second), and a slowdown the Core acts on is in its
StragglerDetected. No restore, replay or summary reads them."""

HEALTH_KEEP_BYTES = 1 << 30
"""What the health log keeps by default (``--health-log-mib``)."""

MAX_PENDING_TIMINGS = 1 << 16
"""StepTiming reports the Core holds for the fail-slow watch to take; past this the
oldest go. The watch takes them ten times a second; a job that does not detect
stragglers takes none, and the Core kept every report of the run before (some 500 bytes
each: 19 GB over a week of a 64-rank job at a step a second)."""


@dataclass(frozen=True)
class Arrival:
    """An event the change protocol takes, as the Core logged it."""

    event: Event
    t: float
    """When it arrived (wall-clock seconds)."""
    position: int
    """Its record's position in the event log (the log's length in bytes with it): a
    state that has taken it in is persisted with this, and a restarted Core reads back
    the protocol's events after it only (:meth:`Core.restore`)."""


class ProtocolEvents:
    """The events the change protocol takes, as they arrive (an async iterator): those
    read back from a predecessor's event log first. Bounded: while it is full the
    Core's listener waits (it slows the bus rather than dropping an event)."""

    def __init__(self, backlog: list[Arrival]) -> None:
        self._backlog = collections.deque(backlog)
        self._queue: asyncio.Queue[Arrival] = asyncio.Queue(maxsize=1024)

    def __aiter__(self) -> ProtocolEvents:
        return self

    async def __anext__(self) -> Arrival:
        if self._backlog:
            return self._backlog.popleft()
        return await self._queue.get()

    async def put(self, arrival: Arrival) -> None:
        await self._queue.put(arrival)


@dataclass(frozen=True)
class CorePorts:
    """The ports a Core binds (0: any free port): a restarted Core binds its
    predecessor's, so every worker's connections find it again."""

    publish: int = 0
    subscribe: int = 0
    fetch: int = 0

    @classmethod
    def of(cls, publish: str, subscribe: str, fetch: str) -> CorePorts:
        """The ports of ``tcp://host:port`` endpoints."""
        return cls(*(int(e.rsplit(":", 1)[1]) if e else 0 for e in (publish, subscribe, fetch)))


class Core:
    def __init__(
        self,
        run_dir: Path,
        *,
        on_event: Callable[[Event], None] | None = None,
        host: str = "127.0.0.1",
        keys: BusKeys | None = None,
        faults: BusFaults | None = None,
        ports: CorePorts | None = None,
        nonce: str | None = None,
        restore: bool = False,
        taken: int = 0,
        restore_every: int = RESTORE_EVERY,
        health_keep_bytes: int = HEALTH_KEEP_BYTES,
    ) -> None:
        """``host``/``keys``: where the bus binds, and its CURVE keys (required beyond
        loopback, :mod:`elaswave.bus.keys`); ``faults``: injected into what it receives.

        ``nonce``: its hello's identity, the same for every incarnation of a run's Core.
        A restarted Core passes its predecessor's ``ports`` and ``restore``: it binds the
        same endpoints, and its numbering continues the predecessor's (:meth:`restore`);
        ``taken``: the log position its supervisor's persisted state has taken in.
        ``restore_every``: log bytes between restore points (:mod:`.restorepoint`).
        ``health_keep_bytes``: what the health log keeps (:mod:`elaswave.bus.rolling`).
        """
        self.run_dir = run_dir
        self.on_event = on_event
        self.keys = keys
        self.faults = faults
        self.nonce = nonce
        self._restore = restore
        self._carried = Carried(CORE_SENDER)
        self._taken = taken
        self._skipped = 0
        """Protocol events :meth:`restore` read back that the state had taken in."""
        self._every = restore_every
        self._health_keep = health_keep_bytes
        self._next_point = restore_every
        """The log position past which the next restore point is taken."""
        self._saving: asyncio.Task[None] | None = None
        self.points = 0
        """Restore points written."""
        ports = ports or CorePorts()
        self.broker = Broker(host, ports.publish, ports.subscribe, keys=keys)
        self.index = LogIndex()
        self.log_service = LogService(self.index, host, keys=keys, port=ports.fetch)
        self.num_events = 0
        self.num_rejected = 0
        self.finished: dict[int, WorkerFinished] = {}
        self.run_finished: RunFinished | None = None
        self.last_heartbeat: dict[int, float] = {}
        self._news = NewTimings()
        """Which step timings go to the event log: those the protocol learns from."""
        self._beat_logged: dict[str, float] = {}
        """sender -> monotonic time its last logged heartbeat arrived (:meth:`_sink`)."""
        self._beats: dict[int, dict[str, float]] = {}
        """rank -> sender -> its latest heartbeat (a TP group's members each beat)."""
        """rank -> monotonic time its last heartbeat (or its WorkerStarted) arrived."""
        self.step_timings: collections.deque[StepTiming] = collections.deque(
            maxlen=MAX_PENDING_TIMINGS
        )
        """StepTiming reports not yet taken (:meth:`take_step_timings`), in arrival order."""
        self.announcements: list[Event] = []
        """The Core's own FailureDetected, PauseRequest, RecoveryPlan and PlanCommit, in
        the order published (a restarted Core reads its predecessor's here)."""
        self.restored = 0
        """Messages read back from the event log by :meth:`restore`."""
        self._events: ProtocolEvents | None = None
        """Where the events the change protocol takes go, while the supervisor reads."""
        self._backlog: list[Arrival] = []
        """Those events as :meth:`restore` read them back from the event log."""
        self._client: BusClient | None = None
        self._writer: EventLogWriter | None = None
        self._health: RollingLogWriter | None = None
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
    def taken(self) -> int:
        """The log position the supervisor's persisted state has taken in (it sets this
        as it persists): a restore point holds the protocol's events after it."""
        return self._taken

    @taken.setter
    def taken(self, position: int) -> None:
        self._taken = position
        self._carried.taken(position)

    @property
    def client(self) -> BusClient:
        assert self._client is not None, "Core used outside its context"
        return self._client

    async def __aenter__(self) -> Core:
        self.broker.start()
        self.log_service.start()
        self._client = BusClient(
            CORE_SENDER,
            self.broker.publish_endpoint,
            self.broker.subscribe_endpoint,
            keys=self.keys,
            from_start=True,  # every other process connects after the Core
            faults=self.faults,
            nonce=self.nonce,
            on_publish=self._record_own,
        )
        if self._restore:
            self.restore(self.taken)
        self._writer = EventLogWriter(self.run_dir / EVENT_LOG)
        self._health = RollingLogWriter(self.run_dir / HEALTH_LOG, keep_bytes=self._health_keep)
        await self._client.connect()
        self._maintain = asyncio.create_task(self._client.maintain(), name="core-delivery")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._saving is not None:
            await self._saving  # a restore point being written (its errors are logged)
        if self._maintain is not None:
            self._maintain.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._maintain
        if self._client is not None:
            await self._client.close()
        if self._writer is not None:
            self._writer.close()
        if self._health is not None:
            self._health.close()
        self.log_service.close()
        self.broker.close()

    async def publish(self, event: Event) -> Event:
        """Publish ``event`` as the Core; it is in the event log and the log service
        before it is sent (:meth:`_record_own`)."""
        assert self._client is not None, "Core used outside its context"
        return await self._client.publish(event)

    def _record_own(self, frames: list[bytes]) -> None:
        """Log a message of the Core's before it leaves: a successor continues the
        numbering from the log, so no number can reach a worker unlogged (its beacons,
        unnumbered, are not logged)."""
        event = decode(frames)
        if self._writer is not None:
            self._log(event, frames, time.time())
        self.index.add(event.sender, event.TOPIC.value, event.seq, frames)

    def _log(self, event: Event, frames: list[bytes], t: float) -> None:
        """Log a valid message where it goes (:meth:`_sink`); of those in the event log,
        keep what a successor needs."""
        assert self._writer is not None
        assert self._health is not None
        match self._sink(event):
            case Sink.EVENTS:
                position = self._writer.append(frames, t)
                self._carried.add(event, frames, t, position)
            case Sink.HEALTH:
                self._health.append(frames, t)
            case Sink.NOWHERE:
                pass

    def restore(self, taken: int = 0) -> None:
        """Read the predecessor's state back: the log service serves its messages again,
        the tracker knows what was received, the numbering continues, and the state the
        supervisor reads (announcements, the ends of workers and of the run, step
        timings, the protocol's events, which :meth:`protocol_events` yields first) is
        rebuilt, from the newest usable restore point and the log after it
        (:mod:`.restorepoint`), else from the whole log. A record cut short by the
        predecessor's death is cut off the file.

        The protocol's events read back are those after position ``taken`` (the
        persisted state has taken in those before it), and every scale request (each
        is numbered by their count from the start, and taken once)."""
        self.taken, self._skipped = taken, 0
        path = self.run_dir / EVENT_LOG
        point, why = read_point(self.run_dir / RESTORE_POINT, path, taken)
        if why:
            log.warning("core.restore_point_unused", reason=why)
        good = start = self._load_point(point) if point is not None else 0
        with contextlib.suppress(FileNotFoundError), path.open("rb") as file:
            file.seek(start)
            unpacker = msgpack.Unpacker(file, raw=False, use_list=True)
            while True:
                try:
                    obj = unpacker.unpack()
                except msgpack.OutOfData:
                    break
                except Exception:  # corrupt bytes: keep what came before them
                    break
                good = start + unpacker.tell()
                frames = (obj.get("frames") if isinstance(obj, dict) else None) or []
                try:
                    event = decode(frames)
                except SchemaError:  # logged as received; nothing to take in
                    continue
                self._read_back(event, frames, float(obj.get("t", 0.0)), good)
        if path.exists() and path.stat().st_size > good:
            log.warning("core.event_log_cut", path=str(path), at=good)
            os.truncate(path, good)
        own = self.client.sender
        numbering = {t: high for s, t, high, _ in self.client.tracker.export() if s == own}
        self.client.resume_numbering(numbering)
        self.reset_silence(time.monotonic())  # the supervisor times silence from now
        self._next_point = start + self._every
        log.warning(
            "core.restored",
            events=self.restored,
            numbering=numbering,
            point=start,
            backlog=len(self._backlog),
            taken_before=self._skipped,
        )

    def _load_point(self, point: RestorePoint) -> int:
        """Take in a restore point (:meth:`restore`); the log position it covers."""
        self.client.tracker.load(point.seen, point.nonces)
        self.index.load(point.index)
        now = time.monotonic()
        for rank, senders in point.watched:
            self.last_heartbeat[rank] = now
            if senders:
                self._beats[rank] = dict.fromkeys(senders, now)
        for kept in point.kept:
            try:
                event = decode(kept.frames)
            except SchemaError:  # kept as logged: a valid message, so never here
                continue
            self._take_again(event, kept.frames, kept.t, kept.position)
        self.restored = point.records
        return point.position

    def _read_back(self, event: Event, frames: list[bytes], t: float, position: int) -> None:
        """Take in a valid record of the predecessor's log (:meth:`restore`): tracked as
        its client admitted it (a hello with a new nonce: a sender's new process, its
        numbers counted from 1 again; read back without it, a restarted node agent's
        messages were dropped as duplicates until its numbers passed its old ones)."""
        self.restored += 1
        topic = event.TOPIC.value
        if event.seq > 0:
            self.client.tracker.accept(event.sender, topic, event.seq)
        if isinstance(event, Hello):
            self.client.tracker.restarted(event.sender, event.nonce)
        self.index.add(event.sender, topic, event.seq, frames)
        self._take_again(event, frames, t, position)

    def _take_again(self, event: Event, frames: list[bytes], t: float, position: int) -> None:
        """The state the supervisor reads, what a successor needs, and the protocol's
        backlog: for a record read back (from the log, or kept by a restore point)."""
        self._dispatch(event)
        self._carried.add(event, frames, t, position)
        if not takes(event):
            return
        if position > self.taken or isinstance(event, ScaleRequest):
            self._backlog.append(Arrival(event, t, position))
        else:
            self._skipped += 1

    async def save_point(self) -> None:
        """Take a restore point of the log as it stands and wait until it is written
        (tools; the Core takes its own as its log grows)."""
        if self._saving is not None:
            await self._saving
        self._take_point()
        assert self._saving is not None
        await self._saving

    def _take_point(self) -> None:
        """Take a restore point of the log as it stands; it is written off the loop."""
        if self._saving is not None and not self._saving.done():
            return
        point = self._capture_point()
        self._next_point = point.position + self._every
        self._saving = asyncio.create_task(asyncio.to_thread(self._write_point, point))

    def _capture_point(self) -> RestorePoint:
        """The state a restore point holds, at the log's position now (on the loop;
        the log service's messages are added when it is written: :meth:`_write_point`)."""
        assert self._writer is not None
        seen = self._seen_with_own()
        kept, pending_from = self._carried.records(self.taken)
        return RestorePoint(
            position=self._writer.position,
            tail=b"",
            records=self.restored + self._writer.num_records,
            seen=seen,
            nonces=self.client.tracker.nonces,
            index=[],  # exported on the writer's thread
            watched=[(r, sorted(self._beats.get(r, ()))) for r in self.last_heartbeat],
            kept=kept,
            pending_from=pending_from,
        )

    def _seen_with_own(self) -> list[tuple[str, str, int, list[int]]]:
        """The tracker's export, with the Core's own messages logged and not received
        back yet as seen: a successor continues the numbering from it (a topic's first
        message in flight when a point was taken left its topic out, and a successor
        would have numbered it from 1 again)."""
        own, numbering = self.client.sender, self.client.numbering
        seen = [
            (s, t, max(high, numbering.get(t, 0)) if s == own else high, missing)
            for s, t, high, missing in self.client.tracker.export()
        ]
        have = {t for s, t, _, _ in seen if s == own}
        return seen + [(own, t, n, []) for t, n in numbering.items() if n and t not in have]

    def _write_point(self, point: RestorePoint) -> None:
        """Write a point taken by :meth:`_take_point` (on a thread), with the log
        service's messages: the index is thread-safe, and its export took 0.2 s at 1000
        ranks, off the loop here. It may hold messages logged after the point's
        position, which a successor reads from the log after it again, to the same
        effect."""
        started = time.monotonic()
        try:
            tail = log_tail(self.run_dir / EVENT_LOG, point.position)
            index = self.index.export(recent=RECENT_FRAMES)
            size = write_point(self.run_dir / RESTORE_POINT, replace(point, tail=tail, index=index))
        except Exception:  # a full disk: a successor reads more log; the job goes on
            log.exception("core.restore_point_failed", position=point.position)
            return
        self.points += 1
        self._next_point = max(self._next_point, point.position + 2 * size)
        seconds = round(time.monotonic() - started, 3)
        log.info("core.restore_point", position=point.position, bytes=size, seconds=seconds)

    @contextlib.contextmanager
    def protocol_events(self) -> Iterator[ProtocolEvents]:
        """The events the change protocol takes, with their arrival time, while the
        block runs: those :meth:`restore` read back first, then each as it arrives."""
        events = self._events = ProtocolEvents(self._backlog)
        self._backlog = []
        try:
            yield events
        finally:
            self._events = None

    def forget_worker(self, rank: int, members: int = 1) -> None:
        """Worker ``rank`` (its ``members`` processes) exited: no one can send the
        messages of its that the Core missed, so stop asking for them."""
        for member in range(members):
            self.client.tracker.forget(sender_name(rank, member))

    def reset_silence(self, now: float) -> None:
        """Count every worker's silence from ``now`` (a period the Core did not watch)."""
        for rank in self.last_heartbeat:
            self.last_heartbeat[rank] = now
        for beats in self._beats.values():
            for sender in beats:
                beats[sender] = now

    async def listen(self) -> None:
        """Record and dispatch events until cancelled."""
        assert self._client is not None, "Core used outside its context"
        assert self._writer is not None, "Core used outside its context"
        while True:
            frames, event, _error = await self._client.recv_raw()
            now = time.time()
            self.num_events += 1
            if event is None:  # the client has logged why; the raw frames are in the log
                self._writer.append(frames, now)
                self.num_rejected += 1
                continue
            if event.sender != self.client.sender:  # its own were logged when sent
                self._log(event, frames, now)
                self.index.add(event.sender, event.TOPIC.value, event.seq, frames)
            self._dispatch(event)
            if self._writer.position >= self._next_point:
                self._take_point()
            if self._events is not None and takes(event):
                await self._events.put(Arrival(event, now, self._writer.position))
            if self.on_event is not None:
                try:
                    self.on_event(event)
                except Exception:
                    log.exception("core.on_event_failed", kind=str(event.KIND))
            self._changed.set()

    def _sink(self, event: Event) -> Sink:
        """Where ``event`` is logged: a beacon (each process's last numbers, four times
        a second, replaced by the next and unnumbered) nowhere; the chatter of
        :data:`HEALTH_CHATTER` in the health log, but for step timings the protocol
        learns from (:class:`~elaswave.runtime.core.observe.NewTimings`); of a sender's
        heartbeats, its first in the event log and one every :data:`BEAT_LOG_S` after it
        in the health log; everything else in the event log."""
        if isinstance(event, Beacon):
            return Sink.NOWHERE
        if isinstance(event, HEALTH_CHATTER):
            news = isinstance(event, StepTiming) and self._news(event)
            return Sink.EVENTS if news else Sink.HEALTH
        if isinstance(event, Heartbeat):
            now, last = time.monotonic(), self._beat_logged.get(event.sender)
            if last is not None and now - last < BEAT_LOG_S:
                return Sink.NOWHERE
            self._beat_logged[event.sender] = now
            return Sink.EVENTS if last is None else Sink.HEALTH
        return Sink.EVENTS

    def _dispatch(self, event: Event) -> None:
        """Update the state the supervisor reads with ``event``."""
        if isinstance(event, Heartbeat):
            # A TP group beats with each member: it is as live as its most silent one.
            beats = self._beats.setdefault(event.rank, {})
            beats[event.sender] = time.monotonic()
            self.last_heartbeat[event.rank] = min(beats.values())
        elif isinstance(event, WorkerStarted):
            # Its agent beats from before this on: a worker that hangs before its first
            # heartbeat is silent from here, and fenced like any other.
            self.last_heartbeat[event.rank] = time.monotonic()
        elif isinstance(event, WorkerFinished):
            self.finished[event.rank] = event
        elif isinstance(event, RunFinished):
            self.run_finished = event
        elif isinstance(event, StepTiming):
            self.step_timings.append(event)
        elif (
            isinstance(event, FailureDetected | PauseRequest | RecoveryPlan | PlanCommit)
            and event.sender == self.client.sender
        ):
            self.announcements.append(event)

    def take_step_timings(self) -> list[StepTiming]:
        """The StepTiming reports that arrived since the last call, oldest first (the
        fail-slow detector's input)."""
        taken = list(self.step_timings)
        self.step_timings.clear()
        return taken

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
