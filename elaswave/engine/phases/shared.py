"""What every phase of a change uses: how a loss is put in words, and how a joiner is
started (pure)."""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Mapping

from elaswave.bus.schema import CORE_SENDER, PlanCommit
from elaswave.engine.actions import Action, Note, Publish, Spawn
from elaswave.engine.change import Change, PhaseState, State
from elaswave.engine.rules import Rules

KILLED = -int(signal.SIGKILL)
"""The exit code of a process the Core fenced."""


def exit_text(code: int) -> str:
    """How a process ended: ``signal SIGKILL``, ``code 1``."""
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"


def describe(state: State, failed: Mapping[int, int]) -> str:
    """The failed ranks in words: why each was fenced, or how it exited and its error."""
    return "; ".join(
        (
            f"rank {r}: {state.fenced[r]}"
            if r in state.fenced
            else f"rank {r} exited with {exit_text(code)}"
        )
        + (f": {why}" if (why := state.errors.get(r)) else "")
        for r, code in sorted(failed.items())
    )


def spawn(r: Rules, s: State, out: list[Action]) -> State:
    """Start a joiner (when the job can start workers)."""
    if not r.can_spawn:
        out.append(Note("core.join_refused", {"reason": "this job cannot start workers"}))
        return s
    out.append(Spawn(s.next_rank))
    return dataclasses.replace(s, alive=s.alive | {s.next_rank}, next_rank=s.next_rank + 1)


def ready_joiners(s: State) -> list[int]:
    """Joiners up, announced and not in the plan yet, in rank order."""
    return sorted(x for x in s.joiners if x in s.alive and x not in s.plan.ranks)


def restorable(r: Rules, s: State) -> bool:
    """Whether joiners left with no member could restore a checkpoint: the job restores
    them, and one no newer than the job's last completed step is on disk."""
    return r.restore and any(x <= s.done_step for x in s.checkpoints)


def with_phase(s: State, c: Change, phase: PhaseState) -> State:
    """``s`` with change ``c`` in ``phase``."""
    return dataclasses.replace(s, change=dataclasses.replace(c, phase=phase))


def without_joiner(s: State, c: Change, rank: int) -> State:
    """``s`` with joiner ``rank`` (gone) no longer in change ``c``."""
    if rank not in c.joined:
        return s
    joined = tuple(x for x in c.joined if x != rank)
    return dataclasses.replace(s, change=dataclasses.replace(c, joined=joined))


def commit(c: Change, attempt: int, digest: str) -> Publish:
    """Publish the commit of attempt ``attempt`` (digest ``digest``) of the plan ``c``
    leads to: once every participant acknowledged it, and again after a Core restart."""
    return Publish(
        PlanCommit(
            sender=CORE_SENDER, generation=c.generation + 1, plan_digest=digest, attempt=attempt
        )
    )
