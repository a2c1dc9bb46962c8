"""Async publish/subscribe client for the ElasWave bus (``zmq.asyncio``, works under uvloop).

A :class:`BusClient` owns one PUB socket connected to the broker's XSUB and one SUB
socket connected to the broker's XPUB. :meth:`BusClient.connect` ends with a handshake
against ZeroMQ's *slow-joiner* problem (a PUB drops everything sent before the
subscriptions have reached it): the client publishes a :class:`~elaswave.bus.schema.Hello`
carrying a random nonce every ``hello_interval`` seconds until the broker echoes it back
to the client's own SUB socket. Once it has, this client's messages reach the broker and
the broker's messages reach this client.

Receiving never raises for bad input. A message that fails :func:`~elaswave.bus.codec.decode`
is logged once as a warning, counted in :attr:`BusClient.rejected` and skipped by
:meth:`BusClient.recv`; :meth:`BusClient.recv_raw` returns it with its error so that a
caller that logs every message (the core's event log) sees it too.

After one awaited receive, the client drains whatever else is queued through a
synchronous *shadow* of the SUB socket with ``NOBLOCK``: one wake-up per batch rather
than per message (about 3x the throughput of one ``await`` per message, see PLATFORM.md).

Delivery (:mod:`elaswave.bus.reliable`): every published event is numbered per topic;
the receive path drops duplicates, notes gaps, and hands back late (reordered) messages.
:meth:`maintain`, run beside the receiver, publishes this client's beacon and repairs
gaps on the reliable topics: from the Core's log service when ``fetch_endpoint`` is set,
otherwise by asking the sender to publish again (it keeps a :class:`SentHistory`).

One task at a time may call the receive methods; :meth:`publish` may be called from any
task of the client's event loop. A client is bound to the loop it connected in.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import NamedTuple, Self

import structlog
import zmq
import zmq.asyncio

from elaswave.bus.codec import check_sender, decode, encode, topic_frame
from elaswave.bus.keys import BusKeys, use_curve
from elaswave.bus.logservice import Fetcher
from elaswave.bus.reliable import (
    FLUSH_WINDOW,
    RELIABLE_TOPICS,
    BusFaults,
    FaultyLink,
    SentHistory,
    SeqTracker,
)
from elaswave.bus.schema import (
    CORE_SENDER,
    Beacon,
    Event,
    Hello,
    ResendRequest,
    SchemaError,
    Topic,
)

logger = structlog.get_logger(__name__)

DEFAULT_HWM = 100_000
"""High-water mark (messages) of the client's sockets."""

BEACON_INTERVAL_S = 0.25
"""Seconds between two beacons of a client running :meth:`BusClient.maintain`."""

REPAIR_TICK_S = 0.05
"""How often :meth:`BusClient.maintain` looks at the gaps to repair while some are open;
with none open it sleeps until the next beacon or a message that opens one (a client
woke 20 times a second for nothing: about half a worker's bus-thread wake-ups in a
steady training step, and their CPU on a host whose cores train)."""

REPAIR_AFTER_S = 0.05
"""A gap is repaired once it is this old: a reordered message usually fills it first."""

RETRY_S = 0.3
"""A gap still open this long after a repair attempt is asked for again."""

NUMBERING_ASK_S = 5.0
"""Seconds :meth:`BusClient.connect` waits for the Core's log to say where the Core's
numbering stands: asked once, while a job starts and its host is busiest, so longer
than a repair's fetch; shorter than the handshake's default, so that a session that
cannot reach the bus still reports the handshake's error in time."""


class BusError(RuntimeError):
    """The bus could not be reached or used (handshake deadline, closed client)."""


class RawMessage(NamedTuple):
    """One received multipart message with its decoding outcome (exactly one is set)."""

    frames: list[bytes]
    event: Event | None
    error: str | None


class BusClient:
    """Publish and receive events through a :class:`~elaswave.bus.broker.Broker`.

    Args:
        sender: name stamped on every published event (``"core"``, ``"rank3"``).
        publish_endpoint: the broker's XSUB address (``Broker.publish_endpoint``).
        subscribe_endpoint: the broker's XPUB address (``Broker.subscribe_endpoint``).
        topics: topics to receive; ``None`` receives all of them.
        senders: whose messages to receive on them (``None``: everyone's). A worker
            takes the Core's only: the others' are the Core's business, and a worker
            that took them would handle every other worker's beacons (4 a second each).
        handshake_timeout: seconds :meth:`connect` waits for its own hello.
        hello_interval: seconds between two hellos during the handshake.
        linger: seconds :meth:`close` lets unsent messages flush in the background.
        drain_batch: most messages taken without awaiting after one awaited receive.
        keys: the job's CURVE keys when its broker has them (:mod:`elaswave.bus.keys`);
            without the right ones the handshake never completes (:class:`BusError`).
        fetch_endpoint: the Core's log service (:mod:`elaswave.bus.logservice`), where
            :meth:`maintain` fetches missed messages; None: ask their senders instead.
            :meth:`connect` also asks it where to start counting the Core's messages.
        from_start: expect every sender's numbers from 1 (the Core, which starts first);
            otherwise a sender's first beacon or message sets where this client starts
            (the Core's: its log, when this client has ``fetch_endpoint``).
        faults: faults to inject into what this client receives (tests).
        nonce: the identity its hello carries (default: a new one). A restarted process
            that continues its predecessor's numbering (:meth:`resume_numbering`) passes
            the predecessor's, so receivers do not count it from 1 again.
        on_publish: called with every message's frames just before it is sent (the
            Core records what it publishes before anyone can have seen it).
        log_rejected: log every message that fails to decode as a warning (an observer
            beside the Core, which logs them already, logs them at debug level).
    """

    def __init__(
        self,
        sender: str,
        publish_endpoint: str,
        subscribe_endpoint: str,
        topics: Iterable[Topic] | None = None,
        *,
        senders: Iterable[str] | None = None,
        handshake_timeout: float = 10.0,
        hello_interval: float = 0.02,
        linger: float = 1.0,
        drain_batch: int = 1024,
        keys: BusKeys | None = None,
        fetch_endpoint: str | None = None,
        from_start: bool = False,
        faults: BusFaults | None = None,
        nonce: str | None = None,
        on_publish: Callable[[list[bytes]], None] | None = None,
        log_rejected: bool = True,
    ) -> None:
        check_sender(sender)
        if handshake_timeout <= 0 or hello_interval <= 0:
            raise ValueError("handshake_timeout and hello_interval must be positive seconds")
        self.sender = sender
        self.publish_endpoint = publish_endpoint
        self.subscribe_endpoint = subscribe_endpoint
        self.topics: frozenset[Topic] = frozenset(Topic if topics is None else topics)
        self.senders: frozenset[str] | None = (
            None if senders is None else frozenset(check_sender(s) for s in senders)
        )
        self._sender_names = (
            None if self.senders is None else frozenset(s.encode() for s in self.senders)
        )
        self._handshake_timeout = handshake_timeout
        self._hello_interval = hello_interval
        self._linger_ms = int(linger * 1000)
        self._drain_batch = drain_batch
        self._keys = keys
        self._pub: zmq.asyncio.Socket | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._sub_sync: zmq.Socket[bytes] | None = None
        self._inbox: collections.deque[list[bytes]] = collections.deque(maxlen=DEFAULT_HWM)
        self._own_hello: list[bytes] | None = None
        self._seq: dict[str, int] = {}
        self._closed = False
        self.rejected = 0
        """Number of received messages that failed to decode."""
        self.duplicates = 0
        """Received messages dropped because their number was seen before."""
        self.asked = 0
        """Missing message numbers asked for again (fetches and resend requests)."""
        self.fetched = 0
        """Messages the Core's log service returned."""
        self._from_start = from_start
        self.tracker = SeqTracker(from_start=from_start)
        self._reliable = frozenset(t.value for t in self.topics & RELIABLE_TOPICS)
        self._taken = frozenset(t.value.encode() for t in self._topics_taken())
        """First frames' topics received: CONTROL's beacons only, when not asked for."""
        self._history = SentHistory()
        self._fetcher = Fetcher(fetch_endpoint, keys=keys) if fetch_endpoint else None
        self._asked: dict[tuple[str, str, int], float] = {}
        """(sender, topic, seq) -> monotonic time a repair was last attempted."""
        self._link: FaultyLink | None = (
            faults.injector(sender) if faults is not None and faults.active else None
        )
        self._wake: asyncio.Event | None = None
        self._gap: asyncio.Event | None = None
        """Set when a received message leaves a number missing (:meth:`maintain`)."""
        self.nonce = nonce or secrets.token_hex(8)
        self._on_publish = on_publish
        self._log_rejected = logger.warning if log_rejected else logger.debug

    @property
    def numbering(self) -> dict[str, int]:
        """The last number this client gave a message of each topic."""
        return dict(self._seq)

    def resume_numbering(self, last: dict[str, int]) -> None:
        """Continue a predecessor's numbering: ``last`` maps topic -> its last ``seq``."""
        for topic, seq in last.items():
            self._seq[topic] = max(self._seq.get(topic, 0), seq)

    @property
    def connected(self) -> bool:
        """True between a successful :meth:`connect` and :meth:`close`."""
        return self._sub_sync is not None and not self._closed

    # ------------------------------------------------------------------ lifecycle

    async def connect(self) -> None:
        """Connect both sockets and complete the hello handshake.

        Raises:
            BusError: the client's own hello did not come back within
                ``handshake_timeout`` (broker not running, wrong endpoints).
        """
        if self._closed:
            raise BusError(f"bus client {self.sender!r} was closed; create a new one")
        if self._pub is not None:
            raise BusError(f"bus client {self.sender!r} is already connected")
        await self._count_the_core_from_its_log()
        context = zmq.asyncio.Context.instance()
        self._pub = context.socket(zmq.PUB)
        self._sub = context.socket(zmq.SUB)
        self._pub.setsockopt(zmq.SNDHWM, DEFAULT_HWM)
        self._sub.setsockopt(zmq.RCVHWM, DEFAULT_HWM)
        if self._keys is not None:
            use_curve(self._pub, self._keys)
            use_curve(self._sub, self._keys)
        self._pub.connect(self.publish_endpoint)
        self._sub.connect(self.subscribe_endpoint)
        # Its own hello's last: the echo of the hello then shows that every earlier
        # subscription has passed the broker too (one pipe keeps their order).
        kept = self._subscriptions()
        own = topic_frame(Topic.CONTROL.value, self.sender)
        for prefix in [*kept, own]:
            self._sub.setsockopt(zmq.SUBSCRIBE, prefix)
        sub_sync: zmq.Socket[bytes] = zmq.Socket.shadow(self._sub.underlying)
        try:
            await self._handshake(sub_sync)
        except BaseException:
            await self.close()
            raise
        self._sub.setsockopt(zmq.UNSUBSCRIBE, own)  # the same prefix twice is counted twice
        self._wake = asyncio.Event()
        self._gap = asyncio.Event()
        self._sub_sync = sub_sync
        logger.debug(
            "bus_client_connected", sender=self.sender, topics=sorted(t.value for t in self.topics)
        )

    start = connect

    def _topics_taken(self) -> frozenset[Topic]:
        """The topics this client receives: its own, and CONTROL on a reliable topic
        (beacons say what was sent last; the other CONTROL events are not handed out)."""
        return self.topics | ({Topic.CONTROL} if self._reliable else frozenset())

    def _subscriptions(self) -> list[bytes]:
        """The SUB socket's prefixes: each topic's, or each (topic, sender)'s."""
        topics = self._topics_taken()
        if self.senders is None:
            return [topic_frame(t.value, "") for t in sorted(topics)]
        return [topic_frame(t.value, s) for t in sorted(topics) for s in sorted(self.senders)]

    def _wanted(self, first: bytes) -> bool:
        """Whether a message whose first frame is ``first`` is on this client's topics
        (CONTROL too on a reliable topic: its senders' beacons) and from its senders (a
        subscription is a prefix: ``control/core`` takes a ``control/core2`` too)."""
        topic, _, sender = first.partition(b"/")
        names = self._sender_names
        return topic in self._taken and (names is None or sender in names)

    async def _count_the_core_from_its_log(self) -> None:
        """Start counting the Core's reliable topics after the last numbers its log holds,
        asked before this client subscribes.

        Otherwise the first of the Core's messages or beacons received would set the
        start (:class:`~elaswave.bus.reliable.SeqTracker`): had the transport lost every
        one before an announcement, and the announcement too, the next beacon would
        count the announcement as sent before this client existed, never to be fetched
        (a rank then never hears a failure, and the Core waits for it to stop until its
        deadline). The Core logs each of its messages before sending it, so its log
        holds its last numbers exactly; each later message is received, or missed and
        seen missing (a beacon, a later number) and fetched. Without an answer the first
        evidence sets the start, as without a log service (logged).
        """
        if self._fetcher is None or self._from_start or not self._reliable:
            return
        keys = [(CORE_SENDER, topic) for topic in sorted(self._reliable)]
        timeout_s = min(NUMBERING_ASK_S, self._handshake_timeout)
        last = await self._fetcher.last(keys, timeout_s=timeout_s)
        if last is None:
            logger.warning(
                "bus_core_numbering_unknown",
                receiver=self.sender,
                endpoint=self._fetcher.endpoint,
                timeout_s=timeout_s,
            )
            return
        for (sender, topic), seq in last.items():
            if (sender, topic) in keys:
                self.tracker.advertise(sender, topic, seq)

    async def _handshake(self, sub_sync: zmq.Socket[bytes]) -> None:
        assert self._pub is not None
        assert self._sub is not None
        hello = encode(Hello(sender=self.sender, nonce=self.nonce, time=time.time()))
        self._own_hello = hello
        interval_ms = max(1, int(self._hello_interval * 1000))
        try:
            async with asyncio.timeout(self._handshake_timeout):
                while True:
                    await self._pub.send_multipart(hello)
                    # A wait that ends early when something arrives. Its answer is not
                    # trusted: ZeroMQ's descriptor is edge-triggered, and a missed edge
                    # must not stall us, so the socket is read on every round regardless.
                    await self._sub.poll(interval_ms)  # POLLIN, the default
                    while True:
                        try:
                            frames = sub_sync.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if frames == hello:
                            return
                        # Someone else's traffic arriving while we wait: keep it.
                        self._inbox.append(frames)
        except TimeoutError:
            raise BusError(
                f"bus client {self.sender!r} got no echo of its hello within "
                f"{self._handshake_timeout:g} s: is a broker running with publish endpoint "
                f"{self.publish_endpoint} and subscribe endpoint {self.subscribe_endpoint}?"
            ) from None

    async def flush(self, timeout_s: float = 2.0) -> bool:
        """Publish again what the Core's log lacks of this client's recent reliable
        messages, until it has them all (True) or ``timeout_s`` passes. Without a log
        service: True. Until then a message lives only in this client's history, and a
        gap is repaired only while the process answers: a client calls this before
        exiting, and after a message the log must keep even if the process is killed
        right after (:meth:`~elaswave.bus.session.Session.confirm`)."""
        if self._fetcher is None or self._pub is None:
            return True
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            recent = self._history.recent(FLUSH_WINDOW)
            have = {(self.sender, t): seqs for t, seqs in recent.items()}
            lacking = await self._fetcher.lacking(have, timeout_s=left)
            if lacking is None:
                return False
            if not any(lacking.values()):
                return True
            for (_, topic), seqs in lacking.items():
                for frames in self._history.get(topic, seqs):
                    await self._pub.send_multipart(frames)
            await asyncio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        return False

    async def close(self) -> None:
        """Close both sockets; queued outgoing messages flush for up to ``linger``. Idempotent."""
        self._closed = True
        self._sub_sync = None
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None
        if self._pub is not None:
            self._pub.close(linger=self._linger_ms)
            self._pub = None
        self._inbox.clear()
        if self._fetcher is not None:
            self._fetcher.close()

    def delivery(self) -> dict[str, int]:
        """Delivery counters: what was dropped as a duplicate, filled late, asked for
        again and fetched, and what the fault-injecting link did (if any)."""
        return {
            "rejected": self.rejected,
            "duplicates": self.duplicates,
            "filled": self.tracker.filled,
            "asked": self.asked,
            "fetched": self.fetched,
            "given_up": self.tracker.given_up,
            **{f"injected_{k}": v for k, v in self.faults_injected.items()},
        }

    @property
    def faults_injected(self) -> dict[str, int]:
        """What the fault-injecting link did so far (all zero without one)."""
        if self._link is None:
            return {"dropped": 0, "duplicated": 0, "reordered": 0, "delayed": 0}
        return dict(self._link.counts)

    async def __aenter__(self) -> Self:
        await self.connect()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # ------------------------------------------------------------------ publish

    async def publish(self, event: Event) -> Event:
        """Stamp ``sender``, the next ``seq`` (1, 2, ...; 0 for a kind that is not
        numbered: a beacon) and ``time`` (if 0), then send.

        Numbers count per topic. Returns the event as sent. Never waits on subscribers: a
        PUB socket drops at its high-water mark rather than block.
        """
        if self._pub is None or self._closed:
            raise BusError(f"bus client {self.sender!r} is not connected")
        topic = event.TOPIC.value
        seq = 0
        if event.NUMBERED:
            seq = self._seq[topic] = self._seq.get(topic, 0) + 1
        stamped = _stamp(event, self.sender, seq)
        frames = encode(stamped)
        if seq and event.TOPIC in RELIABLE_TOPICS:
            self._history.add(topic, seq, frames)
        if self._on_publish is not None:
            self._on_publish(frames)
        await self._pub.send_multipart(frames)
        return stamped

    async def publish_raw(self, frames: Sequence[bytes]) -> None:
        """Send frames exactly as given (tests and tools; no validation, no stamping)."""
        if self._pub is None or self._closed:
            raise BusError(f"bus client {self.sender!r} is not connected")
        await self._pub.send_multipart(list(frames))

    # ------------------------------------------------------------------ receive

    async def recv(self) -> Event:
        """Return the next valid event on the subscribed topics.

        Invalid messages and :class:`~elaswave.bus.schema.Hello` handshakes are skipped.
        """
        while True:
            message = await self.recv_raw()
            if message.event is not None and not isinstance(message.event, Hello):
                return message.event

    async def recv_raw(self) -> RawMessage:
        """Return the next message on the subscribed topics, valid or not.

        Other clients' hellos are included (they belong in the core's log); late copies
        of this client's own handshake hello are not.
        """
        while True:
            if not self._inbox:
                await self._fill()
            frames = self._inbox.popleft()
            if not frames or not self._wanted(frames[0]):
                continue  # not asked for: CONTROL kept for the handshake, a prefix's catch
            if frames == self._own_hello:
                continue  # a hello sent before the first one came back
            try:
                event = decode(frames)
            except SchemaError as exc:
                self.rejected += 1
                self._log_rejected(
                    "bus_message_rejected",
                    receiver=self.sender,
                    error=str(exc),
                    num_frames=len(frames),
                    num_rejected=self.rejected,
                )
                return RawMessage(frames, None, str(exc))
            if not await self._admit(event):
                continue
            return RawMessage(frames, event, None)

    async def _admit(self, event: Event) -> bool:
        """Delivery bookkeeping for one decoded event; False: do not hand it out."""
        if event.seq > 0 and not self.tracker.accept(event.sender, event.TOPIC.value, event.seq):
            self.duplicates += 1
            return False
        if isinstance(event, Hello):
            self.tracker.restarted(event.sender, event.nonce)
        elif isinstance(event, Beacon):
            for topic, last in zip(event.topics, event.seqs, strict=False):
                if topic in self._reliable:
                    self.tracker.advertise(event.sender, topic, last)
        elif isinstance(event, ResendRequest) and event.target == self.sender:
            assert self._pub is not None
            for frames in self._history.get(event.topic, event.seqs):
                await self._pub.send_multipart(frames)
        shows_gaps = event.seq > 0 or isinstance(event, Beacon)  # what opens one
        if self._gap is not None and shows_gaps and self.tracker.open(self._reliable):
            self._gap.set()
        return event.TOPIC is not Topic.CONTROL or Topic.CONTROL in self.topics

    async def _fill(self) -> None:
        """Wait until messages are queued: from the socket (through the fault-injecting
        link, if any), or repaired ones handed in by :meth:`maintain`."""
        if self._sub is None or self._sub_sync is None or self._wake is None:
            raise BusError(f"bus client {self.sender!r} is not connected")
        sub, sub_sync, link = self._sub, self._sub_sync, self._link
        while not self._inbox:
            taken = 0
            for _ in range(self._drain_batch):
                try:
                    frames = sub_sync.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                taken += 1
                if link is None:
                    self._inbox.append(frames)
                else:
                    link.feed(frames)
            if link is not None:
                if not taken:
                    link.flush_held()
                self._inbox.extend(link.ready())
            if self._inbox:
                return
            # A wait that ends early when something arrives or is handed in; its answer
            # is not trusted (an edge-triggered descriptor may miss one), hence the cap.
            wait_s = 0.1 if link is None or (due := link.next_due()) is None else min(0.1, due)
            self._wake.clear()
            poll = asyncio.ensure_future(sub.poll(max(1, int(wait_s * 1000))))
            wake = asyncio.ensure_future(self._wake.wait())
            try:
                await asyncio.wait({poll, wake}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                poll.cancel()
                wake.cancel()

    # ------------------------------------------------------------------ delivery

    async def maintain(self, beacon_interval_s: float = BEACON_INTERVAL_S) -> None:
        """Publish this client's beacon and repair gaps on reliable topics, until cancelled.

        Run it as a task beside the one receiving (both on the client's loop).
        """
        last_beacon = 0.0
        while True:
            now = time.monotonic()
            if now - last_beacon >= beacon_interval_s:
                last_beacon = now
                topics = sorted(t.value for t in RELIABLE_TOPICS)
                seqs = [self._seq.get(t, 0) for t in topics]
                await self.publish(Beacon(sender=self.sender, topics=topics, seqs=seqs))
            await self.repair()
            if self.tracker.open(self._reliable):
                await asyncio.sleep(REPAIR_TICK_S)
            else:
                await self._until_gap(last_beacon + beacon_interval_s - time.monotonic())

    async def _until_gap(self, timeout_s: float) -> None:
        """Sleep ``timeout_s`` or until a received message opens a gap."""
        gap = self._gap
        if gap is None:
            await asyncio.sleep(max(0.0, timeout_s))
            return
        if timeout_s > 0 and not gap.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await gap.wait()
        gap.clear()

    async def repair(self) -> int:
        """Ask once for every gap due for (re)asking; returns how many numbers were asked."""
        now = time.monotonic()
        due: dict[tuple[str, str], list[int]] = {}
        for key, seqs in self.tracker.missing(self._reliable, older_than=REPAIR_AFTER_S).items():
            wanted = [s for s in seqs if now - self._asked.get((*key, s), 0.0) >= RETRY_S][:512]
            if wanted:
                due[key] = wanted
                for s in wanted:
                    self._asked[(*key, s)] = now
        if not due:
            return 0
        asked = sum(len(v) for v in due.values())
        self.asked += asked
        logger.info(
            "bus_gap", receiver=self.sender, gaps={f"{s}/{t}": v for (s, t), v in due.items()}
        )
        if self._fetcher is not None:
            frames = await self._fetcher.fetch(due, timeout_s=1.0)
            if frames:
                self.fetched += len(frames)
                self._inbox.extend(frames)
                assert self._wake is not None
                self._wake.set()
        else:
            for (sender, topic), seqs in due.items():
                await self.publish(
                    ResendRequest(sender=self.sender, target=sender, topic=topic, seqs=seqs)
                )
        if len(self._asked) > 4 * 4096:  # forget attempts on gaps long filled
            open_ = {(*k, s) for k, v in self.tracker.missing(self._reliable).items() for s in v}
            self._asked = {k: t for k, t in self._asked.items() if k in open_}
        return asked


def _stamp(event: Event, sender: str, seq: int) -> Event:
    """Return ``event`` with sender, seq and (when unset) time filled in."""
    return dataclasses.replace(event, sender=sender, seq=seq, time=event.time or time.time())
