"""Carrying out injected faults (:mod:`elaswave.runtime.job.faults`) in a worker: a real
SIGKILL (or SIGSTOP) at the named point of a step.

Just before dying, the worker writes the kill time to RUN_DIR/faults/ so that detection
latency is measured from the real kill.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from elaswave import rundir
from elaswave.runtime.job.faults import FaultKind, FaultSpec, StepPhase


class FaultInjector:
    """Called by the stage runner at each phase; kills this process where a fault says."""

    def __init__(
        self,
        rank: int,
        ranks_per_node: int,
        specs: Iterable[FaultSpec],
        run_dir: Path | None = None,
        pid_of: Callable[[int], int | None] | None = None,
    ) -> None:
        """``pid_of(rank)`` gives a node peer's process id (None: no such rank has started),
        without waiting: a kill-node takes the node at once."""
        self.rank = rank
        self.run_dir = run_dir
        self.ranks_per_node = ranks_per_node
        self.pid_of = pid_of
        self.mine = [s for s in specs if rank in s.ranks(ranks_per_node)]

    def at(self, phase: StepPhase, step: int) -> None:
        for spec in self.mine:
            if spec.kind is not FaultKind.SLOW and spec.step == step and spec.phase is phase:
                self._die(spec)

    def slowdown(self, step: int) -> float:
        """This rank's compute slowdown factor at ``step`` (1.0 when not slowed)."""
        started = [s for s in self.mine if s.kind is FaultKind.SLOW and s.step <= step]
        return max(started, key=lambda s: s.step).factor if started else 1.0

    def _die(self, spec: FaultSpec) -> None:
        """SIGKILL every rank the fault names (a whole node at once), this one last.

        A hang fault SIGSTOPs this process instead: it stays alive, silent, holding its
        connections, which only missed heartbeats reveal.
        """
        now = time.time()
        if spec.kind is FaultKind.HANG:
            self._record(spec, self.rank, now)
            os.kill(os.getpid(), signal.SIGSTOP)
            return
        # The node's other ranks that exist and live: a node slot may be empty (the last
        # node of a job that does not fill it), and a rank may have died already.
        peers: dict[int, int] = {}
        for rank in spec.ranks(self.ranks_per_node):
            pid = self.pid_of(rank) if rank != self.rank and self.pid_of is not None else None
            if pid is not None and _alive(pid):
                peers[rank] = pid
        for rank in [*peers, self.rank]:
            self._record(spec, rank, now)
        for pid in peers.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    def _record(self, spec: FaultSpec, rank: int, when: float) -> None:
        if self.run_dir is None:
            return
        path = rundir.fault_record(self.run_dir, rank)
        path.parent.mkdir(exist_ok=True)
        # Whole or not at all: a node peer may SIGKILL this process mid-write.
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"rank": rank, "fault": str(spec), "killed_at": when}))
        os.replace(tmp, path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
