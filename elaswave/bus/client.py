"""Async publish/subscribe client for the ElasWave bus (``zmq.asyncio``, works under uvloop).

A :class:`BusClient` owns one PUB socket connected to the broker's XSUB and one SUB
socket connected to the broker's XPUB. :meth:`BusClient.connect` ends with a handshake
against ZeroMQ's *slow-joiner* problem (a PUB drops everything sent before the
subscriptions have reached it): the client publishes a :class:`~elaswave.bus.schema.Hello`
carrying a random nonce every ``hello_interval`` seconds until the broker echoes it back
to the client's own SUB socket. Once it has, this client's messages reach the broker and
the broker's messages reach this client.

Receiving never raises for bad input. A message that fails :func:`~elaswave.bus.schema.decode`
is logged once as a warning, counted in :attr:`BusClient.rejected` and skipped by
:meth:`BusClient.recv`; :meth:`BusClient.recv_raw` returns it with its error so that a
caller that logs every message (the core's event log) sees it too.

After one awaited receive, the client drains whatever else is queued through a
synchronous *shadow* of the SUB socket with ``NOBLOCK``: one wake-up per batch rather
than per message (about 3x the throughput of one ``await`` per message, see PLATFORM.md).

One task at a time may call the receive methods; :meth:`publish` may be called from any
task of the client's event loop. A client is bound to the loop it connected in.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import secrets
import time
from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import NamedTuple, Self

import structlog
import zmq
import zmq.asyncio

from elaswave.bus.keys import BusKeys, use_curve
from elaswave.bus.schema import Event, Hello, SchemaError, Topic, decode, encode

logger = structlog.get_logger(__name__)

DEFAULT_HWM = 100_000
"""High-water mark (messages) of the client's sockets."""

_CONTROL_FRAME = Topic.CONTROL.value.encode()


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
        handshake_timeout: seconds :meth:`connect` waits for its own hello.
        hello_interval: seconds between two hellos during the handshake.
        linger: seconds :meth:`close` lets unsent messages flush in the background.
        drain_batch: most messages taken without awaiting after one awaited receive.
        keys: the job's CURVE keys when its broker has them (:mod:`elaswave.bus.keys`);
            without the right ones the handshake never completes (:class:`BusError`).
    """

    def __init__(
        self,
        sender: str,
        publish_endpoint: str,
        subscribe_endpoint: str,
        topics: Iterable[Topic] | None = None,
        *,
        handshake_timeout: float = 10.0,
        hello_interval: float = 0.02,
        linger: float = 1.0,
        drain_batch: int = 1024,
        keys: BusKeys | None = None,
    ) -> None:
        if not sender:
            raise ValueError("sender must be a non-empty name such as 'core' or 'rank3'")
        if handshake_timeout <= 0 or hello_interval <= 0:
            raise ValueError("handshake_timeout and hello_interval must be positive seconds")
        self.sender = sender
        self.publish_endpoint = publish_endpoint
        self.subscribe_endpoint = subscribe_endpoint
        self.topics: frozenset[Topic] = frozenset(Topic if topics is None else topics)
        self._topic_frames = frozenset(t.value.encode() for t in self.topics)
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
        self._seq = 0
        self._closed = False
        self.rejected = 0
        """Number of received messages that failed to decode."""

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
        for topic in self.topics | {Topic.CONTROL}:
            self._sub.setsockopt(zmq.SUBSCRIBE, topic.value.encode())
        sub_sync: zmq.Socket[bytes] = zmq.Socket.shadow(self._sub.underlying)
        try:
            await self._handshake(sub_sync)
        except BaseException:
            await self.close()
            raise
        if Topic.CONTROL not in self.topics:
            self._sub.setsockopt(zmq.UNSUBSCRIBE, Topic.CONTROL.value.encode())
        self._sub_sync = sub_sync
        logger.debug(
            "bus_client_connected", sender=self.sender, topics=sorted(t.value for t in self.topics)
        )

    start = connect

    async def _handshake(self, sub_sync: zmq.Socket[bytes]) -> None:
        assert self._pub is not None
        assert self._sub is not None
        nonce = secrets.token_hex(8)
        hello = encode(Hello(sender=self.sender, nonce=nonce, time=time.time()))
        self._own_hello = hello
        interval_ms = max(1, int(self._hello_interval * 1000))
        try:
            async with asyncio.timeout(self._handshake_timeout):
                while True:
                    await self._pub.send_multipart(hello)
                    # A wait that ends early when something arrives. Its answer is not
                    # trusted: ZeroMQ's descriptor is edge-triggered, and a missed edge
                    # must not stall us, so the socket is read on every round regardless.
                    await self._sub.poll(interval_ms, zmq.POLLIN)
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
        """Stamp ``sender``, the next ``seq`` (1, 2, ...) and ``time`` (if 0), then send.

        Returns the event as sent. Never waits on subscribers: a PUB socket drops at its
        high-water mark rather than block.
        """
        if self._pub is None or self._closed:
            raise BusError(f"bus client {self.sender!r} is not connected")
        self._seq += 1
        stamped = _stamp(event, self.sender, self._seq)
        await self._pub.send_multipart(encode(stamped))
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
            if not frames or frames[0] not in self._topic_frames:
                continue  # leftover from the handshake-only CONTROL subscription
            if frames[0] == _CONTROL_FRAME and frames == self._own_hello:
                continue  # a hello sent before the first one came back
            try:
                event = decode(frames)
            except SchemaError as exc:
                self.rejected += 1
                logger.warning(
                    "bus_message_rejected",
                    receiver=self.sender,
                    error=str(exc),
                    num_frames=len(frames),
                    num_rejected=self.rejected,
                )
                return RawMessage(frames, None, str(exc))
            return RawMessage(frames, event, None)

    async def _fill(self) -> None:
        """Await one message, then take what is already queued without awaiting."""
        if self._sub is None or self._sub_sync is None:
            raise BusError(f"bus client {self.sender!r} is not connected")
        self._inbox.append(await self._sub.recv_multipart())
        sub_sync = self._sub_sync
        for _ in range(self._drain_batch):
            try:
                self._inbox.append(sub_sync.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break


def _stamp(event: Event, sender: str, seq: int) -> Event:
    """Return ``event`` with sender, seq and (when unset) time filled in."""
    return dataclasses.replace(event, sender=sender, seq=seq, time=event.time or time.time())
