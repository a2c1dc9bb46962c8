"""The change protocol's inputs: what the Core observes, as pure data
(:mod:`elaswave.runtime.core.observe` makes them from bus events and process exits;
:func:`elaswave.engine.protocol.step` takes one at a time)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from elaswave.engine.change import Applied, Report


@dataclass(frozen=True)
class Exited:
    """A worker process exited (code 0: it finished; negative: killed by a signal)."""

    rank: int
    code: int
    why: str = ""
    killed_at: float | None = None


@dataclass(frozen=True)
class Silent:
    """A worker sent no heartbeat for too long: fence it."""

    rank: int
    why: str


@dataclass(frozen=True)
class Joining:
    """A joiner is up and waits for a plan that adds it."""

    rank: int


@dataclass(frozen=True)
class ScaleUp:
    """The ``index``-th ScaleRequest of the run asks for ``add`` more workers."""

    index: int
    add: int


@dataclass(frozen=True)
class Straggling:
    """The fail-slow detector flagged (or cleared) ranks at ``step``."""

    step: int
    slowdowns: Mapping[int, float]
    recovered: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class OnDisk:
    """The steps of the complete disk checkpoints the job has (the Core's watcher reads
    the pieces' manifests, :func:`elaswave.fabric.checkpoint.complete_steps`)."""

    steps: tuple[int, ...]


@dataclass(frozen=True)
class Ready:
    """A member stopped and reported (RecoveryReady of ``generation``)."""

    rank: int
    generation: int
    report: Report


@dataclass(frozen=True)
class Acked:
    """A participant acknowledged attempt ``attempt`` of the plan of ``generation``."""

    rank: int
    generation: int
    attempt: int
    digest: str


@dataclass(frozen=True)
class Done:
    """A participant applied the plan of ``generation`` (RecoveryDone)."""

    rank: int
    generation: int
    applied: Applied


@dataclass(frozen=True)
class Trained:
    """A rank trained ``step`` under ``generation`` (StepTiming)."""

    rank: int
    generation: int
    step: int


@dataclass(frozen=True)
class StepDone:
    """The job completed ``step`` (StepCompleted arrived at ``at``)."""

    step: int
    at: float


@dataclass(frozen=True)
class Migrated:
    """A rank finished the non-blocking migration of ``generation`` (MigrationDone)."""

    rank: int
    generation: int
    bytes_streamed: int
    waited_s: float


@dataclass(frozen=True)
class Checkpointed:
    """A member wrote its part of the checkpoint of ``step`` (CheckpointWritten)."""

    rank: int
    generation: int
    step: int


@dataclass(frozen=True)
class Tick:
    """Time passed (deadlines)."""


@dataclass(frozen=True)
class Restarted:
    """This Core took over from a predecessor's persisted state; ``present``: the
    workers the host has."""

    present: frozenset[int]


Input = (
    Exited | Silent | Joining | ScaleUp | Straggling | Ready | Acked | Done | Trained
    | StepDone | Migrated | Checkpointed | OnDisk | Tick | Restarted
)  # fmt: skip
