"""The agreeing phase of a plan change (pure): attempt ``a`` of plan ``g + 1`` is
announced, and every participant (the survivors and the joiners) recomputes it from the
announced inputs, checks its digest and acknowledges it (``PlanAck``).

- With an acknowledgement of the attempt from every participant, the Core commits it
  (``PlanCommit``): the change is applying.
- A participant that exits, or stays silent past ``ack_timeout_s`` (the Core fences
  it), joins the failed set: attempt ``a + 1`` supersedes the announcement, which never
  runs (:func:`supersede`; planned again, it may wait for joiners instead).
- A step completed meanwhile is noted (a step redone under the plan may complete before
  the last report of its application arrives).
- A restarted Core announces a new attempt (the old one never runs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from elaswave.engine.actions import Action, Kill, Note, Stopped
from elaswave.engine.change import Agreeing, Applying, Change, State
from elaswave.engine.inputs import Acked, Exited, Input, Restarted, StepDone
from elaswave.engine.phases.planning import plan_next
from elaswave.engine.phases.shared import KILLED, commit, describe, with_phase
from elaswave.engine.rules import Rules

replace = dataclasses.replace


def take(
    r: Rules, s: State, c: Change, p: Agreeing, e: Input, now: float, out: list[Action]
) -> State:
    """What ``e`` does while the participants acknowledge the plan."""
    match e:
        case Exited(rank=rank, code=code) if rank in p.participants:
            return supersede(r, s, c, p, {rank: code}, now, out)
        case Acked(rank=rank) if rank in p.participants and (e.generation, e.attempt, e.digest) == (
            c.generation + 1,
            p.attempt,
            p.digest,
        ):
            return _acked(r, s, c, p, rank, now, out)
        case StepDone(step=step, at=at) if at >= p.planned_at:
            return with_phase(s, c, replace(p, completed={**p.completed, step: at}))
        case Restarted():  # announce again: a new attempt
            return _again(r, s, c, p, now, out)
    return s


def due(r: Rules, s: State, c: Change, p: Agreeing, now: float, out: list[Action]) -> State:
    """Participants that did not acknowledge by the deadline are fenced and lost."""
    if now < p.deadline:
        return s
    silent = sorted(p.participants - p.acked)
    why = (
        f"did not acknowledge the plan of generation {c.generation + 1} within "
        f"{r.ack_timeout_s:g} s; fenced"
    )
    for rank in silent:
        out += [Note("core.fencing", {"rank": rank, "why": why}), Kill(rank)]
    s = replace(
        s,
        fenced={**s.fenced, **{x: why for x in silent}},
        alive=s.alive - set(silent),
        codes={**s.codes, **{x: KILLED for x in silent}},
    )
    return supersede(r, s, c, p, {x: KILLED for x in silent}, now, out)


def supersede(
    r: Rules,
    s: State,
    c: Change,
    p: Agreeing,
    lost: Mapping[int, int],
    now: float,
    out: list[Action],
) -> State:
    """Participants lost before the commit: a new attempt supersedes the announcement."""
    why = describe(s, lost)
    out.append(Note("core.plan_superseded", {"generation": c.generation + 1, "attempt": p.attempt}))
    failed = p.failed | {x for x in lost if x not in c.joined}
    c = replace(
        c,
        joined=tuple(x for x in c.joined if x not in lost),
        ranks=tuple(sorted(set(c.ranks) | set(lost))),
        detail=f"{c.detail}; then before the plan ran: {why}",
    )
    if not (p.participants - set(lost)) & set(s.plan.ranks):
        raise Stopped(f"{c.detail}; no worker survives")
    return _again(r, s, c, replace(p, members=p.members - set(lost), failed=failed), now, out)


def _again(r: Rules, s: State, c: Change, p: Agreeing, now: float, out: list[Action]) -> State:
    """Plan again from ``p``'s members: the next attempt."""
    return plan_next(
        r, s, c, members=p.members, failed=p.failed, attempt=p.attempt,
        waited_since=p.waited_since, completed=p.completed, now=now, out=out,
    )  # fmt: skip


def _acked(
    r: Rules, s: State, c: Change, p: Agreeing, rank: int, now: float, out: list[Action]
) -> State:
    """``rank`` acknowledged the attempt; with every participant's, commit it."""
    p = replace(p, acked=p.acked | {rank})
    if p.acked < p.participants:
        return with_phase(s, c, p)
    out.append(commit(c, p.attempt, p.digest))
    applying = Applying(
        failed=p.failed,
        attempt=p.attempt,
        digest=p.digest,
        plan=p.plan,
        participants=p.participants,
        record=p.record,
        planned_at=p.planned_at,
        committed_at=now,
        completed=p.completed,
        deadline=now + r.stop_timeout_s,
    )
    return with_phase(s, c, applying)
