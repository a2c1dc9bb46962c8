"""What the Core's event log leaves out: the bus's liveness plumbing."""

from __future__ import annotations

import asyncio

from elaswave.bus.eventlog import read_event_log
from elaswave.bus.schema import Beacon, Heartbeat, SignalWorker, StepCompleted
from elaswave.runtime.core import recorder


def _beat(rank: int, step: int) -> Heartbeat:
    return Heartbeat(sender=f"rank{rank}", seq=0, rank=rank, step=step)


def test_beacons_are_not_logged_and_heartbeats_once_a_period(tmp_path, monkeypatch) -> None:
    """A worker beats five times a second and beacons four: the log keeps no beacon and
    a sender's first heartbeat, then one every BEAT_LOG_S; every other event whole."""
    clock = [100.0]
    monkeypatch.setattr(recorder.time, "monotonic", lambda: clock[0])
    core = recorder.Core(tmp_path)
    assert not core._logged(Beacon(sender="rank0", topics=["control"], seqs=[3]))
    kept = []
    for tick in range(60):  # 12 s of two workers' heartbeats, every 0.2 s
        clock[0] = 100.0 + 0.2 * tick
        kept += [(clock[0], b.rank) for b in (_beat(0, tick), _beat(1, tick)) if core._logged(b)]
    assert [t for t, rank in kept if rank == 0] == [100.0, 105.0, 110.0]
    assert [t for t, rank in kept if rank == 1] == [100.0, 105.0, 110.0]
    step = StepCompleted(sender="rank1", rank=1, step=3, loss=1.0, step_time_s=0.2, samples=4)
    assert core._logged(step) and core._logged(step)  # the run's events, every time


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
