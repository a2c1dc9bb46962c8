"""Fault injection for users and tests: a real SIGKILL at a named point of a step.

    --fault kill:RANK@STEP[:PHASE]       kill one worker
    --fault kill-node:NODE@STEP[:PHASE]  kill every worker of a node (see --ranks-per-node)
    --fault hang:RANK@STEP[:PHASE]       stop one worker (SIGSTOP): alive but silent
    --fault slow:RANK=FACTOR@STEP        from STEP on, RANK computes FACTOR times slower
    --fault join@STEP                    a new worker joins the job once STEP is reached

PHASE is where in the step the process dies: forward (after the first micro-batch's
forward compute), backward (after its backward compute), grad-sync (before the
reduce-scatter), snapshot (after the gradient shard was sent to the snapshot holder),
optimizer (after the optimizer update, before the parameter all-gather). Two phases are
points of a recovery that redoes STEP: plan (the Core's plan has arrived, not yet
acknowledged) and apply (the plan is committed, not yet applied). Default: forward.
Just before dying, the worker writes the kill time to RUN_DIR/faults/ so that detection
latency is measured from the real kill.
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import re
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from elaswave import rundir


class Phase(enum.StrEnum):
    FORWARD = "forward"
    BACKWARD = "backward"
    GRAD_SYNC = "grad-sync"
    SNAPSHOT = "snapshot"
    OPTIMIZER = "optimizer"
    PLAN = "plan"
    APPLY = "apply"


class FaultKind(enum.StrEnum):
    KILL = "kill"
    KILL_NODE = "kill-node"
    HANG = "hang"
    SLOW = "slow"
    JOIN = "join"


_FAULT = re.compile(
    r"^(?P<kind>[a-z-]+)(?::(?P<target>\d+)(?:=(?P<factor>[0-9]*\.?[0-9]+))?)?"
    r"@(?P<step>\d+)(?::(?P<phase>[a-z-]+))?$"
)


@dataclass(frozen=True)
class FaultSpec:
    kind: FaultKind
    target: int
    """A rank (kill) or a node (kill-node)."""
    step: int
    phase: Phase
    factor: float = 1.0
    """Slow faults: the compute slowdown factor (> 1)."""

    def ranks(self, ranks_per_node: int) -> list[int]:
        if self.kind is FaultKind.JOIN:
            return []
        if self.kind is not FaultKind.KILL_NODE:
            return [self.target]
        return list(range(self.target * ranks_per_node, (self.target + 1) * ranks_per_node))

    def __str__(self) -> str:
        if self.kind is FaultKind.SLOW:
            return f"{self.kind}:{self.target}={self.factor:g}@{self.step}"
        if self.kind is FaultKind.JOIN:
            return f"{self.kind}@{self.step}"
        return f"{self.kind}:{self.target}@{self.step}:{self.phase}"


def parse_fault(text: str) -> FaultSpec:
    """Parse one --fault value; ValueError names the value and the valid forms."""
    match = _FAULT.match(text.strip())
    valid = (
        "kill:RANK@STEP[:PHASE], kill-node:NODE@STEP[:PHASE], hang:RANK@STEP[:PHASE], "
        "slow:RANK=FACTOR@STEP or join@STEP, PHASE one of " + ", ".join(p.value for p in Phase)
    )
    if match is None:
        raise ValueError(f"fault {text!r} is malformed; expected {valid}")
    try:
        kind = FaultKind(match["kind"])
    except ValueError:
        raise ValueError(
            f"fault {text!r}: unknown kind {match['kind']!r}; expected {valid}"
        ) from None
    try:
        phase = Phase(match["phase"] or Phase.FORWARD)
    except ValueError:
        raise ValueError(
            f"fault {text!r}: unknown phase {match['phase']!r}; expected {valid}"
        ) from None
    factor = match["factor"]
    if kind is FaultKind.JOIN:
        if match["target"] is not None or match["phase"] is not None:
            raise ValueError(f"fault {text!r}: a join is join@STEP")
        return FaultSpec(kind, -1, int(match["step"]), phase)
    if match["target"] is None:
        raise ValueError(f"fault {text!r} is malformed; expected {valid}")
    if kind is FaultKind.SLOW:
        if factor is None or match["phase"] is not None:
            raise ValueError(f"fault {text!r}: a slow fault is slow:RANK=FACTOR@STEP")
        if not float(factor) > 1.0:
            raise ValueError(f"fault {text!r}: slowdown factor {factor} must be above 1")
        return FaultSpec(kind, int(match["target"]), int(match["step"]), phase, float(factor))
    if factor is not None:
        raise ValueError(f"fault {text!r}: only a slow fault takes =FACTOR; expected {valid}")
    return FaultSpec(kind, int(match["target"]), int(match["step"]), phase)


def validate_faults(
    faults: Iterable[str], *, world_size: int, ranks_per_node: int, steps: int
) -> list[FaultSpec]:
    specs = [parse_fault(f) for f in faults]
    num_nodes = -(-world_size // ranks_per_node)
    for spec in specs:
        targets_a_rank = spec.kind not in (FaultKind.JOIN, FaultKind.KILL_NODE)
        if targets_a_rank and not 0 <= spec.target < world_size:
            raise ValueError(f"fault {spec}: rank {spec.target} is not in 0..{world_size - 1}")
        if spec.kind is FaultKind.KILL_NODE and not 0 <= spec.target < num_nodes:
            raise ValueError(
                f"fault {spec}: node {spec.target} is not in 0..{num_nodes - 1} "
                f"({ranks_per_node} ranks per node)"
            )
        if not 0 <= spec.step < steps:
            raise ValueError(f"fault {spec}: step {spec.step} is not in 0..{steps - 1}")
    return specs


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

    def at(self, phase: Phase, step: int) -> None:
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
