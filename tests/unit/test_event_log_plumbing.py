"""What the Core's event log leaves out: the bus's liveness plumbing, and the chatter the
health log keeps instead."""

from __future__ import annotations

import asyncio
from pathlib import Path

import hypothesis.strategies as st
from hypothesis import given, settings

from elaswave.bus.client import BusClient
from elaswave.bus.eventlog import read_event_log
from elaswave.bus.rolling import read_rolling_log
from elaswave.bus.schema import (
    Beacon,
    Heartbeat,
    NodeHeartbeat,
    SignalWorker,
    StepCompleted,
    StepTiming,
)
from elaswave.cli.main import main
from elaswave.engine import change as ch
from elaswave.engine import inputs as inp
from elaswave.engine import protocol
from elaswave.rundir import EVENT_LOG, HEALTH_LOG
from elaswave.runtime.core import recorder
from elaswave.runtime.core.recorder import Sink
from tests.unit.test_protocol import _applying_a_join, _job


def _beat(rank: int, step: int) -> Heartbeat:
    return Heartbeat(sender=f"rank{rank}", seq=0, rank=rank, step=step)


def test_beacons_are_not_logged_and_the_chatter_goes_to_the_health_log(
    tmp_path, monkeypatch
) -> None:
    """A worker beats five times a second and beacons four: no beacon is logged; a
    sender's first heartbeat goes to the event log, then one every BEAT_LOG_S to the
    health log; every step timing and node heartbeat to the health log; every other
    event to the event log, every time."""
    clock = [100.0]
    monkeypatch.setattr(recorder.time, "monotonic", lambda: clock[0])
    core = recorder.Core(tmp_path)
    assert core._sink(Beacon(sender="rank0", topics=["control"], seqs=[3])) is Sink.NOWHERE
    kept = []
    for tick in range(60):  # 12 s of two workers' heartbeats, every 0.2 s
        clock[0] = 100.0 + 0.2 * tick
        for beat in (_beat(0, tick), _beat(1, tick)):
            if (sink := core._sink(beat)) is not Sink.NOWHERE:
                kept.append((clock[0], beat.rank, sink))
    for rank in (0, 1):
        assert [(t, sink) for t, r, sink in kept if r == rank] == [
            (100.0, Sink.EVENTS), (105.0, Sink.HEALTH), (110.0, Sink.HEALTH)
        ]  # fmt: skip
    node = NodeHeartbeat(sender="node1", node=1, incarnation="a")
    step = StepCompleted(sender="rank1", rank=1, step=3, loss=1.0, step_time_s=0.2, samples=4)
    for _ in range(2):
        assert core._sink(node) is Sink.HEALTH and core._sink(step) is Sink.EVENTS


def _timing(rank: int, step: int, generation: int = 0) -> StepTiming:
    return StepTiming(
        sender=f"rank{rank}", generation=generation, rank=rank, step=step, compute_s=1,
        expected_s=1, micro_batches=2,
    )  # fmt: skip


def test_the_event_log_keeps_the_step_timings_the_protocol_learns_from(tmp_path) -> None:
    """The change protocol takes from step timings each rank's newest generation and the
    newest step: the first timing of a newer step and a rank's first under a newer
    generation go to the event log, for a successor to read back; the rest to the
    health log. A successor, knowing none, logs the next of each."""
    core = recorder.Core(tmp_path)
    sinks = [
        core._sink(t)
        for t in (
            _timing(0, 0), _timing(1, 0),  # each rank's first (generation 0)
            _timing(0, 1), _timing(1, 1), _timing(1, 1),  # step 1: its first only
            _timing(1, 1, generation=1),  # rank 1 redoes step 1 under generation 1
            _timing(0, 1, generation=1), _timing(0, 2, generation=1), _timing(1, 2, 1),
        )
    ]  # fmt: skip
    E, H = Sink.EVENTS, Sink.HEALTH
    assert sinks == [E, E, E, H, H, E, E, E, H]
    successor = recorder.Core(tmp_path)
    assert [successor._sink(t) for t in (_timing(1, 2, 1), _timing(0, 2, 1))] == [E, E]


def test_a_live_core_logs_the_chatter_apart_and_events_shows_both_in_order(
    tmp_path, capsys
) -> None:
    """Through the bus, two workers a step: the event log holds the step timings the
    protocol learns from and every StepCompleted, the health log the other timings;
    ``elaswave events`` prints both in the order they arrived, and ``--no-health`` the
    event log alone."""
    sent: list[str] = []
    heard: list = []

    async def send(worker: BusClient, event) -> None:
        """Publish ``event`` and wait until the Core has it: the order it arrives in."""
        await worker.publish(event)
        step, kind = event.step, type(event)
        got = lambda: any(type(e) is kind and e.step == step for e in heard)  # noqa: E731
        assert await core.wait_until(got, 10)
        heard.clear()
        sent.append(f"{worker.sender} {event.KIND.value}")

    async def go() -> None:
        nonlocal core
        async with recorder.Core(tmp_path, on_event=heard.append) as core:
            listener = asyncio.create_task(core.listen())
            workers = [
                BusClient(f"rank{r}", core.publish_endpoint, core.subscribe_endpoint)
                for r in (0, 1)
            ]
            for w in workers:
                await w.connect()
            for step in range(3):
                for rank in (0, 1):
                    await send(workers[rank], _timing(rank, step))
                done = StepCompleted(sender="", rank=1, step=step, loss=1, step_time_s=1, samples=2)
                await send(workers[1], done)
            for w in workers:
                await w.close()
            listener.cancel()

    core = None
    asyncio.run(go())
    logged = [type(r.event).__name__ for r in read_event_log(tmp_path / EVENT_LOG)]
    health = [type(r.event).__name__ for r in read_rolling_log(tmp_path / HEALTH_LOG)]
    assert logged.count("StepCompleted") == 3 and logged.count("StepTiming") == 4
    assert health == ["StepTiming"] * 2
    assert main(["events", str(tmp_path)]) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    records = [w for w in lines if w[0].endswith("Z") and w[2] != "hello"]  # not structlog's
    shown = [f"{w[3].split('#')[0]} {w[2]}" for w in records]
    assert shown == sent
    assert main(["events", str(tmp_path), "--no-health"]) == 0
    assert capsys.readouterr().out.count(" step_timing ") == 4


def test_the_cores_own_beacons_stay_out_of_its_log(tmp_path) -> None:
    """The Core beacons on its own clock: none of them reaches its log, and they take no
    number (a restarted Core continues the numbering of what it did log)."""

    async def go() -> list[object]:
        async with recorder.Core(tmp_path) as core:
            listener = asyncio.create_task(core.listen())
            await asyncio.sleep(0.8)  # three beacons at least
            signal = await core.publish(SignalWorker(sender="", node=0, rank=1, signal=9))
            assert signal.seq == 1  # the CONTROL beacons before it took no number
            await asyncio.sleep(0.1)
            listener.cancel()
        return [r.event for r in read_event_log(tmp_path / "events.log")]

    events = asyncio.run(go())
    assert not any(isinstance(e, Beacon) for e in events)
    assert any(isinstance(e, SignalWorker) for e in events)


_TIMINGS = st.lists(
    st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(0, 6)), max_size=40
)  # (rank, generation, step)


@settings(max_examples=300, deadline=None)
@given(timings=_TIMINGS, applying=st.booleans())
def test_the_protocol_fed_the_logged_step_timings_does_what_it_did_fed_all(
    timings, applying
) -> None:
    """A restarted Core feeds the protocol the timings the event log kept: from idle
    and from a change being applied (a timing under the new generation counts as the
    rank's report), the protocol fed only those ends in the state, with the actions, it
    reached fed every one."""
    core = recorder.Core(Path("/nonexistent"))
    if applying:
        start, rules = _applying_a_join()
    else:
        cfg, rules = _job(2, 1)
        start = ch.initial_state(cfg.plan())
    runs = []
    for only_logged in (False, True):
        state, actions = start, []
        for rank, generation, step in timings:
            timing = _timing(rank, step, generation)
            if only_logged and core._sink(timing) is not Sink.EVENTS:
                continue
            state, more = protocol.step(rules, state, inp.Trained(rank, generation, step), 1000.0)
            actions += more
        runs.append((state, actions))
    assert runs[0] == runs[1]
