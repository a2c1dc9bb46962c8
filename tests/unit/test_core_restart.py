"""What a restarted Core resumes from, and how workers agree on a pause without it."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest

from elaswave.bus.client import BusClient
from elaswave.bus.eventlog import read_event_log
from elaswave.bus.schema import FailureDetected, Hello, ScaleRequest, StepCompleted
from elaswave.comm.store import connect_store, serve_store
from elaswave.runtime.core.recorder import EVENT_LOG, Core, CorePorts
from elaswave.runtime.worker.outage import OUTAGE_KEY, CoreWatch


class _CountingStore:
    """A real store that counts how often it is used."""

    def __init__(self, store) -> None:
        self.store, self.calls = store, 0

    def __getattr__(self, name):
        self.calls += 1
        return getattr(self.store, name)


def _silent(watch: CoreWatch, seconds: float) -> None:
    watch._last = time.monotonic() - seconds


def test_workers_agree_on_one_boundary_whoever_decides_first() -> None:
    server = serve_store("127.0.0.1", timeout_s=10)
    a = CoreWatch(2.0, connect_store("127.0.0.1", server.port, timeout_s=10))
    b = CoreWatch(2.0, connect_store("127.0.0.1", server.port, timeout_s=10))
    # b reads the key once the Core is silent past look_s, but only a decides, past
    # the bound: at the boundary before step 5 it trains 5 (a peer may be in it).
    _silent(b, 1.5)
    assert not b.pause_before(5)
    _silent(a, 2.5)
    assert not a.pause_before(5)
    assert server.get(OUTAGE_KEY) == b"6"
    assert not b.pause_before(5)  # b, one step behind, trains on to the agreed boundary
    assert a.pause_before(6) and b.pause_before(6)
    # A later outage is decided afresh; the old key does not pause anyone.
    _silent(a, 0.0)
    _silent(b, 0.0)
    assert not a.pause_before(9) and not b.pause_before(9)
    _silent(a, 3.0)
    _silent(b, 3.0)
    assert not b.pause_before(12) and server.get(OUTAGE_KEY) == b"13"
    assert not a.pause_before(12)
    assert a.pause_before(13) and b.pause_before(13)


def test_a_heard_core_costs_no_store_traffic() -> None:
    server = serve_store("127.0.0.1", timeout_s=10)
    store = _CountingStore(connect_store("127.0.0.1", server.port, timeout_s=10))
    watch = CoreWatch(10.0, store)
    watch.heard(StepCompleted(sender="core", rank=0, step=0, loss=0, step_time_s=0, samples=1))
    for step in range(100):
        assert not watch.pause_before(step)
    assert store.calls == 0
    _silent(watch, 1.5)  # silent past look_s: it reads the key, but does not decide yet
    assert not watch.pause_before(100)
    assert store.calls > 0 and not server.check([OUTAGE_KEY])


def test_a_paused_worker_resumes_when_it_hears_the_core_or_a_failure_is_announced() -> None:
    watch = CoreWatch(1.0)
    _silent(watch, 5.0)
    started = time.monotonic()
    watch.wait(3, interrupted=lambda: time.monotonic() - started > 0.2)
    assert 0.2 <= time.monotonic() - started < 2.0
    _silent(watch, 5.0)
    asyncio.run(asyncio.sleep(0))
    loop_started = time.monotonic()

    def hear_later() -> bool:
        if time.monotonic() - loop_started > 0.1:
            watch.heard(Hello(sender="core", nonce="n"))
        return False

    watch.wait(3, interrupted=hear_later)
    assert watch.pauses == 2


@pytest.mark.timeout(60)
def test_a_restarted_core_continues_its_numbering_and_its_log(tmp_path) -> None:
    """It binds the same ports, numbers on from the log, keeps its announcements, and
    cuts off a record its predecessor's death left half written."""

    async def first() -> tuple[CorePorts, int]:
        async with Core(tmp_path, nonce="core-x") as core:
            listener = asyncio.create_task(core.listen())
            for gen in range(3):
                await core.publish(
                    FailureDetected(sender="core", generation=gen, ranks=[1], source="test")
                )
            await core.wait_until(lambda: len(core.announcements) == 3, 5.0)
            listener.cancel()
            ports = CorePorts.of(core.publish_endpoint, core.subscribe_endpoint, "")
            return ports, core.client._seq["recovery"]

    ports, last = asyncio.run(first())
    assert last == 3
    with (tmp_path / EVENT_LOG).open("ab") as f:  # a record cut short by SIGKILL
        f.write(msgpack.packb({"t": 1.0, "frames": [b"recovery", b"x" * 100]})[:40])

    async def second() -> tuple[int, list, str, int]:
        async with Core(tmp_path, nonce="core-x", ports=ports, restore=True) as core:
            listener = asyncio.create_task(core.listen())
            watcher = BusClient("rank0", core.publish_endpoint, core.subscribe_endpoint)
            await watcher.connect()
            sent = await core.publish(
                FailureDetected(sender="core", generation=3, ranks=[2], source="test")
            )
            async with asyncio.timeout(5.0):  # the Core's beacons come on their own clock
                while not isinstance(got := await watcher.recv(), FailureDetected):
                    pass
            await watcher.close()
            listener.cancel()
            return sent.seq, list(core.announcements), core.publish_endpoint, got.seq

    seq, announced, endpoint, received = asyncio.run(second())
    assert seq == received == 4
    assert [e.generation for e in announced][:3] == [0, 1, 2]  # read back from the log
    assert endpoint.endswith(f":{ports.publish}")
    records = list(read_event_log(tmp_path / EVENT_LOG))
    assert all(r.error is None for r in records), [r.error for r in records if r.error]
    assert [r.event.seq for r in records if isinstance(r.event, FailureDetected)] == [1, 2, 3, 4]


def _record_ends(path) -> list[int]:
    """Where each record of an event log ends (the log's length with it)."""
    with path.open("rb") as f:
        unpacker = msgpack.Unpacker(f, raw=False)
        ends = []
        for _ in unpacker:
            ends.append(unpacker.tell())
        return ends


@pytest.mark.timeout(60)
def test_a_restarted_core_reads_back_the_protocol_events_its_state_has_not_taken_in(
    tmp_path,
) -> None:
    """Each event the protocol takes carries its record's position in the log; a
    restarted Core given the position its persisted state has taken in reads back only
    the protocol's events after it, and every scale request (numbered from the start)."""

    def metrics(step: int) -> StepCompleted:
        return StepCompleted(sender="", rank=0, step=step, loss=1.0, step_time_s=0.1, samples=4)

    async def first() -> tuple[CorePorts, list]:
        async with Core(tmp_path, nonce="core-x") as core:
            listener = asyncio.create_task(core.listen())
            worker = BusClient("rank0", core.publish_endpoint, core.subscribe_endpoint)
            await worker.connect()
            arrivals = []
            with core.protocol_events() as events:
                for step in range(6):
                    await worker.publish(metrics(step))
                    if step == 1:
                        await worker.publish(ScaleRequest(sender="", add=1))
                async with asyncio.timeout(10):
                    while len(arrivals) < 7:
                        arrivals.append(await anext(events))
            await worker.close()
            listener.cancel()
            ports = CorePorts.of(core.publish_endpoint, core.subscribe_endpoint, "")
            return ports, arrivals

    ports, arrivals = asyncio.run(first())
    kinds = [type(a.event).__name__ for a in arrivals]
    assert kinds == ["StepCompleted"] * 2 + ["ScaleRequest"] + ["StepCompleted"] * 4
    ends = _record_ends(tmp_path / EVENT_LOG)
    assert all(a.position in ends for a in arrivals)
    assert [a.position for a in arrivals] == sorted({a.position for a in arrivals})

    async def second(taken: int) -> list:
        async with Core(tmp_path, nonce="core-x", ports=ports, restore=True, taken=taken) as core:
            restored = len(core._backlog)
            with core.protocol_events() as events:
                return [await anext(events) for _ in range(restored)]

    assert [a.event for a in asyncio.run(second(0))] == [a.event for a in arrivals]
    taken = arrivals[4].position  # the state took in steps 0 .. 3 and the request
    backlog = asyncio.run(second(taken))
    assert [a.event for a in backlog] == [arrivals[2].event, arrivals[5].event, arrivals[6].event]
    assert [a.position for a in backlog] == [arrivals[i].position for i in (2, 5, 6)]
