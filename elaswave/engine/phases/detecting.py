"""How a change begins (pure): while no change is under way (:func:`idle`,
:func:`next_change`), and while exits are gathered into one failure (the detecting
phase: :func:`take`, :func:`due`).

A worker that exits non-zero (or is fenced: the Core kills it, so it exits like a crash)
starts a fail-stop change, detecting for ``grace_s``: exits that close together are one
failure (a node takes its ranks a few milliseconds apart). Then every member is asked
to stop (:func:`elaswave.engine.phases.stopping.begin_stop`). The fail-slow detector's
verdict starts a rebalance when the rebalanced plan differs; joiners that announced
themselves start a join; failures seen while the last change was applied start the
next. A rebalance and a join pause every member at a step boundary instead of waiting
for exits (:func:`elaswave.engine.phases.stopping.pause`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from elaswave.bus.schema import CORE_SENDER, RecoveryKind, StragglerDetected
from elaswave.engine.actions import Action, Note, Publish, SharePlan, Stopped
from elaswave.engine.change import Change, Detecting, State
from elaswave.engine.inputs import Exited, Input, Straggling
from elaswave.engine.phases.planning import job_rebalancing
from elaswave.engine.phases.shared import describe, ready_joiners, with_phase, without_joiner
from elaswave.engine.phases.stopping import begin_stop, pause
from elaswave.engine.recovery import next_plan
from elaswave.engine.rules import Rules

replace = dataclasses.replace


def failure(s: State, failed: Mapping[int, int], now: float, due: float) -> Change:
    """A fail-stop change of ``failed`` seen at ``now``, detecting until ``due``."""
    return Change(
        kind=RecoveryKind.FAIL_STOP,
        generation=s.plan.generation,
        ranks=(),
        detail="",
        seen_at=now,
        origin=now,
        phase=Detecting(failed=dict(failed), deadline=due),
    )


def idle(r: Rules, s: State, e: Input, now: float, out: list[Action]) -> State:
    """What ``e`` does while no change is under way."""
    match e:
        case Exited(rank=rank) if rank not in s.plan.ranks:
            return s  # a joiner not in any change
        case Exited(code=0):
            return s
        case Exited(rank=rank, code=code):
            if not r.recovery:
                raise Stopped(f"{describe(s, {rank: code})} (recovery is off)")
            return replace(s, change=failure(s, {rank: code}, now, now + r.grace_s))
        case Straggling():
            return _straggling(r, s, e, now, out)
    return s


def take(
    r: Rules, s: State, c: Change, p: Detecting, e: Input, now: float, out: list[Action]
) -> State:
    """What ``e`` does while exits are gathered into one failure."""
    match e:
        case Exited(rank=rank) if rank not in s.plan.ranks:  # a joiner leaves the change
            return without_joiner(s, c, rank)
        case Exited(code=0):
            return s  # the stop phase counts it lost with the others
        case Exited(rank=rank, code=code):
            return with_phase(s, c, replace(p, failed={**p.failed, rank: code}))
    return s  # a restarted Core waits for the deadline as the one that died


def due(r: Rules, s: State, c: Change, p: Detecting, now: float, out: list[Action]) -> State:
    """``grace_s`` after the first exit: every member is asked to stop."""
    if now < p.deadline:
        return s
    return begin_stop(r, s, c, p.failed, None, now, out)


def next_change(r: Rules, s: State, now: float, out: list[Action]) -> State:
    """With no change under way: failures seen while the last one was applied start the
    next one; else joiners that announced themselves start a join."""
    if later := {x: code for x, code in s.later.items() if x in s.plan.ranks}:
        s = replace(s, later={})
        if not r.recovery:
            raise Stopped(f"{describe(s, later)} (recovery is off)")
        return begin_stop(r, s, failure(s, later, now, now), later, None, now, out)
    ready = ready_joiners(s)
    if ready and s.done_step + 2 < r.steps and s.alive & set(s.plan.ranks):
        out.append(SharePlan(s.plan))
        s = replace(s, joiners=frozenset())
        detail = f"ranks {ready} join"
        return pause(r, s, RecoveryKind.JOIN, ready, detail, tuple(ready), now, out)
    return s


def _straggling(r: Rules, s: State, e: Straggling, now: float, out: list[Action]) -> State:
    """The fail-slow detector flagged or cleared ranks: rebalance when the plan would
    change and the job has steps left for it to pay off."""
    ranks = sorted(e.slowdowns)
    out.append(
        Publish(
            StragglerDetected(
                sender=CORE_SENDER,
                generation=s.plan.generation,
                step=e.step,
                ranks=ranks,
                factors=[e.slowdowns[x] for x in ranks],
                recovered=list(e.recovered),
                reason=e.reason,
            )
        )
    )
    out.append(Note("core.stragglers", {"step": e.step, "slowdowns": dict(e.slowdowns)}))
    s = replace(s, slowdowns=dict(e.slowdowns))
    candidate, _ = next_plan(s.plan, (), job_rebalancing(r, s, s.plan.ranks))
    if s.last_step + 2 >= r.steps or candidate == s.plan or not s.alive:
        return s  # the job ends before a change could pay off, or nothing changes
    detail = f"{RecoveryKind.FAIL_SLOW}: {e.reason}"
    return pause(r, s, RecoveryKind.FAIL_SLOW, ranks or list(e.recovered), detail, (), now, out)
