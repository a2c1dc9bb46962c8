"""Embed ElasWave's event bus in your own training process.

:class:`Session` is the user-facing way to talk to the bus from ordinary, synchronous
training code (or from your own asyncio program). It runs a private uvloop event loop
in a daemon thread, so that the training hot path never waits on the network.

Example — report progress and react to recoveries from a plain training loop::

    from elaswave.bus import EventKind, StepCompleted
    from elaswave.bus.session import Session

    def on_recovery(event):  # runs on the session's thread: keep it short
        logger.info("recovery", kind=event.kind, ranks=event.ranks)

    with Session("rank3", publish_endpoint, subscribe_endpoint) as session:
        session.subscribe(on_recovery, kinds=[EventKind.RECOVERY_STARTED])
        for step in range(num_steps):
            loss = train_step()
            session.publish(  # returns at once; sender and seq are stamped for you
                StepCompleted(sender="", rank=3, step=step, loss=loss,
                              step_time_s=dt, samples=batch)
            )

Example — consume events from your own asyncio loop::

    async def watch(session: Session) -> None:
        async for event in session.events(kinds=[EventKind.STEP_COMPLETED]):
            dashboard.update(event.step, event.loss)   # ends when the session closes
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Self

import structlog
import uvloop

from elaswave.bus.client import BusClient, BusError
from elaswave.bus.keys import BusKeys
from elaswave.bus.reliable import BusFaults
from elaswave.bus.schema import Event, EventKind, Topic

logger = structlog.get_logger(__name__)

Callback = Callable[[Event], object]


class Session:
    """A bus connection owned by a background thread, usable from any thread.

    Lifecycle: :meth:`start` starts a daemon thread running a ``uvloop`` event loop,
    connects a :class:`~elaswave.bus.client.BusClient` there (handshake included) and
    returns once connected, raising the client's error in the caller's thread if the bus
    cannot be reached. :meth:`close` flushes queued events, disconnects, ends every
    :meth:`events` iterator and joins the thread; it is idempotent. ``with Session(...)``
    does both.

    Publishing: :meth:`publish` is thread-safe and never blocks. Events go onto a bounded
    queue drained by the session's thread; when it is full the event is dropped and
    counted in :attr:`dropped` (with a warning log at 1, 2, 4, 8, ... drops). Events
    published while :meth:`close` runs may be lost. :meth:`confirm` blocks until the
    Core's log holds what was published (a sudden death loses nothing before it).

    Receiving: the session receives every event on ``topics`` (all by default),
    including the ones it published itself; invalid messages are skipped and counted in
    :attr:`rejected`. Deliver them with :meth:`subscribe` (a callback on the session's
    thread) or :meth:`events` (an async iterator on your own loop). Both may be set up
    before :meth:`start`, so that no early event is missed.

    Args:
        sender: this process's name on the bus (``"rank3"``, ``"trainer"``); stamped on
            every event it publishes, with a per-session ``seq`` (1, 2, ...).
        publish_endpoint: the broker's publish address (``Broker.publish_endpoint``).
        subscribe_endpoint: the broker's subscribe address (``Broker.subscribe_endpoint``).
        topics: topics to receive; ``None`` means all.
        senders: whose events to receive on them (``None``: everyone's; a worker
            takes the Core's, ``[CORE_SENDER]``).
        queue_size: capacity of the outgoing queue, in events.
        handshake_timeout: seconds :meth:`start` waits for the bus.
        keys: the job's CURVE keys, when its bus has them.
        fetch_endpoint: the Core's log service: messages missed on reliable topics are
            fetched there (:mod:`elaswave.bus.reliable`); None asks their senders.
        faults: faults injected into what this session receives (tests).
    """

    def __init__(
        self,
        sender: str,
        publish_endpoint: str,
        subscribe_endpoint: str,
        topics: Iterable[Topic] | None = None,
        *,
        senders: Iterable[str] | None = None,
        queue_size: int = 10_000,
        handshake_timeout: float = 10.0,
        keys: BusKeys | None = None,
        fetch_endpoint: str | None = None,
        faults: BusFaults | None = None,
    ) -> None:
        if queue_size <= 0:
            raise ValueError(f"queue_size must be a positive number of events, got {queue_size}")
        self._client = BusClient(
            sender,
            publish_endpoint,
            subscribe_endpoint,
            topics,
            senders=senders,
            handshake_timeout=handshake_timeout,
            keys=keys,
            fetch_endpoint=fetch_endpoint,
            faults=faults,
        )
        self._queue_size = queue_size
        self._handshake_timeout = handshake_timeout
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
        self._outbox: asyncio.Queue[Event] | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._closed = False
        self._subscriptions: tuple[_Subscription, ...] = ()
        self._feeds: tuple[_Feed, ...] = ()
        self._dropped = 0
        self.floor_generation = 0
        """Recovery-topic events of an older plan generation are dropped (and logged):
        a process sets this to the generation it has applied."""
        self._stale = 0

    @property
    def sender(self) -> str:
        """This session's name on the bus."""
        return self._client.sender

    @property
    def running(self) -> bool:
        """True between a successful :meth:`start` and :meth:`close`."""
        thread = self._thread
        return thread is not None and thread.is_alive() and self._ready.is_set()

    @property
    def dropped(self) -> int:
        """Events :meth:`publish` dropped (queue full or session closed)."""
        return self._dropped

    @property
    def rejected(self) -> int:
        """Received messages skipped because they were not valid events."""
        return self._client.rejected

    @property
    def client(self) -> BusClient:
        """The session's bus client (its delivery counters: ``duplicates``, ``asked``...)."""
        return self._client

    def start(self) -> Self:
        """Start the session's thread and connect; returns ``self`` once connected.

        Raises:
            BusError: the broker did not answer the handshake in time.
            RuntimeError: the session was already started or closed.
        """
        with self._lock:
            if self._closed or self._thread is not None:
                raise RuntimeError("a Session can be started once; create a new one")
            self._thread = threading.Thread(
                target=self._run, name=f"elaswave-session-{self.sender}", daemon=True
            )
            self._thread.start()
        if not self._ready.wait(self._handshake_timeout + 10.0):
            self.close()
            raise BusError(f"session {self.sender!r}: the event loop thread did not start")
        if self._start_error is not None:
            self._thread.join()
            raise self._start_error
        return self

    def close(self, timeout: float = 10.0) -> None:
        """Flush queued events, disconnect, end :meth:`events` iterators, join the thread.

        Idempotent. Called from a callback (the session's own thread) it only requests
        the shutdown, since the thread cannot join itself.
        """
        with self._lock:
            self._closed = True
            thread, stop = self._thread, self._stop
        if stop is not None:
            with contextlib.suppress(RuntimeError):  # RuntimeError: the loop is closed
                stop[0].call_soon_threadsafe(stop[1].set)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                logger.error("session_thread_did_not_stop", sender=self.sender, timeout_s=timeout)
        self._close_feeds()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def publish(self, event: Event) -> None:
        """Queue ``event`` for sending and return at once; safe from any thread.

        ``sender`` and ``seq`` are stamped by the session; ``time`` is set to now if 0.
        """
        loop = self._loop
        if loop is None:
            raise BusError(f"session {self.sender!r}: publish() before start()")
        if event.time == 0.0:
            event = dataclasses.replace(event, time=time.time())
        try:
            loop.call_soon_threadsafe(self._enqueue, event)
        except RuntimeError:  # the loop is closed
            self._drop(event, "session closed")

    def confirm(self, timeout_s: float = 2.0) -> bool:
        """Wait until the Core's log holds every reliable event published so far; False
        when it does not within ``timeout_s``. Without a log service: True at once.

        A published event the Core missed is repaired from this process's history, and
        only while the process lives to answer: one the run's record must keep even if
        the process is killed right after (a worker's start) is confirmed before the
        process goes on. Blocks the calling thread; not from a callback.
        """
        loop = self._loop
        if loop is None:
            raise BusError(f"session {self.sender!r}: confirm() before start()")
        if threading.current_thread() is self._thread:
            raise RuntimeError("confirm() on the session's own thread would wait on itself")
        confirming = self._confirm(timeout_s)
        try:
            future = asyncio.run_coroutine_threadsafe(confirming, loop)
        except RuntimeError:  # the loop is closed
            confirming.close()
            return False
        try:
            return future.result(timeout_s + 1.0)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
            future.cancel()
            return False

    async def _confirm(self, timeout_s: float) -> bool:
        assert self._outbox is not None
        deadline = time.monotonic() + timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                await self._outbox.join()  # what publish() queued before this call is sent
        except TimeoutError:
            return False
        return await self._client.flush(max(0.0, deadline - time.monotonic()))

    def subscribe(
        self, callback: Callback, kinds: Iterable[EventKind | str] | None = None
    ) -> Callable[[], None]:
        """Call ``callback(event)`` for every received event of ``kinds`` (default: all).

        The callback runs on the session's thread, so it must be quick and must not
        block; an exception it raises is logged and the session carries on. Returns a
        function that removes the subscription (idempotent, callable from any thread).
        """
        subscription = _Subscription(callback, _kind_set(kinds))
        with self._lock:
            self._subscriptions = (*self._subscriptions, subscription)

        def unsubscribe() -> None:
            with self._lock:
                self._subscriptions = tuple(s for s in self._subscriptions if s is not subscription)

        return unsubscribe

    def events(
        self, kinds: Iterable[EventKind | str] | None = None, maxsize: int = 1000
    ) -> EventStream:
        """Return an async iterator of received events for the *calling* event loop.

        Call it from a coroutine on your own loop (any loop, not the session's). The
        iterator buffers up to ``maxsize`` events; when the buffer is full the oldest is
        dropped and counted in :attr:`EventStream.dropped`. It ends when the session
        closes, after yielding what it has buffered, or when you call
        :meth:`EventStream.aclose` (``async with session.events() as stream`` does).
        """
        if maxsize <= 0:
            raise ValueError(f"maxsize must be a positive number of events, got {maxsize}")
        try:
            consumer_loop = asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError(
                "Session.events() must be called from a coroutine running on the event "
                "loop that will iterate it"
            ) from None
        feed = _Feed(consumer_loop, _kind_set(kinds), maxsize)
        with self._lock:
            if self._closed:
                feed.close()
            else:
                self._feeds = (*self._feeds, feed)
        return EventStream(feed, self._unregister_feed)

    def _run(self) -> None:
        loop = uvloop.new_event_loop()
        try:
            loop.run_until_complete(self._main(loop))
        except BaseException as exc:
            if not self._ready.is_set():
                self._start_error = exc
            logger.exception("session_loop_failed", sender=self.sender)
        finally:
            try:
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                loop.close()
                self._ready.set()
                self._close_feeds()

    async def _main(self, loop: asyncio.AbstractEventLoop) -> None:
        client = self._client
        self._outbox = asyncio.Queue(self._queue_size)
        stop = asyncio.Event()
        with self._lock:
            self._stop = (loop, stop)
            if self._closed:  # close() came before the loop existed
                stop.set()
        try:
            await client.connect()
        except BaseException as exc:
            self._start_error = exc
            self._ready.set()
            return
        self._loop = loop
        self._ready.set()
        try:
            async with asyncio.TaskGroup() as tasks:
                receiver = tasks.create_task(self._receive(client), name="session-receive")
                sender = tasks.create_task(self._send(client), name="session-send")
                delivery = tasks.create_task(client.maintain(), name="session-delivery")
                await stop.wait()
                receiver.cancel()
                sender.cancel()
                delivery.cancel()
            while not self._outbox.empty():  # flush what publish() queued before close()
                await client.publish(self._outbox.get_nowait())
            if not await client.flush():
                logger.warning("session_flush_incomplete", sender=self.sender)
        finally:
            await client.close()

    def _enqueue(self, event: Event) -> None:
        assert self._outbox is not None
        try:
            self._outbox.put_nowait(event)
        except asyncio.QueueFull:
            self._drop(event, "outgoing queue full")

    def _drop(self, event: Event, reason: str) -> None:
        with self._lock:
            self._dropped += 1
            num_dropped = self._dropped
        if num_dropped & (num_dropped - 1) == 0:  # 1, 2, 4, 8, ...: bounded log volume
            logger.warning(
                "session_event_dropped",
                kind=event.KIND.value,
                reason=reason,
                num_dropped=num_dropped,
            )

    async def _send(self, client: BusClient) -> None:
        assert self._outbox is not None
        while True:
            event = await self._outbox.get()
            try:
                await client.publish(event)
            finally:
                self._outbox.task_done()  # for confirm()

    @property
    def stale(self) -> int:
        """Recovery events dropped for a generation below :attr:`floor_generation`."""
        return self._stale

    def _superseded(self, event: Event) -> bool:
        floor = self.floor_generation
        if event.TOPIC is not Topic.RECOVERY or event.generation >= floor:
            return False
        self._stale += 1
        if self._stale & (self._stale - 1) == 0:  # 1, 2, 4, ...: bounded log volume
            logger.warning(
                "bus_message_stale",
                receiver=self.sender,
                kind=event.KIND.value,
                sender=event.sender,
                generation=event.generation,
                floor=floor,
                num_stale=self._stale,
            )
        return True

    async def _receive(self, client: BusClient) -> None:
        while True:
            event = await client.recv()
            if self._superseded(event):
                continue
            # Streams first: once a callback has seen an event, every stream holds it
            # (a stream closed right after a callback saw the last event still yields it).
            for feed in self._feeds:
                if (feed.kinds is None or event.KIND in feed.kinds) and not feed.offer(event):
                    self._unregister_feed(feed)  # its loop is gone
            for subscription in self._subscriptions:
                if subscription.kinds is None or event.KIND in subscription.kinds:
                    try:
                        subscription.callback(event)
                    except Exception:
                        logger.exception(
                            "session_callback_failed", sender=self.sender, kind=event.KIND.value
                        )

    def _unregister_feed(self, feed: _Feed) -> None:
        with self._lock:
            self._feeds = tuple(f for f in self._feeds if f is not feed)

    def _close_feeds(self) -> None:
        with self._lock:
            self._closed = True
            feeds, self._feeds = self._feeds, ()
        for feed in feeds:
            feed.close()


@dataclasses.dataclass(frozen=True, eq=False)
class _Subscription:
    callback: Callback
    kinds: frozenset[EventKind] | None


def _kind_set(kinds: Iterable[EventKind | str] | None) -> frozenset[EventKind] | None:
    if kinds is None:
        return None
    if isinstance(kinds, str):
        raise TypeError("kinds must be an iterable of EventKind, not a single string")
    return frozenset(EventKind(kind) for kind in kinds)


class _Feed:
    """A bounded, drop-oldest buffer filled on the session's thread, read on another loop.

    The producer appends under a lock and schedules at most one wake-up callback on the
    consumer's loop at a time, so a burst of events costs one cross-thread call.
    """

    def __init__(
        self, loop: asyncio.AbstractEventLoop, kinds: frozenset[EventKind] | None, maxsize: int
    ) -> None:
        self.loop = loop
        self.kinds = kinds
        self.dropped = 0
        self._maxsize = maxsize
        self._lock = threading.Lock()
        self._buffer: collections.deque[Event] = collections.deque()
        self._closed = False
        self._wake_scheduled = False
        self._waiter: asyncio.Future[None] | None = None  # touched on the consumer loop only

    def offer(self, event: Event) -> bool:
        """Buffer ``event`` (any thread); False when the consumer's loop is closed."""
        with self._lock:
            if self._closed:
                return True
            if len(self._buffer) >= self._maxsize:
                self._buffer.popleft()
                self.dropped += 1
            self._buffer.append(event)
        return self._schedule_wake()

    def close(self) -> None:
        """End the stream once its buffer is drained (any thread). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._schedule_wake()

    def _schedule_wake(self) -> bool:
        with self._lock:
            if self._wake_scheduled:
                return True
            self._wake_scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._wake)
        except RuntimeError:
            return False
        return True

    def _wake(self) -> None:
        with self._lock:
            self._wake_scheduled = False
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> Event:
        """Next event, or StopAsyncIteration once closed and drained (consumer loop)."""
        if asyncio.get_running_loop() is not self.loop:
            raise RuntimeError("iterate Session.events() on the loop that created it")
        while True:
            with self._lock:
                if self._buffer:
                    return self._buffer.popleft()
                if self._closed:
                    raise StopAsyncIteration
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None


class EventStream:
    """Async iterator returned by :meth:`Session.events`; also an async context manager."""

    def __init__(self, feed: _Feed, unregister: Callable[[_Feed], None]) -> None:
        self._feed = feed
        # Unregister when closed or garbage-collected (e.g. after ``break``).
        self._finalizer = weakref.finalize(self, unregister, feed)

    @property
    def dropped(self) -> int:
        """Events dropped (oldest first) because the buffer was full."""
        return self._feed.dropped

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Event:
        return await self._feed.get()

    async def aclose(self) -> None:
        """Stop receiving; buffered events are still yielded, then iteration ends."""
        self._finalizer()
        self._feed.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
