"""A TP group as the Core sees it (one process: the first member's exit ends it, the
others are released) and as its members agree on a stop report."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from elaswave.bus.schema import sender_name
from elaswave.comm.store import connect_store, serve_store
from elaswave.runtime.core.units import UnitHandle, group_units
from elaswave.runtime.job.hostlink import ProcessHandle
from elaswave.runtime.worker.tpgroup import unit_report


class _Proc(ProcessHandle):
    """A member that records the signals sent to it; SIGKILL ends it."""

    def __init__(self, rank: int) -> None:
        super().__init__(rank, pid=1000 + rank)
        self.signals: list[int] = []

    def _signal(self, signum: int) -> None:
        self.signals.append(signum)
        if signum == 9:
            self.exited(-9)


def test_the_first_member_exit_ends_the_unit_and_releases_the_rest() -> None:
    async def scenario() -> tuple[int, UnitHandle, list[_Proc]]:
        members = [_Proc(4), _Proc(5), _Proc(6)]
        unit = UnitHandle(2, members, first=4)
        waiter = asyncio.ensure_future(unit.wait())
        await asyncio.sleep(0)
        assert not waiter.done()
        members[1].exited(3)  # process 5 fails
        code = await waiter
        assert await unit.wait() == code  # waiting again gives the same answer
        return code, unit, members

    code, unit, members = asyncio.run(scenario())
    assert code == 3 and unit.returncode == 3 and unit.exited_member == 5
    assert members[0].signals == [9] and members[2].signals == [9]  # released
    assert members[1].signals == []
    with pytest.raises(ProcessLookupError):
        unit.send_signal(15)


def test_members_that_finish_end_the_unit_cleanly_and_are_not_released() -> None:
    async def scenario() -> tuple[int, list[_Proc]]:
        members = [_Proc(0), _Proc(1)]
        unit = UnitHandle(0, members, first=0)
        waiter = asyncio.ensure_future(unit.wait())
        members[1].exited(0)  # done first: its partner is still saving the parameters
        await asyncio.sleep(0.01)
        assert not waiter.done()
        members[0].exited(0)
        return await waiter, members

    code, members = asyncio.run(scenario())
    assert code == 0 and members[0].signals == [] and members[1].signals == []


def test_group_units_by_plan_rank_and_sender_names() -> None:
    procs = {p: _Proc(p) for p in range(6)}
    units = group_units(procs, 2)
    assert sorted(units) == [0, 1, 2]
    assert units[1].processes == [2, 3]
    assert group_units(procs, 1) == procs
    with pytest.raises(ValueError, match="expected \\[4, 5\\]"):
        group_units({p: procs[p] for p in (0, 1, 2, 3, 4)}, 2)
    assert (sender_name(3), sender_name(3, 1)) == ("rank3", "rank3.1")


def test_members_agree_on_the_earliest_step_and_every_taint() -> None:
    server = serve_store()
    reports = [
        {"committed_step": 7, "tainted": ["dp.s0"], "params_step": 7},
        {"committed_step": 6, "tainted": ["tp"], "params_step": 6},
    ]

    def member(m: int) -> dict:
        store = connect_store("127.0.0.1", server.port)
        return unit_report(
            store, unit=3, member=m, size=2, generation=1, report=reports[m], timeout_s=10
        )

    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(member, range(2)))
    # Member 0 is a step ahead: the unit reports it, since that member keeps no step
    # before 6, and the Core must not roll the unit back past it.
    want = {"committed_step": 6, "tainted": ["dp.s0", "tp"], "params_step": -2, "newest_step": 7}
    assert got == [want, want]
    # A member that never reports: the other gives up at its deadline.
    store = connect_store("127.0.0.1", server.port)
    with pytest.raises(TimeoutError, match="unit 4"):
        unit_report(store, unit=4, member=0, size=2, generation=1, report=reports[0], timeout_s=0.5)
