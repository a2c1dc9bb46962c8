"""Waiting for nodes instead of stopping (pure): when too few ranks are left to fill
every stage but no state is lost, the stopped members keep their state in memory and
the change waits for joiners, up to ``Rules.wait_for_nodes_s`` (the wait begins in
:func:`elaswave.engine.phases.planning.wait_for_nodes`, where planning finds too few
ranks).

- Joiners that announce themselves are planned with the survivors (the change goes on
  to agree a plan, or waits on if still too few).
- A member lost meanwhile is planned without (its loss may make state lost: then the
  job stops naming it); a joiner lost leaves the change.
- A wait that runs out plans the members onto a shorter pipeline, in memory, as a job
  that does not wait would have at once (``RecoveryPlan.shorten``); only when no
  shorter pipeline fits in their memory (or state is lost), or the job asks so
  (``Rules.shorten_after_wait`` off), does it ask them to write a checkpoint of the
  step they roll back to (:mod:`.checkpointing`), then stop the job naming how to
  resume.
- A restarted Core announces the wait again (its deadline kept).
- **No member left** (:func:`wait_to_restore`): when every member was lost but a
  checkpoint is on disk and the job restores them, the change waits the same way for
  joiners (a worker started again, ``--max-restarts``; a returning host) and plans
  them onto the checkpoint, for the job's wait for nodes or, without one in a job that
  starts failed workers again, :data:`~elaswave.engine.rules.RESTART_WAIT_S`; none
  coming by the deadline, the job stops.

A job that does not wait re-pipelines onto fewer stages instead
(:func:`elaswave.engine.replan.replan`).
"""

from __future__ import annotations

import dataclasses

from elaswave.engine.actions import Action, SharePlan, Stopped
from elaswave.engine.change import Change, State, Waiting
from elaswave.engine.inputs import Exited, Input, Restarted
from elaswave.engine.phases.checkpointing import begin_checkpoint
from elaswave.engine.phases.planning import announce_wait, plan_next, spawn_scheduled
from elaswave.engine.phases.shared import describe, ready_joiners
from elaswave.engine.rules import Rules

replace = dataclasses.replace


def take(
    r: Rules, s: State, c: Change, p: Waiting, e: Input, now: float, out: list[Action]
) -> State:
    """What ``e`` does while the members wait for joiners."""
    match e:
        case Exited(rank=rank) if rank not in s.plan.ranks:
            if rank not in c.joined:
                return s
            c = replace(c, joined=tuple(x for x in c.joined if x != rank))
            return _plan(r, s, c, p, now, out)  # one more rank is missing
        case Exited(rank=rank, code=code) if rank in p.members:  # plan without it
            why = describe(s, {rank: code})
            c = replace(c, detail=f"{c.detail}; then, while waiting for nodes: {why}")
            p = replace(p, members=p.members - {rank}, failed=p.failed | {rank})
            return _plan(r, s, c, p, now, out)
        case Restarted() if not p.members:  # announce the wait again (its deadline kept)
            return _announce_restore(r, s, c, p, out)
        case Restarted():
            return _plan(r, s, c, p, now, out)
    return s


def due(r: Rules, s: State, c: Change, p: Waiting, now: float, out: list[Action]) -> State:
    """Joiners came: plan with them. The wait ran out: a shorter pipeline, or a
    checkpoint."""
    if ready := ready_joiners(s):  # nodes came back: plan with them
        out.append(SharePlan(s.plan))
        c = replace(c, joined=(*c.joined, *ready), detail=f"{c.detail}; ranks {ready} join")
        return _plan(r, replace(s, joiners=frozenset()), c, p, now, out)
    if now >= p.deadline and not p.members:
        raise Stopped(
            f"{c.detail}; waited {r.restore_wait_s:g} s for joining ranks to restore the "
            f"checkpoint of step {_restore_step(s)}, and none came; no worker survives"
        )
    if now >= p.deadline and r.shorten_after_wait:
        return _shortened(r, s, c, p, now, out)
    if now >= p.deadline:
        return begin_checkpoint(r, s, c, p, now, out)
    return s


def _shortened(r: Rules, s: State, c: Change, p: Waiting, now: float, out: list[Action]) -> State:
    """The wait ran out: plan the members onto fewer stages; when none fits (or the
    plan finds state lost), write a checkpoint and stop."""
    announced = len(out)
    try:
        return _plan(r, s, c, p, now, out, shorten=True)
    except Stopped:
        del out[announced:]
        return begin_checkpoint(r, s, c, p, now, out)


def _plan(
    r: Rules, s: State, c: Change, p: Waiting, now: float, out: list[Action], shorten: bool = False
) -> State:
    return plan_next(
        r, s, c, members=p.members, failed=p.failed, attempt=p.attempt, waited_since=p.since,
        completed=p.completed, now=now, out=out, shorten=shorten,
    )  # fmt: skip


def wait_to_restore(
    r: Rules, s: State, c: Change, failed: frozenset[int], now: float, out: list[Action]
) -> State:
    """No member is left, a checkpoint can be restored and the job waits for nodes or
    starts failed workers again: wait for joiners to restore it, until
    ``r.restore_wait_s`` from now."""
    p = Waiting(
        members=frozenset(), failed=failed, needed=len(s.plan.stages), step=-1, since=now,
        attempt=-1, deadline=now + r.restore_wait_s,
    )  # fmt: skip
    return spawn_scheduled(r, _announce_restore(r, s, c, p, out), c, p.needed, out)


def _announce_restore(r: Rules, s: State, c: Change, p: Waiting, out: list[Action]) -> State:
    """Announce the wait of :func:`wait_to_restore` (again, after a Core restart)."""
    reason = (
        f"{c.detail}; no worker survives: waiting for joining ranks to restore the "
        f"checkpoint of step {_restore_step(s)}"
    )
    return announce_wait(
        s, c, p, wait_s=r.restore_wait_s, reason=reason, note={"restore": True}, out=out
    )


def _restore_step(s: State) -> int:
    """The newest checkpoint a restore would read: none newer than the last done step."""
    return max(x for x in s.checkpoints if x <= s.done_step)
