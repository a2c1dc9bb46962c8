"""The applying phase of a plan change (pure): the plan is committed, and every
participant applies it (``RecoveryDone``; a step trained under the new generation counts
as a report lost on the bus). Once every participant has, the plan becomes current and
the change is recorded (:class:`~elaswave.engine.record.RecoveryRecord`); its redone
step and its migration's reports are then awaited (:mod:`.finishing`).

A participant that exits now (a failure after the commit) is given ``exit_grace_s`` for
its report to arrive. Then, in a job that restores checkpoints and has one no newer
than the change's committed step, the plan becomes current torn (:func:`torn`) and the
failure is the next change's, which restores the checkpoint; otherwise the job stops
(resumably): participants are mid-reconfigure, and without a checkpoint a failure in
that window is not recovered (docs/protocol.md, "Still open"). A failure of a rank that
is no participant waits for the next change. A restarted Core sends the commit again.
"""

from __future__ import annotations

import dataclasses

from elaswave.engine.actions import Action, Note, Stopped
from elaswave.engine.change import Applied, Applying, Change, Finishing, State
from elaswave.engine.dataflow import resize_after_failure
from elaswave.engine.inputs import Done, Exited, Input, Restarted, StepDone, Trained
from elaswave.engine.migration import MigrationMode
from elaswave.engine.phases.planning import slowdowns_on
from elaswave.engine.phases.shared import commit, describe, with_phase
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
    apply (:func:`torn`), or stops the job; one that has not applied the plan by the
    deadline stops it."""
    if any(now >= t + r.exit_grace_s for _, t in p.exited.values()):
        if r.restore and any(x <= p.record.committed_step for x in s.checkpoints):
            return torn(r, s, c, p, now, out)
        raise Stopped(window(r, s, c, p))
    if now >= p.deadline:
        missing = sorted(p.participants - set(p.applied))
        raise Stopped(
            f"{c.detail}; ranks {missing} did not apply the recovery plan "
            f"within {r.stop_timeout_s:g} s"
        )
    return s


def torn(r: Rules, s: State, c: Change, p: Applying, now: float, out: list[Action]) -> State:
    """A participant failed while the others applied the plan, and the job has a
    checkpoint no newer than its committed step: the plan becomes current as it stands
    (its record ``torn``), and the failure is the next change's. Participants caught
    mid-apply report ``torn`` (their state is not whole) and that change restores the
    checkpoint inside the job (:func:`elaswave.engine.phases.planning.plan_next`)."""
    gone = {x: code for x, (code, _) in p.exited.items()}
    record = replace(_record(c, p, now), torn=True)
    out.append(Note("core.torn", {"generation": c.generation + 1, "failed": sorted(gone)}))
    return replace(
        s,
        plan=p.plan,
        slowdowns=slowdowns_on(s, p.plan.ranks),
        change=None,
        reports={},
        recoveries=(*s.recoveries, record),
        later={**s.later, **gone},
    )


def every_member_lost(r: Rules, s: State, c: Change, p: Applying, e: Exited, now: float) -> str:
    """Why the job stops when its last member of the plan exits while joiners wait for
    the plan that adds them: the state is gone, lost to the faults themselves (no
    rank of the plan failed on its own), or to members failing on their links with a
    lost peer while they applied it (the window a failure is not recovered in)."""
    faults = all(s.codes.get(x, 0) < 0 or x in s.fenced for x in s.plan.ranks)
    p = replace(p, exited={**p.exited, e.rank: (e.code, now)})  # this exit too
    return _all_lost(s, c) if faults else window(r, s, c, p)


def window(r: Rules, s: State, c: Change, p: Applying) -> str:
    """Why a failure while the plan is applied stops the job."""
    gone = {x: code for x, (code, _) in p.exited.items()}
    # Those killed (or fenced) are the cause; peers that then failed on their links with
    # them are named, their errors left to their logs.
    cause = {x: code for x, code in gone.items() if code < 0 or x in s.fenced} or gone
    then = sorted(set(gone) - set(cause))
    after = f"; then ranks {then} stopped on errors with them (see logs/rankN.log)" if then else ""
    return (
        f"{c.detail}; then, while waiting for every rank to apply the recovery plan: "
        f"{describe(s, cause)}{after} (a failure in that window is not recovered: the job "
        f"stops; {r.resume_hint})"
    )


def _all_lost(s: State, c: Change) -> str:
    """Why the job stops when every rank of the plan is gone while a plan adding joiners
    is applied: the joiners hold no state until it is."""
    gone = {x: s.codes[x] for x in s.plan.ranks if x in s.codes}
    try:
        resize_after_failure(s.plan, s.plan.ranks)
        lost = "no rank of the plan survives"
    except Unrecoverable as exc:
        lost = str(exc)
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
