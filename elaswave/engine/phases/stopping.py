"""The stop phase of a plan change (pure).

Before the Core can plan generation ``g + 1``, every member of generation ``g`` must have
stopped at a step boundary and reported its committed step (``RecoveryReady``), or be
known lost. Members keep failing while they stop: a node takes several ranks a few
milliseconds apart, a rank dies while the others pause for a join, a rank was already
gone when the change began. Each loss is announced (``FailureDetected(g, failed)``, the
whole failed set every time, so a member that missed one announcement learns it from the
next), and the members still in a step abort it and report.

Its own small machine: ``stop_phase`` starts it, ``on_exit`` and ``on_report`` advance
it; each returns the new :class:`~elaswave.engine.change.Stopping` and the announcements
to publish, in order. ``status`` says whether to keep waiting, to plan, or that no
member is left. Tests drive it through random interleavings
(tests/unit/test_stopping.py).

The protocol's transitions while stopping: :func:`begin_stop` (a failure) and
:func:`pause` (a join or a rebalance) start it, :func:`take` is every input's effect,
:func:`due` its deadline, and :func:`after_stop` what comes once it is over.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass

from elaswave.bus.schema import CORE_SENDER, FailureDetected, PauseRequest, RecoveryKind
from elaswave.engine.actions import Action, Note, Publish, Stopped
from elaswave.engine.change import Change, Detecting, State, Stopping
from elaswave.engine.inputs import Exited, Input, Ready, Restarted
from elaswave.engine.phases.planning import plan_next
from elaswave.engine.phases.shared import (
    KILLED,
    describe,
    ready_joiners,
    restorable,
    with_phase,
    without_joiner,
)
from elaswave.engine.phases.waiting import wait_to_restore
from elaswave.engine.rules import Rules

replace = dataclasses.replace


class StopStatus(enum.StrEnum):
    WAITING = "waiting"
    """A member has neither reported nor exited."""
    STOPPED = "stopped"
    """Every member left has reported: plan."""
    NONE_LEFT = "none-left"
    """Every member is lost: nothing is left to plan for."""


@dataclass(frozen=True)
class Announce:
    """Publish ``FailureDetected(generation, ranks)``; ``new``: the ranks it adds."""

    generation: int
    ranks: tuple[int, ...]
    new: tuple[int, ...]


# ----------------------------------------------------------------------------- machine


def stop_phase(
    generation: int,
    plan_ranks: frozenset[int],
    failed: Mapping[int, int],
    *,
    after_step: int | None = None,
    deadline: float,
) -> tuple[Stopping, list[Announce]]:
    """Start stopping the members of ``plan_ranks`` for a change; ``failed``: ranks of the
    plan already lost (announced at once)."""
    state = Stopping(
        generation=generation,
        members=frozenset(plan_ranks) - set(failed),
        failed=dict(failed),
        after_step=after_step,
        deadline=deadline,
    )
    return _announce(state)


def on_exit(state: Stopping, rank: int, code: int) -> tuple[Stopping, list[Announce]]:
    """A process exited. A member that exits, with any code, before its report is lost
    (one that finished cleanly cannot take part in the change either); so is a member
    that exits after reporting, since it cannot apply the plan."""
    if rank not in state.members:
        return state, []
    state = replace(
        state,
        members=state.members - {rank},
        reported=state.reported - {rank},
        failed={**state.failed, rank: code},
    )
    return _announce(state)


def on_report(state: Stopping, rank: int, generation: int) -> Stopping:
    """A member reported that it stopped (``RecoveryReady`` of ``generation``). Reports of
    another generation, or from a rank that is not a member (lost, or never one), change
    nothing."""
    if generation != state.generation or rank not in state.members:
        return state
    return replace(state, reported=state.reported | {rank})


def status(state: Stopping) -> StopStatus:
    if not state.members:
        return StopStatus.NONE_LEFT
    return StopStatus.STOPPED if state.reported >= state.members else StopStatus.WAITING


def _announce(state: Stopping) -> tuple[Stopping, list[Announce]]:
    new = sorted(set(state.failed) - state.announced)
    if not new or not state.members:
        return state, []
    ranks = tuple(sorted(state.failed))
    return replace(state, announced=frozenset(ranks)), [
        Announce(state.generation, ranks, tuple(new))
    ]


# ----------------------------------------------------------------------------- protocol


def begin_stop(
    r: Rules,
    s: State,
    c: Change,
    failed: Mapping[int, int],
    after_step: int | None,
    now: float,
    out: list[Action],
) -> State:
    """Announce change ``c``: every member stops (after ``after_step``: a pause; None:
    at once); ``failed`` and members already gone are failed."""
    gone = {x: s.codes.get(x, KILLED) for x in s.plan.ranks if x not in s.alive}
    p, announce = stop_phase(
        c.generation,
        frozenset(s.plan.ranks),
        {**gone, **failed},
        after_step=after_step,
        deadline=now + r.stop_timeout_s,
    )
    for rank in s.reports:
        p = on_report(p, rank, c.generation)
    s = with_phase(s, c, p)
    if after_step is not None:
        out.append(Publish(pause_request(c, p)))
    announce_failures(s, c, p, announce, out)
    return after_stop(r, s, c, p, now, out)


def pause(
    r: Rules,
    s: State,
    kind: RecoveryKind,
    ranks: list[int],
    detail: str,
    joined: tuple[int, ...],
    now: float,
    out: list[Action],
) -> State:
    """Stop every member after its next step, then change the plan (adding ``joined``)."""
    c = Change(
        kind=kind,
        generation=s.plan.generation,
        ranks=tuple(ranks),
        detail=detail,
        joined=joined,
        seen_at=now,
        origin=now,
        phase=Detecting(failed={}, deadline=now),
    )
    return begin_stop(r, s, c, {}, s.last_step + 1, now, out)


def take(
    r: Rules, s: State, c: Change, p: Stopping, e: Input, now: float, out: list[Action]
) -> State:
    """What ``e`` does while the members stop."""
    match e:
        case Exited(rank=rank) if rank not in s.plan.ranks:  # a joiner leaves the change
            return without_joiner(s, c, rank)
        case Exited(rank=rank, code=code):
            p, announce = on_exit(p, rank, code)
            s = with_phase(s, c, p)
            announce_failures(s, c, p, announce, out)
            return after_stop(r, s, c, p, now, out)
        case Ready(rank=rank, generation=generation):
            return after_stop(r, s, c, on_report(p, rank, generation), now, out)
        case Restarted():  # announce again (members that reported ignore it)
            p = replace(p, deadline=now + r.stop_timeout_s)
            s = with_phase(s, c, p)
            if p.after_step is not None:
                out.append(Publish(pause_request(c, p)))
            if (p.failed or s.rolled_back) and p.members:
                a = Announce(c.generation, tuple(sorted(p.failed)), ())
                announce_failures(s, c, p, [a], out)
            return after_stop(r, s, c, p, now, out)
    return s


def due(r: Rules, s: State, c: Change, p: Stopping, now: float, out: list[Action]) -> State:
    """A member that neither reported nor exited by the deadline stops the job."""
    if now < p.deadline:
        return s
    missing = sorted(p.members - p.reported)
    what = "stop" if p.after_step is None else "pause"
    raise Stopped(
        f"{stop_text(s, c, p)}; ranks {missing} did not {what} at a step boundary "
        f"within {r.stop_timeout_s:g} s"
    )


def after_stop(r: Rules, s: State, c: Change, p: Stopping, now: float, out: list[Action]) -> State:
    """Keep waiting for reports, plan once every member left has reported, or end."""
    result = status(p)
    if result is StopStatus.NONE_LEFT and p.failed and not any(p.failed.values()):
        # Every member exited with code 0: they trained the last step before they could
        # pause (a join or a rebalance asked for too late). The job is done; the change
        # has nothing left to change (late joiners are sent away as the job ends).
        out.append(Note("core.change_dropped", {"generation": c.generation, "why": c.detail}))
        return replace(s, change=None)
    coming = ready_joiners(s) or [x for x in c.joined if x in s.alive]  # a join's, too
    if result is StopStatus.NONE_LEFT and not (restorable(r, s) and coming):
        if restorable(r, s) and r.restore_wait_s > 0:  # joiners may come to restore it
            c = replace(c, detail=stop_text(s, c, p))
            return wait_to_restore(r, s, c, frozenset(p.failed), now, out)
        raise Stopped(f"{stop_text(s, c, p)}; no worker survives")
    if result in (StopStatus.STOPPED, StopStatus.NONE_LEFT):  # none left: joiners restore
        c = replace(c, detail=stop_text(s, c, p), phase=p)
        return plan_next(
            r, s, c, members=p.members, failed=frozenset(p.failed), attempt=-1,
            waited_since=None, completed={}, now=now, out=out,
        )  # fmt: skip
    return with_phase(s, c, p)


def pause_request(c: Change, p: Stopping) -> PauseRequest:
    """The announcement of a pause (a join or a rebalance)."""
    assert p.after_step is not None
    return PauseRequest(
        sender=CORE_SENDER, generation=c.generation, after_step=p.after_step, reason=c.detail
    )


def stop_text(s: State, c: Change, p: Stopping) -> str:
    """What the change is about while members stop: its cause and every loss so far."""
    failed = dict(p.failed)
    if c.kind is RecoveryKind.FAIL_STOP:
        return describe(s, failed)
    return f"{c.detail}; then, while pausing: {describe(s, failed)}" if failed else c.detail


def announce_failures(
    s: State, c: Change, p: Stopping, announce: list[Announce], out: list[Action]
) -> None:
    for a in announce:
        why = stop_text(s, c, p)
        out.append(
            Note("core.failure_detected", {"ranks": list(a.ranks), "generation": a.generation})
        )
        out.append(
            Publish(
                FailureDetected(
                    sender=CORE_SENDER,
                    generation=a.generation,
                    ranks=list(a.ranks),
                    source="process-exit",
                    detail=why,
                    rollback=s.rolled_back,
                )
            )
        )
