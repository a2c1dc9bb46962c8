"""The Core's view of tensor-parallel groups: one failure unit per plan rank.

The change protocol places and recovers plan ranks. With ``--tp N`` each is a TP group
of N processes (:mod:`elaswave.runtime.worker.tpgroup`); :class:`UnitHandle` shows the Core
the group as one process: it fails when its first member fails (with that member's
code, and that member's log and fault record to explain it), and the other members
are then released (SIGKILL: they cannot train without their piece of every layer). It
exits cleanly when every member has.
A signal to the unit goes to every member.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Protocol


class WorkerProcess(Protocol):
    """A worker as the Core handles it: an ``asyncio.subprocess.Process``, the host
    link's :class:`~elaswave.runtime.job.hostlink.WorkerHandle`, or a TP group's
    :class:`~elaswave.runtime.core.units.UnitHandle` (which also names the member whose
    exit ended it, ``exited_member``)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...

    def kill(self) -> None: ...

    def terminate(self) -> None: ...

    def send_signal(self, signum: int) -> None: ...


class UnitHandle:
    """Plan rank ``rank``'s TP group as one process (``pid``, ``returncode``, ``wait``,
    ``kill``, ``terminate``, ``send_signal``, like its members' handles)."""

    def __init__(self, rank: int, members: Sequence[WorkerProcess], first: int) -> None:
        """``members``: the processes of ranks ``first``, ``first + 1``, ...."""
        self.rank = rank
        self.members = list(members)
        self.first = first
        self.returncode: int | None = None
        self.exited_member: int | None = None
        """The process rank of the member whose exit ended the unit."""
        self._done: asyncio.Task[int] | None = None

    @property
    def pid(self) -> int:
        return int(self.members[0].pid)

    @property
    def processes(self) -> list[int]:
        return [self.first + m for m in range(len(self.members))]

    async def wait(self) -> int:
        if self._done is None:
            self._done = asyncio.ensure_future(self._first_exit())
        return await asyncio.shield(self._done)

    async def _first_exit(self) -> int:
        waits = {asyncio.ensure_future(m.wait()): i for i, m in enumerate(self.members)}
        pending = set(waits)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            failed = sorted((waits[t], t.result()) for t in done if t.result() != 0)
            if failed:  # the unit is lost: release the members still running
                member, code = failed[0]
                self.exited_member = self.first + member
                for proc in self.members:
                    if proc.returncode is None:
                        with contextlib.suppress(ProcessLookupError):
                            proc.kill()
                await asyncio.gather(*waits, return_exceptions=True)
                self.returncode = code
                return code
        # Every member finished its work: the unit did.
        self.exited_member = self.first
        self.returncode = 0
        return 0

    def send_signal(self, signum: int) -> None:
        alive = [m for m in self.members if m.returncode is None]
        if not alive:
            raise ProcessLookupError(f"every process of rank {self.rank} has exited")
        for member in alive:
            with contextlib.suppress(ProcessLookupError):
                member.send_signal(signum)

    def kill(self) -> None:
        for member in self.members:
            if member.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    member.kill()

    def terminate(self) -> None:
        for member in self.members:
            if member.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    member.terminate()


async def spawn_unit(
    spawn: Callable[[int], Awaitable[WorkerProcess]], rank: int, tp: int
) -> WorkerProcess:
    """Start plan rank ``rank``: its one process, or its TP group's ``tp``."""
    if tp == 1:
        return await spawn(rank)
    members = [await spawn(rank * tp + m) for m in range(tp)]
    return UnitHandle(rank, members, rank * tp)


def group_units(procs: Mapping[int, WorkerProcess], tp: int) -> dict[int, WorkerProcess]:
    """Process handles by process rank as the Core sees them: by plan rank."""
    if tp == 1:
        return dict(procs)
    units: dict[int, list[tuple[int, WorkerProcess]]] = {}
    for process, proc in procs.items():
        units.setdefault(process // tp, []).append((process, proc))
    out: dict[int, WorkerProcess] = {}
    for rank, members in units.items():
        members.sort(key=lambda m: m[0])
        if [p for p, _ in members] != [rank * tp + m for m in range(tp)]:
            raise ValueError(
                f"rank {rank}'s TP group has processes {[p for p, _ in members]}, "
                f"expected {[rank * tp + m for m in range(tp)]}"
            )
        out[rank] = UnitHandle(rank, [proc for _, proc in members], rank * tp)
    return out
