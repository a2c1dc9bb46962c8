"""Injected faults, for users and tests: what to kill, hang, slow or add, and where in a step.

    --fault kill:RANK@STEP[:PHASE]       kill one worker
    --fault kill-node:NODE@STEP[:PHASE]  kill every worker of a node (see --ranks-per-node)
    --fault hang:RANK@STEP[:PHASE]       stop one worker (SIGSTOP): alive but silent
    --fault slow:RANK=FACTOR@STEP        from STEP on, RANK computes FACTOR times slower
    --fault join@STEP                    a new worker joins the job once STEP is reached

PHASE is where in the step the process dies: forward (after the first micro-batch's
forward compute), backward (after its backward compute), grad-sync (before the
reduce-scatter), snapshot (after the gradient shard was sent to the snapshot holder),
optimizer (after the optimizer update, before the parameter all-gather), eval (after the
first held-out micro-batch's forward, in a step that evaluates: --eval-every). Three phases
are points of a recovery that redoes STEP: plan (the Core's plan has arrived, not yet
acknowledged), apply (the plan is committed, not yet applied) and applied (applied on
this rank, not yet reported to the Core). Default: forward.
The worker's :class:`~elaswave.runtime.worker.faults.FaultInjector` carries them out.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable
from dataclasses import dataclass


class StepPhase(enum.StrEnum):
    """Where in a training step (or in the recovery that redoes it) a fault fires."""

    FORWARD = "forward"
    BACKWARD = "backward"
    WEIGHT = "weight"
    """The weight-gradient half of a split backward (zero-bubble schedules only)."""
    GRAD_SYNC = "grad-sync"
    SNAPSHOT = "snapshot"
    OPTIMIZER = "optimizer"
    EVAL = "eval"
    """The held-out evaluation that ends a step (``--eval-every``), after the all-gather."""
    PLAN = "plan"
    APPLY = "apply"
    APPLIED = "applied"
    """The end of a plan's apply: applied on this rank, not yet reported to the Core."""


RECOVERY_POINTS = (StepPhase.PLAN, StepPhase.APPLY, StepPhase.APPLIED)
"""The phases that are points of a recovery that redoes STEP, not of a training step."""


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
    phase: StepPhase
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
        "slow:RANK=FACTOR@STEP or join@STEP, PHASE one of " + ", ".join(p.value for p in StepPhase)
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
        phase = StepPhase(match["phase"] or StepPhase.FORWARD)
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
