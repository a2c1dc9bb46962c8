"""Session: a bus connection in its own uvloop thread, used from sync code and other loops."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator

import pytest
import structlog

from elaswave.bus.broker import Broker
from elaswave.bus.client import BusClient, BusError
from elaswave.bus.schema import (
    Event,
    EventKind,
    Heartbeat,
    RecoveryFinished,
    RecoveryStarted,
    StepCompleted,
    Topic,
)
from elaswave.bus.session import Session

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def broker() -> Iterator[Broker]:
    with Broker() as running:
        yield running


@pytest.fixture
def session(broker: Broker) -> Iterator[Session]:
    with Session("trainer", broker.publish_endpoint, broker.subscribe_endpoint) as running:
        yield running


@pytest.fixture
async def peer(broker: Broker) -> AsyncIterator[BusClient]:
    async with BusClient("core", broker.publish_endpoint, broker.subscribe_endpoint) as client:
        yield client


def _recovery() -> list[Event]:
    return [
        RecoveryStarted(sender="", step=4, kind="fail", ranks=[1], reason="rank 1 exited"),
        StepCompleted(sender="", rank=0, step=4, loss=1.25, step_time_s=0.3, samples=16),
        RecoveryFinished(sender="", step=4, kind="fail", ranks=[1], mttr_s=0.8),
        StepCompleted(sender="", rank=0, step=5, loss=1.0, step_time_s=0.3, samples=16),
    ]


RECOVERY_KINDS = [EventKind.RECOVERY_STARTED, EventKind.RECOVERY_FINISHED]


async def test_subscribe_and_events_filter_by_kind(session: Session, peer: BusClient) -> None:
    seen_by_callback: list[Event] = []
    callback_threads: set[str] = set()
    all_recovery = threading.Event()

    def on_recovery(event: Event) -> None:
        callback_threads.add(threading.current_thread().name)
        seen_by_callback.append(event)
        if len(seen_by_callback) == 2:
            all_recovery.set()

    session.subscribe(on_recovery, kinds=RECOVERY_KINDS)
    steps = session.events(kinds=[EventKind.STEP_COMPLETED])
    everything = session.events()

    sent = [await peer.publish(event) for event in _recovery()]

    async with asyncio.timeout(10):
        got_steps = [await anext(steps) for _ in range(2)]
        got_all: list[Event] = []
        async for event in everything:
            if event.sender == "core":
                got_all.append(event)
            if len(got_all) == len(sent):
                break
        assert await asyncio.to_thread(all_recovery.wait, 10)

    assert got_steps == [sent[1], sent[3]]
    assert got_all == sent
    assert seen_by_callback == [sent[0], sent[2]]
    assert callback_threads == {"elaswave-session-trainer"}


async def test_publish_from_main_thread_reaches_other_client(
    session: Session, peer: BusClient
) -> None:
    for step in range(3):
        session.publish(Heartbeat(sender="ignored", rank=3, step=step))
    async with asyncio.timeout(10):
        received = [await _recv_from(peer, "trainer", Heartbeat) for _ in range(3)]
    assert [e.step for e in received] == [0, 1, 2]
    assert [e.seq for e in received] == [1, 2, 3]
    assert all(e.time > 0 for e in received)
    assert session.dropped == 0


async def _recv_from(client: BusClient, sender: str, kind: type[Event]) -> Event:
    """The next ``kind`` from ``sender``; other traffic (the sender's delivery beacons
    among it, which come on their own clock) is passed over."""
    while True:
        event = await client.recv()
        if event.sender == sender and isinstance(event, kind):
            return event


def test_publish_from_many_threads_never_blocks_and_keeps_counts(broker: Broker) -> None:
    received: list[Event] = []
    done = threading.Event()
    num_threads, per_thread = 4, 500
    with Session("trainer", broker.publish_endpoint, broker.subscribe_endpoint) as session:

        def collect(event: Event) -> None:
            received.append(event)
            if len(received) == num_threads * per_thread:
                done.set()

        session.subscribe(collect, kinds=[EventKind.HEARTBEAT])

        def hammer(rank: int) -> None:
            for step in range(per_thread):
                session.publish(Heartbeat(sender="", rank=rank, step=step))

        threads = [threading.Thread(target=hammer, args=(rank,)) for rank in range(num_threads)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert done.wait(10)
    assert sorted(e.seq for e in received) == list(range(1, num_threads * per_thread + 1))
    for rank in range(num_threads):
        assert [e.step for e in received if e.rank == rank] == list(range(per_thread))


def test_full_queue_drops_and_counts(broker: Broker) -> None:
    with Session(
        "trainer", broker.publish_endpoint, broker.subscribe_endpoint, queue_size=1
    ) as session:
        blocker = threading.Event()
        # Park the loop thread: the five publishes then reach a queue of one at once.
        session._loop.call_soon_threadsafe(blocker.wait, 10)  # type: ignore[union-attr]
        with structlog.testing.capture_logs() as logs:
            for step in range(5):
                session.publish(Heartbeat(sender="", rank=0, step=step))
            blocker.set()
            session.close()
    assert session.dropped == 4
    dropped_logs = [e for e in logs if e["event"] == "session_event_dropped"]
    assert [e["num_dropped"] for e in dropped_logs] == [1, 2, 4]


async def test_callback_exception_is_logged_and_session_survives(
    session: Session, peer: BusClient
) -> None:
    later = asyncio.Queue[Event]()
    loop = asyncio.get_running_loop()

    def broken(event: Event) -> None:
        raise RuntimeError(f"callback bug at step {event.step}")  # type: ignore[attr-defined]

    session.subscribe(broken, kinds=[EventKind.HEARTBEAT])
    # Heartbeats only: the peer's beacon (every 0.25 s) may come between the two.
    session.subscribe(
        lambda e: loop.call_soon_threadsafe(later.put_nowait, e), kinds=[EventKind.HEARTBEAT]
    )
    with structlog.testing.capture_logs() as logs:
        await peer.publish(Heartbeat(sender="", rank=0, step=1))
        await peer.publish(Heartbeat(sender="", rank=0, step=2))
        async with asyncio.timeout(10):
            steps = [(await later.get()).step for _ in range(2)]  # type: ignore[attr-defined]
    assert steps == [1, 2]
    failures = [e for e in logs if e["event"] == "session_callback_failed"]
    assert len(failures) == 2
    assert session.running


async def test_unsubscribe_stops_delivery(session: Session, peer: BusClient) -> None:
    first: list[Event] = []
    second = asyncio.Queue[Event]()
    loop = asyncio.get_running_loop()
    unsubscribe = session.subscribe(first.append)
    session.subscribe(lambda e: loop.call_soon_threadsafe(second.put_nowait, e))
    unsubscribe()
    unsubscribe()  # idempotent
    await peer.publish(Heartbeat(sender="", rank=0, step=1))
    async with asyncio.timeout(10):
        await second.get()
    assert first == []


async def test_events_end_when_session_closes_after_buffered_ones(
    broker: Broker, peer: BusClient
) -> None:
    session = Session("watcher", broker.publish_endpoint, broker.subscribe_endpoint)
    stream = session.events(kinds=[EventKind.HEARTBEAT], maxsize=2)  # before start: no loss
    await asyncio.to_thread(session.start)
    got = asyncio.Queue[Event]()
    loop = asyncio.get_running_loop()
    session.subscribe(lambda e: loop.call_soon_threadsafe(got.put_nowait, e))
    for step in range(4):
        await peer.publish(Heartbeat(sender="", rank=0, step=step))
    async with asyncio.timeout(10):
        for _ in range(4):
            await got.get()  # the session has handled all four
    await asyncio.to_thread(session.close)
    async with asyncio.timeout(10):
        remaining = [event.step async for event in stream]  # type: ignore[attr-defined]
    assert remaining == [2, 3]  # maxsize=2: the two oldest were dropped
    assert stream.dropped == 2
    late = session.events()
    async with asyncio.timeout(1):
        assert [e async for e in late] == []


async def test_events_from_a_second_loop_in_another_thread(
    session: Session, peer: BusClient
) -> None:
    ready = threading.Event()

    async def consume() -> list[int]:
        stream = session.events(kinds=[EventKind.STEP_COMPLETED])
        ready.set()
        async with stream:
            return [(await anext(stream)).step for _ in range(2)]  # type: ignore[attr-defined]

    consumer = asyncio.create_task(asyncio.to_thread(asyncio.run, consume()))
    assert await asyncio.to_thread(ready.wait, 10)
    for event in _recovery():
        await peer.publish(event)
    async with asyncio.timeout(10):
        assert await consumer == [4, 5]


def test_start_fails_with_the_clients_error() -> None:
    session = Session("lonely", "tcp://127.0.0.1:9", "tcp://127.0.0.1:9", handshake_timeout=0.2)
    with pytest.raises(BusError, match="no echo of its hello"):
        session.start()
    assert not session.running
    session.close()
    with pytest.raises(RuntimeError, match="started once"):
        session.start()


def test_misuse_is_reported(broker: Broker) -> None:
    session = Session("trainer", broker.publish_endpoint, broker.subscribe_endpoint, [Topic.HEALTH])
    with pytest.raises(BusError, match="before start"):
        session.publish(Heartbeat(sender="", rank=0, step=0))
    with pytest.raises(RuntimeError, match="from a coroutine"):
        session.events()
    with pytest.raises(ValueError, match="not_a_kind"):
        session.subscribe(print, kinds=["not_a_kind"])
    session.close()
    session.close()


async def test_recovery_events_of_a_superseded_generation_are_dropped_and_logged(
    session: Session, peer: BusClient
) -> None:
    """A worker at plan generation 3 must not act on generation 2's recovery messages (a
    late or replayed announcement); it drops them with a logged reason. Other topics
    (metrics) carry no plan, and pass whatever their generation."""
    session.floor_generation = 3
    recovery = session.events(kinds=[EventKind.RECOVERY_STARTED, EventKind.STEP_COMPLETED])
    with structlog.testing.capture_logs() as logs:
        old = RecoveryStarted(sender="", generation=2, step=4, kind="fail", ranks=[1], reason="o")
        new = RecoveryStarted(sender="", generation=3, step=5, kind="fail", ranks=[2], reason="n")
        metric = StepCompleted(sender="", generation=1, rank=0, step=5, loss=1.0,
                               step_time_s=0.1, samples=4)  # fmt: skip
        for event in (old, metric, new):
            await peer.publish(event)
        async with asyncio.timeout(10):
            got = [await anext(recovery) for _ in range(2)]
    assert [(type(e).__name__, e.generation) for e in got] == [
        ("StepCompleted", 1), ("RecoveryStarted", 3),
    ]  # fmt: skip
    assert session.stale == 1
    (logged,) = [e for e in logs if e["event"] == "bus_message_stale"]
    assert logged["generation"] == 2 and logged["floor"] == 3
    assert logged["kind"] == "recovery_started" and logged["sender"] == "core"
