"""The applying phase of a plan change (pure): the plan is committed, and every
participant applies it (``RecoveryDone``; a step trained under the new generation counts
as a report lost on the bus). Once every participant has, the plan becomes current and
the change is recorded (:class:`~elaswave.engine.record.RecoveryRecord`); its redone
step and its migration's reports are then awaited (:mod:`.finishing`).

A participant that exits now (a failure after the commit) is given ``exit_grace_s`` for
its report to arrive. Then the plan is taken back (:func:`roll_back`): every member kept
what it committed under the current plan while it applied the new one, so the change
is recorded rolled back and the next change, begun at once, answers its failures and
the new ones together from the current layout. A failure of a rank that is no
participant waits for the next change. A restarted Core sends the commit again.
"""

from __future__ import annotations

import dataclasses

from elaswave.bus.schema import CORE_SENDER, FailureDetected
from elaswave.engine.actions import Action, Note, Publish, Stopped
from elaswave.engine.change import Applied, Applying, Change, Finishing, State
from elaswave.engine.dataflow import resize_after_failure
from elaswave.engine.inputs import Done, Exited, Input, Restarted, StepDone, Trained
from elaswave.engine.migration import MigrationMode
from elaswave.engine.phases.detecting import failure
from elaswave.engine.phases.planning import slowdowns_on
from elaswave.engine.phases.shared import (
    KILLED,
    commit,
    describe,
    ready_joiners,
    restorable,
    with_phase,
)
from elaswave.engine.phases.stopping import begin_stop
from elaswave.engine.plan import taken_back
from elaswave.engine.record import PhaseTimes, RecoveryRecord, record_to_json, recorded
from elaswave.engine.rules import Rules
from elaswave.fabric.errors import Unrecoverable

replace = dataclasses.replace


def take(
    r: Rules, s: State, c: Change, p: Applying, e: Input, now: float, out: list[Action]
) -> State:
    """What ``e`` does while the participants apply the plan."""
    match e:
        case Exited(rank=rank) if rank not in s.plan.ranks and rank not in c.joined:
            return s  # a joiner this change does not add
        case Exited(rank=rank, code=0) if rank in p.participants and rank not in p.applied:
            return _applied(r, s, c, p, rank, Applied(), now, out)  # it went past the change
        case Exited(rank=rank, code=code) if rank in p.participants and rank not in p.applied:
            return with_phase(s, c, replace(p, exited={**p.exited, rank: (code, now)}))
        case Exited(rank=rank, code=code) if code != 0:  # the next change takes it
            return replace(s, later={**s.later, rank: code})
        case Done(rank=rank, generation=g, applied=applied) if (
            g == c.generation + 1 and rank in p.participants
        ):
            return _applied(r, s, c, p, rank, applied, now, out)
        case Trained(rank=rank, generation=g) if (
            g > c.generation and rank in p.participants and rank not in p.applied
        ):  # it went past the change: its report was lost with no sender left to repeat it
            return _applied(r, s, c, p, rank, Applied(), now, out)
        case StepDone(step=step, at=at) if at >= p.planned_at:
            return with_phase(s, c, replace(p, completed={**p.completed, step: at}))
        case Restarted():  # every participant acknowledged this plan: commit it again
            out.append(commit(c, p.attempt, p.digest))
            return with_phase(s, c, replace(p, deadline=now + r.stop_timeout_s))
    return s


def due(r: Rules, s: State, c: Change, p: Applying, now: float, out: list[Action]) -> State:
    """A participant that exited and did not report within ``exit_grace_s`` tears the
    apply (:func:`roll_back`); one that has not applied the plan by the deadline stops
    the job."""
    if any(now >= t + r.exit_grace_s for _, t in p.exited.values()):
        return roll_back(r, s, c, p, now, out)
    if now >= p.deadline:
        missing = sorted(p.participants - set(p.applied))
        raise Stopped(
            f"{c.detail}; ranks {missing} did not apply the recovery plan "
            f"within {r.stop_timeout_s:g} s"
        )
    return s


def roll_back(r: Rules, s: State, c: Change, p: Applying, now: float, out: list[Action]) -> State:
    """A participant failed while the others applied the plan: the plan is taken back.
    The current layout becomes current again under the plan's generation
    (:func:`~elaswave.engine.plan.taken_back`), the change is recorded rolled back, and
    the change for every rank of that layout now lost (the plan's failed ranks, the
    participants that exited, failures saved for later) begins at once, announced
    ``rollback``: every member rolls back to what it kept and reports that step, and the
    next plan is planned from the layout taken back. Joiners the plan added, still up,
    wait for a plan that adds them again."""
    gone = {x: code for x, (code, _) in p.exited.items()}
    record = replace(_record(c, p, now), rolled_back=True)
    out.append(Note("core.rolled_back", {"generation": c.generation + 1, "failed": sorted(gone)}))
    base = taken_back(s.plan, c.generation + 1)
    lost = (set(p.failed) | set(gone) | set(s.later)) & set(base.ranks)
    failed = {x: gone.get(x, s.later.get(x, s.codes.get(x, KILLED))) for x in sorted(lost)}
    joiners = {x for x in c.joined if x in s.alive and x not in gone}
    s = replace(
        s,
        plan=base,
        rolled_back=True,
        slowdowns=slowdowns_on(s, base.ranks),
        change=None,
        reports={},
        recoveries=(*s.recoveries, record),
        later={x: code for x, code in s.later.items() if x not in lost},
        joiners=s.joiners | joiners,
    )
    if failed and not s.alive & set(base.ranks) and ready_joiners(s) and restorable(r, s):
        # no member left to stop: the joiners (this plan's, or waiting) take the checkpoint
        out.append(Publish(replace(  # the joiners leave the torn plan
            rollback_announcement(s, c), ranks=sorted(failed),
            detail=f"{c.detail}; then every rank of the plan failed while it was applied: "
            "rolled back",
        )))  # fmt: skip
    s = begin_stop(r, s, failure(s, failed, now, now), failed, None, now, out)
    if not failed and s.change is not None:  # only a joiner failed: stop every member
        out.append(Publish(rollback_announcement(s, c)))
    return s


def rollback_announcement(s: State, c: Change) -> FailureDetected:
    """The announcement of a rollback no rank of the current layout failed in (a joiner
    the plan added did): every member stops all the same."""
    return FailureDetected(
        sender=CORE_SENDER,
        generation=s.plan.generation,
        ranks=[],
        source="process-exit",
        detail=f"{c.detail}; then a joining rank failed while the plan was applied: rolled back",
        rollback=True,
    )


def every_member_lost(r: Rules, s: State, c: Change, p: Applying, e: Exited, now: float) -> str:
    """Why the job stops when its last member of the plan exits while joiners wait for
    the plan that adds them: the state is gone, lost to the faults themselves (no
    rank of the plan failed on its own), or to members failing on errors of their own
    after a fault while they applied it: no member is left to roll back."""
    faults = all(s.codes.get(x, 0) < 0 or x in s.fenced for x in s.plan.ranks)
    p = replace(p, exited={**p.exited, e.rank: (e.code, now)})  # this exit too
    return _all_lost(r, s, c) if faults else window(r, s, c, p)


def window(r: Rules, s: State, c: Change, p: Applying) -> str:
    """Why the job stops when members failed on errors of their own while the plan was
    applied, and none is left to roll back."""
    gone = {x: code for x, (code, _) in p.exited.items()}
    # Those killed (or fenced) are the cause; peers that then failed on their links with
    # them are named, their errors left to their logs.
    cause = {x: code for x, code in gone.items() if code < 0 or x in s.fenced} or gone
    then = sorted(set(gone) - set(cause))
    after = f"; then ranks {then} stopped on errors with them (see logs/rankN.log)" if then else ""
    return (
        f"{c.detail}; then, while waiting for every rank to apply the recovery plan: "
        f"{describe(s, cause)}{after}; no member of the plan is left to roll back to the "
        f"state before it (joining ranks hold none){_no_checkpoint(r, s)}: the job stops; "
        f"{r.resume_hint}"
    )


def _no_checkpoint(r: Rules, s: State) -> str:
    """What a stop of a job that restores checkpoints adds: none it could restore was
    complete (it is reached only then: :func:`~elaswave.engine.phases.shared.restorable`),
    as a plan that finds state lost says it (``planning.restored``)."""
    return (
        f"; no complete checkpoint of step {s.done_step} or before to restore" if r.restore else ""
    )


def _all_lost(r: Rules, s: State, c: Change) -> str:
    """Why the job stops when every rank of the plan is gone while a plan adding joiners
    is applied: the joiners hold no state until it is, and (in a job that restores
    checkpoints) no checkpoint of the job's last completed step or before is complete,
    or the joiners would take it (:func:`~elaswave.engine.phases.shared.restorable`)."""
    gone = {x: s.codes[x] for x in s.plan.ranks if x in s.codes}
    try:
        resize_after_failure(s.plan, s.plan.ranks)
        lost = "no rank of the plan survives"
    except Unrecoverable as exc:
        lost = str(exc)
    lost += _no_checkpoint(r, s)
    joiners = sorted(s.alive & set(c.joined))
    return (
        f"{c.detail}; then, while waiting for every rank to apply the recovery plan: "
        f"{describe(s, gone)}; unrecoverable: {lost} (joining ranks {joiners} hold no "
        "state until the plan adding them is applied)"
    )


def _applied(
    r: Rules, s: State, c: Change, p: Applying, rank: int, applied: Applied, now: float,
    out: list[Action],
) -> State:  # fmt: skip
    """``rank`` applied the plan; with every participant's, the plan is current and the
    change is recorded."""
    exited = {x: v for x, v in p.exited.items() if x != rank}
    p = replace(p, applied={**p.applied, rank: applied}, exited=exited)
    if not p.participants <= set(p.applied):
        return with_phase(s, c, p)
    record = _record(c, p, now)
    nonblocking = record.migration.decision.mode == MigrationMode.NONBLOCKING
    finishing = Finishing(
        index=len(s.recoveries),
        generation=c.generation + 1,
        redo=record.step,
        origin=c.origin,
        planned_at=p.planned_at,
        done_at=now,
        deadline=now + r.stop_timeout_s,
        ranks=len(p.plan.ranks) if nonblocking else 0,
    )
    if (at := p.completed.get(finishing.redo)) is not None:  # the redone step is done
        phases = replace(record.phases, redo=max(0.0, at - now))
        record = replace(record, mttr_s=at - c.origin, phases=phases)
        finishing = replace(finishing, redone_at=at)
    fields = {k: v for k, v in record_to_json(record).items() if k != "reason"}
    out.append(Note("core.recovered", fields))
    return replace(
        s,
        plan=p.plan,
        rolled_back=False,
        # A restored checkpoint's steps are trained again: the job completed its step.
        done_step=record.committed_step if record.restored else s.done_step,
        slowdowns=slowdowns_on(s, p.plan.ranks),
        change=None,
        reports={},
        recoveries=(*s.recoveries, record),
        finishing=(*s.finishing, finishing),
    )


def _record(c: Change, p: Applying, now: float) -> RecoveryRecord:
    """The change's record, once every participant applied the plan."""
    done = p.applied.values()
    phases = PhaseTimes(
        detect=c.seen_at - c.origin,
        plan=p.planned_at - c.seen_at,
        ack=p.committed_at - p.planned_at,
        comm=max((a.comm_s for a in done), default=0.0),
        remap=max((a.remap_s for a in done), default=0.0),
        resume=max((a.resume_s for a in done), default=0.0),
    )
    return recorded(
        p.record,
        mttr_s=now - c.origin,
        phases=phases,
        bytes_moved=sum(a.bytes_sent for a in done),
        params_s=max((a.params_s for a in done), default=0.0),
        communicators=max((a.communicators for a in done), default=0),
    )
