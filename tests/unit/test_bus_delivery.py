"""Delivery on the bus: numbering, gap repair, and the fault-injecting transport."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import cast

import msgpack
import pytest
import zmq

from elaswave.bus.broker import Broker
from elaswave.bus.client import BusClient
from elaswave.bus.codec import decode, encode
from elaswave.bus.eventlog import read_event_log
from elaswave.bus.logservice import Fetcher, LogIndex, LogService
from elaswave.bus.reliable import FLUSH_WINDOW, MAX_GAP, BusFaults, FaultyLink, SeqTracker
from elaswave.bus.schema import (
    CORE_SENDER,
    FailureDetected,
    Heartbeat,
    RecoveryReady,
    StepCompleted,
    Topic,
    WorkerStarted,
)
from elaswave.bus.session import Session
from elaswave.runtime.core.recorder import EVENT_LOG, Core
from elaswave.runtime.worker.steploop import StepLoop


def test_tracker_drops_duplicates_and_fills_gaps_late() -> None:
    t = SeqTracker()
    assert t.accept("core", "recovery", 5)  # first evidence: numbering starts here
    assert not t.accept("core", "recovery", 5)
    assert t.accept("core", "recovery", 8)
    assert t.missing(["recovery"]) == {("core", "recovery"): [6, 7]}
    assert t.accept("core", "recovery", 7)  # reordered: late, still delivered once
    assert not t.accept("core", "recovery", 7)
    assert t.missing(["recovery"]) == {("core", "recovery"): [6]}
    assert t.filled == 1
    assert t.missing(["metrics"]) == {}


def test_tracker_keeps_the_newest_missing_numbers_of_reliable_topics_only() -> None:
    """Health messages are replaced by the next: their gaps are not kept (a restarted
    Core reading back a log of sampled heartbeats kept 10000 a rank, at a min() over
    them for each record). A reliable topic's gap keeps its newest MAX_GAP numbers."""
    t = SeqTracker(from_start=True)
    assert t.accept("rank1", "health", 1) and t.accept("rank1", "health", 50_000)
    assert not t.accept("rank1", "health", 20)  # late: dropped as a duplicate
    assert t.missing(["health"]) == {} and t.given_up == 0
    for seq in (1, 5, MAX_GAP + 10, 3 * MAX_GAP):
        assert t.accept("rank1", "metrics", seq)
    (missing,) = t.missing(["metrics"]).values()
    assert missing == list(range(2 * MAX_GAP, 3 * MAX_GAP))
    assert t.given_up == 3 * MAX_GAP - 1 - 3 - MAX_GAP


def test_beacon_reveals_a_lost_last_message() -> None:
    t = SeqTracker()
    t.advertise("core", "recovery", 3)  # first evidence: 1..3 came before this receiver
    assert t.missing(["recovery"]) == {}
    assert t.accept("core", "recovery", 4)
    t.advertise("core", "recovery", 6)  # 5 and 6 were sent; nothing else will follow
    assert t.missing(["recovery"]) == {("core", "recovery"): [5, 6]}


def test_a_gone_sender_is_no_longer_waited_for() -> None:
    t = SeqTracker()
    assert t.accept("rank3", "recovery", 1)
    assert t.accept("rank3", "recovery", 4)
    t.forget("rank3")
    assert t.missing(["recovery"]) == {}
    assert not t.accept("rank3", "recovery", 4)  # a late copy is still a duplicate


def test_from_start_receivers_expect_every_number_and_restarts_count_again() -> None:
    t = SeqTracker(from_start=True)
    assert t.accept("rank1", "recovery", 3)
    assert t.missing(["recovery"]) == {("rank1", "recovery"): [1, 2]}
    t.restarted("rank1", "nonce-a")
    t.restarted("rank1", "nonce-a")  # a late copy of the same hello changes nothing
    assert t.missing(["recovery"]) == {("rank1", "recovery"): [1, 2]}
    t.restarted("rank1", "nonce-b")  # a new process under the same name
    assert t.missing(["recovery"]) == {}
    assert t.accept("rank1", "recovery", 1)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("drop=1.5", "drop=1.5: must be a probability in [0, 1)"),
        ("lose=0.1", "NAME one of drop, dup, reorder, delay, seed"),
        ("drop", "expected NAME=VALUE"),
        ("dup=x", "'x' is not a number"),
        ("drop=0.1,drop=0.2", "'drop' given twice"),
        ("delay=9", "delay=9.0: must be 0 to 5 seconds"),
    ],
)
def test_bad_fault_specs_are_refused_naming_the_value(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(")", r"\)")):
        BusFaults.parse(text)


def test_fault_spec_round_trip() -> None:
    f = BusFaults.parse("drop=0.1, dup=0.05,reorder=0.2,delay=0.01,seed=7")
    assert f == BusFaults(drop=0.1, duplicate=0.05, reorder=0.2, delay_s=0.01, seed=7)
    assert BusFaults.parse("") == BusFaults()
    assert not BusFaults.parse("").active


def test_faulty_link_drops_duplicates_and_reorders() -> None:
    link = BusFaults(drop=0.2, duplicate=0.2, reorder=0.2, seed=3).injector("x")
    out = []
    for i in range(2000):
        link.feed([b"recovery", str(i).encode()])
        out.extend(link.ready())
    link.flush_held()
    out.extend(link.ready())
    got = [int(m[1]) for m in out]
    c = link.counts
    assert 300 < c["dropped"] < 500 and 250 < c["duplicated"] < 400 and c["reordered"] > 200
    assert len(got) == 2000 - c["dropped"] + c["duplicated"]
    assert got != sorted(got)


def test_log_service_answers_fetches_and_refuses_bad_requests() -> None:
    index = LogIndex(size=3)
    for seq in range(1, 6):
        index.add("core", "recovery", seq, [b"recovery", str(seq).encode()])
    service = LogService(index).start()
    try:

        async def go() -> tuple[list[list[bytes]], dict[tuple[str, str], int] | None, dict]:
            fetcher = Fetcher(service.endpoint)
            got = await fetcher.fetch({("core", "recovery"): [1, 4, 5, 9]}, timeout_s=5)
            last = await fetcher.last([("core", "recovery"), ("core", "control")], timeout_s=5)
            fetcher.close()
            raw = zmq.asyncio.Context.instance().socket(zmq.DEALER)
            raw.connect(service.endpoint)
            await raw.send(msgpack.packb({"id": 1, "want": [["core", "recovery", ["x"]]]}))
            reply = msgpack.unpackb(await asyncio.wait_for(raw.recv(), 5))
            raw.close(linger=0)
            return got, last, reply

        got, last, reply = asyncio.run(go())
        assert got == [[b"recovery", b"4"], [b"recovery", b"5"]]  # 1 fell out of the index
        assert last == {("core", "recovery"): 5, ("core", "control"): 0}
        assert "bad want entry" in reply["error"]
    finally:
        service.close()


FAULTS = BusFaults(drop=0.25, duplicate=0.15, reorder=0.15, delay_s=0.01, seed=11)


def _failure(i: int) -> FailureDetected:
    return FailureDetected(sender="", generation=i, ranks=[i], source="test")


def _ready(i: int) -> RecoveryReady:
    return RecoveryReady(sender="", generation=i, rank=1, committed_step=i)


async def _exchange(count: int) -> tuple[list[int], list[int], BusClient, BusClient]:
    """A Core-like client (log service, counts from 1) and a worker-like one (fetches
    from it) exchange ``count`` recovery events each, both receiving through FAULTS."""
    with Broker() as broker:
        index = LogIndex()
        service = LogService(index).start()
        ends = broker.publish_endpoint, broker.subscribe_endpoint
        core = BusClient("core", *ends, from_start=True, faults=FAULTS)
        worker = BusClient(
            "rank1", *ends, topics=[Topic.RECOVERY, Topic.CONTROL],
            fetch_endpoint=service.endpoint, faults=FAULTS,
        )  # fmt: skip
        await core.connect()
        await worker.connect()
        at_core: list[int] = []
        at_worker: list[int] = []

        async def core_receive() -> None:
            while True:
                frames, event, _ = await core.recv_raw()
                assert event is not None
                index.add(event.sender, event.TOPIC.value, event.seq, frames)
                if isinstance(event, RecoveryReady):
                    at_core.append(event.generation)

        async def worker_receive() -> None:
            while True:
                event = await worker.recv()
                if isinstance(event, FailureDetected):
                    at_worker.append(event.generation)

        try:
            async with asyncio.TaskGroup() as tasks:
                running = [
                    tasks.create_task(core_receive()),
                    tasks.create_task(worker_receive()),
                    tasks.create_task(core.maintain()),
                    tasks.create_task(worker.maintain()),
                ]
                await asyncio.sleep(0.3)  # beacons: each side learns where the other starts
                for i in range(count):
                    sent = await core.publish(_failure(i))
                    index.add("core", "recovery", sent.seq, encode(sent))
                    await worker.publish(_ready(i))
                    # Interleave noise on an unreliable topic, and let time pass.
                    await worker.publish(Heartbeat(sender="", rank=1, step=i))
                    await core.publish(StepCompleted(
                        sender="", rank=1, step=i, loss=0.0, step_time_s=0.0, samples=1
                    ))  # fmt: skip
                    if i % 10 == 0:
                        await asyncio.sleep(0.005)
                async with asyncio.timeout(20):
                    while len(at_core) < count or len(at_worker) < count:  # noqa: ASYNC110
                        await asyncio.sleep(0.05)
                for task in running:
                    task.cancel()
        except* asyncio.CancelledError:
            pass
        finally:
            await worker.close()
            await core.close()
            service.close()
        return at_core, at_worker, core, worker


def test_every_recovery_event_arrives_exactly_once_through_a_faulty_transport() -> None:
    count = 300
    at_core, at_worker, core, worker = asyncio.run(_exchange(count))
    # Exactly once each: nothing lost, nothing twice (order may differ: reordering).
    assert collections.Counter(at_core) == collections.Counter(range(count))
    assert collections.Counter(at_worker) == collections.Counter(range(count))
    # The transport did its worst, and both repair paths were used.
    for client in (core, worker):
        assert client.faults_injected["dropped"] > 50
        assert client.faults_injected["duplicated"] > 20
        assert client.duplicates > 20
        assert client.asked > 0
    assert worker.fetched > 0  # from the Core's log
    assert at_core != sorted(at_core) or at_worker != sorted(at_worker)


def test_a_client_about_to_exit_publishes_again_what_the_core_lacks() -> None:
    """No beacon or resend can follow a process that has exited: before closing, a
    client asks the log service what it lacks of its recent messages and sends those."""

    async def go() -> tuple[list[int], bool]:
        with Broker() as broker:
            index = LogIndex()
            service = LogService(index).start()
            ends = broker.publish_endpoint, broker.subscribe_endpoint
            lossy = BusFaults(drop=0.5, seed=5)
            core = BusClient("core", *ends, from_start=True, faults=lossy)
            worker = BusClient("rank1", *ends, topics=[], fetch_endpoint=service.endpoint)
            await core.connect()
            await worker.connect()

            async def record() -> None:
                while True:
                    frames, event, _ = await core.recv_raw()
                    assert event is not None
                    index.add(event.sender, event.TOPIC.value, event.seq, frames)

            task = asyncio.create_task(record())
            for i in range(40):
                await worker.publish(_ready(i))
            await asyncio.sleep(0.2)
            flushed = await worker.flush(timeout_s=5.0)
            await asyncio.sleep(0.1)
            task.cancel()
            await worker.close()
            await core.close()
            service.close()
            return index.lacks("rank1", "recovery", range(1, 41)), flushed

    lacking, flushed = asyncio.run(go())
    assert flushed and lacking == []


@dataclass(frozen=True)
class _Scripted(BusFaults):
    """Faults of one scripted kind, whatever the probabilities: every receive goes
    through a ``link`` of its own."""

    link: Callable[[BusFaults], FaultyLink] | None = None

    @property
    def active(self) -> bool:
        return True

    def injector(self, name: str) -> FaultyLink:
        assert self.link is not None, "a scripted fault names its link"
        return self.link(self)


class _LosingLink(FaultyLink):
    """Loses the first copy of every lifecycle message, and nothing else."""

    def __init__(self, faults: BusFaults) -> None:
        super().__init__(faults, random.Random(0))
        self._seen: set[bytes] = set()

    def feed(self, frames: list[bytes]) -> None:
        if frames[0].startswith(b"lifecycle/") and frames[1] not in self._seen:
            self._seen.add(frames[1])
            self.counts["dropped"] += 1
            return
        super().feed(frames)


@pytest.mark.timeout(60)
def test_a_worker_killed_right_after_it_starts_leaves_its_start_in_the_log(
    tmp_path, monkeypatch
) -> None:
    """The Core's receive loses a worker's WorkerStarted, and the worker is killed in its
    first step: it flushes nothing on the way out and answers no resend request. Its
    start is in the event log all the same: the worker waits for the log to hold it
    before it goes on (the lossy-bus recovery test lost rank 1's start this way)."""

    async def nothing(timeout_s: float = 2.0) -> bool:
        return True

    async def go() -> None:
        async with Core(tmp_path, faults=_Scripted(link=_LosingLink)) as core:
            listener = asyncio.create_task(core.listen())
            session = Session(
                "rank1", core.publish_endpoint, core.subscribe_endpoint,
                topics=[Topic.CONTROL, Topic.RECOVERY], fetch_endpoint=core.fetch_endpoint,
            )  # fmt: skip
            await asyncio.to_thread(session.start)
            worker = SimpleNamespace(
                ctx=SimpleNamespace(leader=True, local_rank=1, device="cpu"),
                session=session,
                sender="rank1",
                rank=1,
            )
            # the parts of a StepLoop that announcing its start reads
            await asyncio.to_thread(StepLoop._started, cast(StepLoop, worker), 0, 1)
            monkeypatch.setattr(session.client, "flush", nothing)  # SIGKILL: no last words
            await asyncio.to_thread(session.close)
            core.forget_worker(1)
            await asyncio.sleep(0.5)  # what the Core could still do on its own
            listener.cancel()
            assert core.client.faults_injected["dropped"] >= 1

    asyncio.run(go())
    started = [
        r.event for r in read_event_log(tmp_path / EVENT_LOG) if isinstance(r.event, WorkerStarted)
    ]
    assert [(e.rank, e.seq) for e in started] == [(1, 1)]


class _UntilAnnouncedLink(FaultyLink):
    """Loses every message of the Core's up to its first failure announcement
    included, and nothing after it."""

    def __init__(self, faults: BusFaults) -> None:
        super().__init__(faults, random.Random(0))
        self.announced = False

    def feed(self, frames: list[bytes]) -> None:
        event = decode(frames)
        if event.sender == CORE_SENDER and not self.announced:
            self.announced = isinstance(event, FailureDetected)
            self.counts["dropped"] += 1
            return
        super().feed(frames)


@pytest.mark.timeout(60)
def test_a_lost_first_announcement_is_fetched_though_no_beacon_came_before_it(
    tmp_path,
) -> None:
    """A worker loses the Core's beacons from its start on, then the Core's first
    failure announcement: the first it hears of the Core's recovery topic is a beacon
    that counts the announcement already. The worker still fetches it from the Core's
    log (the lossy-bus recovery test, seed 16, waited 60 s on a rank that never heard
    rank 1's failure and never stopped)."""

    async def go() -> tuple[list[FailureDetected], BusClient]:
        async with Core(tmp_path) as core:
            listener = asyncio.create_task(core.listen())
            await asyncio.sleep(0.1)  # the job's workers start after the Core's first beacon
            worker = BusClient(
                "rank3", core.publish_endpoint, core.subscribe_endpoint,
                topics=[Topic.CONTROL, Topic.RECOVERY], fetch_endpoint=core.fetch_endpoint,
                faults=_Scripted(link=_UntilAnnouncedLink),
            )  # fmt: skip
            await worker.connect()
            heard: list[FailureDetected] = []

            async def receive() -> None:
                while True:
                    event = await worker.recv()
                    if isinstance(event, FailureDetected):
                        heard.append(event)

            tasks = [asyncio.create_task(receive()), asyncio.create_task(worker.maintain())]
            await asyncio.sleep(0.6)  # two of the Core's beacons, both lost
            await core.publish(FailureDetected(sender="", ranks=[1], source="process-exit"))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(3.0):  # beacons every 0.25 s; a repair in 0.05 s
                    while not heard:  # noqa: ASYNC110
                        await asyncio.sleep(0.05)
            for task in (*tasks, listener):
                task.cancel()
            await worker.close()
            return heard, worker

    heard, worker = asyncio.run(go())
    assert worker.faults_injected["dropped"] >= 3  # two beacons and the announcement
    assert [e.ranks for e in heard] == [[1]]
    assert worker.fetched >= 1


def test_an_idle_client_sleeps_between_beacons_and_wakes_for_a_gap() -> None:
    """With no number missing, maintain() runs once a beacon interval, not every repair
    tick; a message that shows a number missing wakes it, and the gap is asked for
    within a tick or two of being old enough to ask."""

    async def go() -> tuple[int, float, int]:
        with Broker() as broker:
            ends = broker.publish_endpoint, broker.subscribe_endpoint
            core = BusClient("core", *ends)
            worker = BusClient("rank1", *ends, topics=[Topic.RECOVERY])
            await core.connect()
            await worker.connect()
            rounds = 0
            repair = worker.repair

            async def counted() -> int:
                nonlocal rounds
                rounds += 1
                return await repair()

            worker.repair = counted  # type: ignore[method-assign]
            receiving = asyncio.create_task(_drain(worker))
            maintaining = asyncio.create_task(worker.maintain(beacon_interval_s=0.5))
            await core.publish(_failure(0))  # numbering starts at the first number seen
            await asyncio.sleep(1.0)
            idle_rounds = rounds
            core._seq["recovery"] = core._seq.get("recovery", 0) + 1  # number 2 is lost
            await core.publish(_failure(2))
            gap_at = asyncio.get_running_loop().time()
            while worker.asked == 0 and asyncio.get_running_loop().time() - gap_at < 0.45:  # noqa: ASYNC110
                await asyncio.sleep(0.005)
            asked_after = asyncio.get_running_loop().time() - gap_at
            for task in (receiving, maintaining):
                task.cancel()
            await worker.close()
            await core.close()
            return idle_rounds, asked_after, worker.asked

    idle_rounds, asked_after, asked = asyncio.run(go())
    assert idle_rounds <= 4  # one a beacon (0.5 s) in 1 s; a 50 ms tick would be 20
    assert asked == 1 and asked_after < 0.3  # before the next beacon would have come


async def _drain(client: BusClient) -> None:
    while True:
        await client.recv()


def test_the_log_index_keeps_fewer_of_a_workers_messages_than_of_the_cores() -> None:
    """The index keeps the Core's last HISTORY messages a topic and another sender's last
    KEPT_OF_OTHERS (kept like the Core's, 200 ranks' metrics took 379 MiB); never
    fewer than a client's flush checks, or its flush would find them lacking forever."""
    index = LogIndex(size=8, others=FLUSH_WINDOW)
    for seq in range(1, FLUSH_WINDOW + 20):
        index.add("core", "recovery", seq, [b"recovery/core", b"x"])
        index.add("rank3", "metrics", seq, [b"metrics/rank3", b"x"])
    assert index.lacks("core", "recovery", range(1, FLUSH_WINDOW + 20)) == list(
        range(1, FLUSH_WINDOW + 12)
    )  # the last 8
    assert index.lacks("rank3", "metrics", range(20, FLUSH_WINDOW + 20)) == []
    assert index.lacks("rank3", "metrics", [19]) == [19]
    with pytest.raises(ValueError, match=f"never hold a client's last {FLUSH_WINDOW}"):
        LogIndex(others=FLUSH_WINDOW - 1)


def test_a_log_index_restored_with_the_newest_frames_holds_the_rest_by_number() -> None:
    """A restore point keeps the frames of the Core's messages and of each other
    sender's newest few: the restored index holds the others' older messages by number
    (a sender's flush finds them) and serves the messages it has frames of."""
    index = LogIndex()
    for seq in range(1, 11):
        index.add("core", "recovery", seq, [b"recovery/core", str(seq).encode()])
        index.add("rank3", "metrics", seq, [b"metrics/rank3", str(seq).encode()])
    exported = index.export(recent=3)
    assert sorted(exported) == [
        ("core", "recovery", [], [(s, [b"recovery/core", str(s).encode()]) for s in range(1, 11)]),
        (
            "rank3",
            "metrics",
            list(range(1, 8)),
            [(s, [b"metrics/rank3", str(s).encode()]) for s in (8, 9, 10)],
        ),
    ]
    restored = LogIndex()
    restored.load(exported)
    assert restored.lacks("rank3", "metrics", range(1, 12)) == [11]
    assert restored.last("rank3", "metrics") == 10
    assert [f[1] for f in restored.get("rank3", "metrics", range(1, 11))] == [b"8", b"9", b"10"]
    assert len(restored.get("core", "recovery", range(1, 11))) == 10
    assert sorted(restored.export(recent=3)) == sorted(exported)  # again, the same
    restored.add("rank3", "metrics", 11, [b"metrics/rank3", b"11"])
    assert restored.export(recent=3)[1][2:] == (
        list(range(1, 9)),
        [(s, [b"metrics/rank3", str(s).encode()]) for s in (9, 10, 11)],
    )


def test_the_log_index_keeps_no_health_messages() -> None:
    """Heartbeats and step timings are never fetched, checked or counted: the index
    kept a rank's last 1024 of them beside its metrics (half its memory at 64 ranks)."""
    index = LogIndex()
    for seq in range(1, 4):
        for topic in ("health", "metrics", "recovery"):
            index.add("rank3", topic, seq, [f"{topic}/rank3".encode(), b"x"])
    assert index.lacks("rank3", "health", [1, 2, 3]) == [1, 2, 3]
    assert index.last("rank3", "health") == 0
    assert index.last("rank3", "metrics") == index.last("rank3", "recovery") == 3
