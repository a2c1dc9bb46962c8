"""Broker and bus clients over real tcp sockets, under both asyncio and uvloop."""

from __future__ import annotations

import asyncio
import re
import socket
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import msgpack
import pytest
import structlog
import uvloop
import zmq

from elaswave.bus.broker import Broker
from elaswave.bus.client import BusClient, BusError, RawMessage
from elaswave.bus.codec import encode
from elaswave.bus.schema import Beacon, Heartbeat, Hello, RecoveryStarted, StepCompleted, Topic

pytestmark = pytest.mark.timeout(30)

Runner = Callable[[Coroutine[Any, Any, None]], None]
RUNNERS: dict[str, Runner] = {"asyncio": asyncio.run, "uvloop": uvloop.run}


@pytest.fixture(params=list(RUNNERS))
def run(request: pytest.FixtureRequest) -> Runner:
    """Run a coroutine to completion on a fresh asyncio or uvloop event loop."""
    return RUNNERS[request.param]


@pytest.fixture
def broker() -> Iterator[Broker]:
    with Broker() as running:
        yield running


def _client(broker: Broker, sender: str, topics: list[Topic] | None = None) -> BusClient:
    return BusClient(sender, broker.publish_endpoint, broker.subscribe_endpoint, topics)


def _step(step: int, rank: int = 0) -> StepCompleted:
    return StepCompleted(sender="", rank=rank, step=step, loss=1.0, step_time_s=0.1, samples=4)


# --------------------------------------------------------------------------- broker


def test_broker_endpoints_and_idempotent_close() -> None:
    broker = Broker()
    with pytest.raises(RuntimeError, match="after start"):
        _ = broker.publish_endpoint
    broker.start()
    assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", broker.publish_endpoint)
    assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", broker.subscribe_endpoint)
    assert broker.publish_endpoint != broker.subscribe_endpoint
    assert broker.running
    broker.close()
    assert not broker.running
    broker.close()
    with pytest.raises(RuntimeError, match="closed"):
        broker.start()


def test_broker_reports_a_port_in_use() -> None:
    with Broker() as first:
        port = int(first.publish_endpoint.rsplit(":", 1)[1])
        with pytest.raises(RuntimeError, match=f"could not bind.*{port}"):
            Broker(frontend_port=port).start()


# --------------------------------------------------------------------------- clients


def test_two_clients_receive_each_others_events(broker: Broker, run: Runner) -> None:
    async def scenario() -> None:
        async with _client(broker, "core") as core, _client(broker, "rank1") as rank1:
            sent = await rank1.publish(_step(0, rank=1))
            await core.publish(
                RecoveryStarted(sender="", step=3, kind="fail", ranks=[2], reason="killed")
            )
            async with asyncio.timeout(5):
                # Each also hears itself; skip to the other's event.
                got_by_core = await _recv_from(core, "rank1")
                got_by_rank1 = await _recv_from(rank1, "core")
            assert got_by_core == sent
            assert (got_by_core.sender, got_by_core.seq) == ("rank1", 1)
            assert got_by_core.time > 0
            assert isinstance(got_by_rank1, RecoveryStarted)
            assert (got_by_rank1.sender, got_by_rank1.seq, got_by_rank1.ranks) == ("core", 1, [2])

    run(scenario())


async def _recv_from(client: BusClient, sender: str) -> Any:
    while True:
        event = await client.recv()
        if event.sender == sender:
            return event


def test_seq_is_per_client_and_starts_at_one(broker: Broker, run: Runner) -> None:
    async def scenario() -> None:
        async with _client(broker, "rank0") as client:
            stamped = [await client.publish(_step(i)) for i in range(5)]
            assert [e.seq for e in stamped] == [1, 2, 3, 4, 5]
            async with asyncio.timeout(5):
                received = [await client.recv() for _ in range(5)]
            assert received == stamped

    run(scenario())


def test_topic_filter(broker: Broker, run: Runner) -> None:
    async def scenario() -> None:
        async with (
            _client(broker, "watcher", [Topic.METRICS]) as watcher,
            _client(broker, "rank0") as rank0,
        ):
            await rank0.publish(Heartbeat(sender="", rank=0, step=1))
            marker = await rank0.publish(_step(1))
            async with asyncio.timeout(5):
                assert await watcher.recv() == marker  # the heartbeat was never delivered

    run(scenario())


def test_a_client_of_the_cores_messages_receives_no_one_elses(broker: Broker, run: Runner) -> None:
    """A worker takes the Core's messages only: what other processes publish on the same
    topics (beacons, acknowledgements) is the Core's, and a worker that took them would
    handle a number of messages that grows with the job. ``core2`` passes the ZeroMQ
    prefix ``control/core`` and is dropped unread by the client."""

    async def scenario() -> None:
        topics = [Topic.CONTROL, Topic.RECOVERY]
        async with (
            BusClient(
                "rank1", broker.publish_endpoint, broker.subscribe_endpoint, topics,
                senders=["core"],
            ) as rank1,
            _client(broker, "watcher", topics) as watcher,
            _client(broker, "core") as core,
            _client(broker, "rank2") as rank2,
            _client(broker, "core2") as core2,
        ):  # fmt: skip
            others = [
                await client.publish(event)
                for client in (rank2, core2)
                for event in (_started(), Beacon(sender="", topics=["recovery"], seqs=[1]))
            ]
            async with asyncio.timeout(5):  # through the broker, ahead of the Core's
                while others:
                    got = await watcher.recv()
                    others = [e for e in others if e != got]
            marker = await core.publish(_started())
            async with asyncio.timeout(5):
                assert await rank1.recv() == marker
            assert rank1.rejected == 0
            assert rank1.senders == frozenset({"core"})

    run(scenario())


def _started() -> RecoveryStarted:
    return RecoveryStarted(sender="", step=3, kind="fail", ranks=[2], reason="killed")


def test_a_client_without_control_learns_a_lost_last_message_from_a_beacon(
    broker: Broker, run: Runner
) -> None:
    """An observer of the recovery topic alone still takes its senders' beacons (CONTROL),
    so it sees a missing last message: here the Core's beacon says recovery message 2
    was sent, and only 1 came. The other CONTROL events are not handed out."""

    async def scenario() -> None:
        async with (
            _client(broker, "observer", [Topic.RECOVERY, Topic.HEALTH]) as observer,
            _client(broker, "core") as core,
        ):
            first = await core.publish(_started())
            await core.publish(Beacon(sender="", topics=["recovery"], seqs=[2]))
            marker = await core.publish(Heartbeat(sender="", rank=0, step=1))
            async with asyncio.timeout(5):
                assert await observer.recv() == first
                assert await observer.recv() == marker  # the beacon was taken, not handed out
            assert observer.tracker.missing(["recovery"]) == {("core", "recovery"): [2]}

    run(scenario())


def test_garbage_is_counted_and_skipped(broker: Broker, run: Runner) -> None:
    garbage = [
        [b"metrics/raw", b"\xc1\xc1 not msgpack"],
        [b"metrics/raw"],
        [b"metrics/raw", msgpack.packb({"event_kind": "nope", "schema_version": 1})],
        [b"metrics/raw", msgpack.packb({**msgpack.unpackb(encode(_step(0))[1]), "step": "x"})],
        [b"metrics/rank0", encode(_step(1))[1]],  # another sender's name on the frame
    ]

    async def scenario() -> None:
        ctx = zmq.asyncio.Context.instance()
        raw = ctx.socket(zmq.PUB)
        raw.connect(broker.publish_endpoint)
        try:
            async with _client(broker, "core", [Topic.METRICS]) as core:
                # A plain PUB has no handshake: repeat until its messages flow.
                async with asyncio.timeout(5):
                    while True:
                        await raw.send_multipart(encode(_step(-1)))
                        try:
                            async with asyncio.timeout(0.05):
                                await core.recv()
                            break
                        except TimeoutError:
                            continue
                rejected_before = core.rejected
                for frames in garbage:
                    await raw.send_multipart(frames)
                marker = StepCompleted(
                    sender="raw", seq=99, rank=5, step=42, loss=0.5, step_time_s=1, samples=1
                )
                await raw.send_multipart(encode(marker))
                with structlog.testing.capture_logs() as logs:
                    async with asyncio.timeout(5):
                        event = await core.recv()
                        while event.seq != 99:  # leftovers of the warm-up loop
                            event = await core.recv()
                assert event == marker
                assert core.rejected - rejected_before == len(garbage)
                warnings = [e for e in logs if e["event"] == "bus_message_rejected"]
                assert len(warnings) == len(garbage)
                assert "undecodable msgpack" in warnings[0]["error"]
                assert "unknown event kind 'nope'" in warnings[2]["error"]
                assert "names another sender than the payload's ''" in warnings[4]["error"]
        finally:
            raw.close(linger=0)

    run(scenario())


def test_recv_raw_reports_bad_messages_and_hellos(broker: Broker, run: Runner) -> None:
    async def scenario() -> None:
        async with _client(broker, "core") as core:
            await core.publish_raw([b"health/junk", b"junk"])
            async with _client(broker, "rank7"):
                pass  # its hellos reach core
            bad: RawMessage | None = None
            hello: RawMessage | None = None
            async with asyncio.timeout(5):
                while bad is None or hello is None:  # the two senders' order is not defined
                    message = await core.recv_raw()
                    if message.error is not None:
                        bad = message
                    elif isinstance(message.event, Hello) and message.event.sender == "rank7":
                        hello = message
            assert bad.frames == [b"health/junk", b"junk"]
            assert bad.event is None
            assert "undecodable msgpack" in (bad.error or "")
            assert hello.error is None
            assert hello.event is not None
            assert hello.frames == encode(hello.event)
            assert core.rejected == 1

    run(scenario())


def test_late_copies_of_own_hello_are_not_returned(broker: Broker, run: Runner) -> None:
    async def scenario() -> None:
        async with _client(broker, "core") as core:
            own_hello = core._own_hello
            assert own_hello is not None
            await core.publish_raw(own_hello)  # as if a second hello had gone out
            # The marker goes on the hello's own topic: the handshake proved that
            # subscription live, and one topic from one publisher keeps its order.
            marker = await core.publish(Beacon(sender="", topics=[], seqs=[]))
            async with asyncio.timeout(5):
                message = await core.recv_raw()
            assert message.event == marker

    run(scenario())


def test_handshake_deadline_raises_bus_error(run: Runner) -> None:
    with socket.socket() as probe:  # a port with no broker behind it
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"

    async def scenario() -> None:
        client = BusClient("lonely", endpoint, endpoint, handshake_timeout=0.3)
        with pytest.raises(BusError, match=r"no echo of its hello within 0\.3 s"):
            await client.connect()
        assert not client.connected
        with pytest.raises(BusError, match="closed"):
            await client.connect()

    run(scenario())


def test_burst_is_delivered_without_loss(broker: Broker, run: Runner) -> None:
    num_events = 20_000

    async def scenario() -> None:
        async with (
            _client(broker, "rank0") as producer,
            _client(broker, "core", [Topic.METRICS]) as consumer,
        ):

            async def consume() -> list[int]:
                return [(await consumer.recv()).step for _ in range(num_events)]

            async with asyncio.timeout(20), asyncio.TaskGroup() as tasks:
                received = tasks.create_task(consume())
                for step in range(num_events):
                    await producer.publish(_step(step))
                    if step % 500 == 0:
                        await asyncio.sleep(0)
            assert received.result() == list(range(num_events))
            assert consumer.rejected == 0

    run(scenario())


def test_publish_before_connect_raises(broker: Broker, run: Runner) -> None:
    async def scenario() -> None:
        client = _client(broker, "rank0")
        with pytest.raises(BusError, match="not connected"):
            await client.publish(_step(0))
        await client.close()

    run(scenario())
