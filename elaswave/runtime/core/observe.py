"""What the Core observes, as inputs of the change protocol
(:mod:`elaswave.engine.inputs`): bus events, and worker processes' exits with their own
account of why.

:func:`to_input` is the one mapping from bus events to the protocol's inputs: the Core's
recorder hands the supervisor exactly the events it maps (:func:`takes`)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from elaswave.bus.schema import (
    CheckpointWritten,
    Event,
    MigrationDone,
    PlanAck,
    RecoveryDone,
    RecoveryReady,
    ScaleRequest,
    StepCompleted,
    StepTiming,
    WorkerStarted,
)
from elaswave.engine.change import Applied, Report
from elaswave.engine.inputs import (
    Acked,
    Checkpointed,
    Done,
    Exited,
    Input,
    Joining,
    Migrated,
    Ready,
    ScaleUp,
    StepDone,
    Trained,
)
from elaswave.rundir import fault_record, rank_log


def to_input(event: Event, t: float, scales: int) -> Input | None:
    """The protocol's input for a bus event that arrived at ``t`` (``scales``: how many
    ScaleRequests came before it); None for an event the protocol does not take."""
    match event:
        case RecoveryReady():
            report = Report(
                committed_step=event.committed_step,
                params_step=event.params_step,
                tainted=tuple(event.tainted),
                newest_step=event.newest_step,
            )
            return Ready(event.rank, event.generation, report)
        case PlanAck():
            return Acked(event.rank, event.generation, event.attempt, event.plan_digest)
        case RecoveryDone():
            applied = Applied(
                comm_s=event.comm_s,
                remap_s=event.remap_s,
                resume_s=event.resume_s,
                bytes_sent=event.bytes_sent,
                params_s=event.params_s,
                communicators=event.communicators,
            )
            return Done(event.rank, event.generation, applied)
        case CheckpointWritten():
            return Checkpointed(event.rank, event.generation, event.step)
        case MigrationDone():
            return Migrated(event.rank, event.generation, event.bytes_streamed, event.waited_s)
        case StepTiming():
            return Trained(event.rank, event.generation, event.step)
        case StepCompleted():
            return StepDone(event.step, t)
        case WorkerStarted(joining=True):  # a joiner; a member's start is no input
            return Joining(event.rank)
        case ScaleRequest():
            return ScaleUp(scales, event.add)
    return None


def takes(event: Event) -> bool:
    """Whether the change protocol takes ``event`` (:func:`to_input` maps it)."""
    return to_input(event, 0.0, 0) is not None


class NewTimings:
    """Which step timings tell the change protocol what none seen before did. Of a
    timing the protocol takes (:class:`~elaswave.engine.inputs.Trained`) each rank's
    newest generation and the newest step, so the first timing of a newer step and a
    rank's first under a newer generation are news; the rest tell it nothing a seen one
    did not. Fed every timing in arrival order; a fresh one, having seen none, finds
    more news, never less."""

    def __init__(self) -> None:
        self._newest_step = -1
        self._generations: dict[int, int] = {}
        """rank -> the newest generation of its timings seen."""

    def __call__(self, timing: StepTiming) -> bool:
        newer_step = timing.step > self._newest_step
        newer_generation = timing.generation > self._generations.get(timing.rank, -1)
        if newer_step:
            self._newest_step = timing.step
        if newer_generation:
            self._generations[timing.rank] = timing.generation
        return newer_step or newer_generation


def exited(run_dir: Path, rank: int, code: int, *, process: int | None = None) -> Exited:
    """The exit of worker ``rank`` with ``code``: its last error, and when an injected
    fault killed it (its own record), if it has them. ``process``: the process whose
    log and record those are (a TP group's member that exited first), else ``rank``."""
    process = rank if process is None else process
    why = last_error(rank_log(run_dir, process)) if code else ""
    killed_at = None
    with contextlib.suppress(OSError, ValueError, KeyError):
        killed_at = float(json.loads(fault_record(run_dir, process).read_text())["killed_at"])
    return Exited(rank, code, why, killed_at)


def last_error(log_path: Path) -> str:
    """The worker's own account of its failure (its ``worker.failed`` log record), if any.

    A SIGKILLed worker has none: whatever else it logged is not the cause.
    """
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        with contextlib.suppress(ValueError):
            doc = json.loads(line)
            if isinstance(doc, dict) and doc.get("event") == "worker.failed":
                return str(doc.get("error", ""))
    return ""
