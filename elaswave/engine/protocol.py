"""The Core's change protocol as a pure state machine: ``step(rules, state, input, now)
-> (state, actions)``.

A change leaves generation ``g`` for ``g + 1`` (docs/protocol.md), phase by phase
(:mod:`elaswave.engine.phases`, one module each):

1. **Detect** (:mod:`~elaswave.engine.phases.detecting`): a member exits non-zero
   (exits within ``grace_s`` are one failure), is fenced, or a join or a rebalance is
   due.
2. **Stop** (:mod:`~elaswave.engine.phases.stopping`): a failure is announced
   (``FailureDetected``), a join or rebalance asks for a pause (``PauseRequest``); every
   member stops at a step boundary and reports (``RecoveryReady``). A member lost
   meanwhile widens the announced failed set.
3. **Plan** (:mod:`~elaswave.engine.phases.planning`): the pure planner computes plan
   ``g + 1``; it is announced (``RecoveryPlan``, attempt ``a``). State lost: the plan
   **restores** the newest usable disk checkpoint inside the job (``OnDisk`` tells the
   protocol which are complete), or the job stops. Too few ranks for the
   stages: the change **waits** for joiners (:mod:`~elaswave.engine.phases.waiting`),
   and a wait that runs out **checkpoints** and stops the job
   (:mod:`~elaswave.engine.phases.checkpointing`).
4. **Agree** (:mod:`~elaswave.engine.phases.agreeing`): every participant acknowledges
   the attempt's digest. One that exits, or stays silent past ``ack_timeout_s``
   (fenced), joins the failed set; attempt ``a + 1`` supersedes the announcement, which
   never runs. **Commit** (``PlanCommit``) once every participant of the final attempt
   acknowledged.
5. **Apply** (:mod:`~elaswave.engine.phases.applying`): every participant applies the
   plan and reports (``RecoveryDone``); the plan becomes current and the change is
   recorded. MTTR ends when the redone step completes (``RecoveryFinished``,
   :mod:`~elaswave.engine.phases.finishing`).

:func:`step` takes an input in two parts: what the Core learns from it whatever the
phase (:func:`_learn`: who is alive, reports, steps, fencing, joiners to start), then
what it does to the change under way (its phase's ``take``); then what time makes due
(:func:`advance`: its phase's ``due``, the finished changes, the next change).

Nothing here does I/O or reads a clock: the Core's shell
(:mod:`elaswave.runtime.core.supervisor`) feeds it the events it observes, persists each
new state before it carries out the actions, and a restarted Core continues from the
persisted state (:class:`~elaswave.engine.inputs.Restarted`). tests/unit/test_protocol.py
model-checks it.
"""

from __future__ import annotations

import dataclasses

from elaswave.engine.actions import Action, Kill, Note, Stop, Stopped, Terminate
from elaswave.engine.change import (
    Agreeing,
    Applying,
    Change,
    Checkpointing,
    Detecting,
    Phase,
    State,
    Stopping,
    Waiting,
)
from elaswave.engine.inputs import (
    Exited,
    Input,
    Joining,
    Migrated,
    OnDisk,
    Ready,
    Restarted,
    ScaleUp,
    Silent,
    StepDone,
    Trained,
)
from elaswave.engine.phases import (
    agreeing,
    applying,
    checkpointing,
    detecting,
    finishing,
    stopping,
    waiting,
)
from elaswave.engine.phases.shared import restorable, spawn
from elaswave.engine.record import Streamed
from elaswave.engine.rules import Rules

replace = dataclasses.replace


def step(rules: Rules, state: State, event: Input, now: float) -> tuple[State, list[Action]]:
    """The state after ``event`` at wall time ``now``, and what to do, in order."""
    if state.stopped:
        return state, []
    out: list[Action] = []
    try:
        state = _learn(rules, state, event, now, out)
        state = advance(rules, state, now, out)
    except Stopped as exc:
        reason = str(exc)
        return replace(state, stopped=reason), [*out, Stop(reason)]
    return state, out


def deadline(rules: Rules, state: State) -> float | None:
    """The earliest time a :class:`~elaswave.engine.inputs.Tick` would change something
    (None: no timer)."""
    times = [
        f.deadline if f.redone_at is None else f.redone_at + rules.migrated_wait_s
        for f in state.finishing
    ]
    if (c := state.change) is not None:
        times.append(c.phase.deadline)
        if isinstance(c.phase, Applying):
            times += [t + rules.exit_grace_s for _, t in c.phase.exited.values()]
    return min(times, default=None)


# ----------------------------------------------------------------------------- inputs


def _learn(r: Rules, s: State, e: Input, now: float, out: list[Action]) -> State:
    """What the Core learns from ``e`` whatever the phase, then ``e``'s effect on the
    change under way (:func:`_take`)."""
    match e:
        case Exited(rank=rank) if rank not in s.alive:
            return s  # fenced and dropped already, or reported twice
        case Exited():
            return _take(r, _exited(r, s, e, now, out), e, now, out)
        case Silent(rank=rank, why=why):
            if rank not in s.alive or rank in s.fenced:
                return s
            out += [Note("core.fencing", {"rank": rank, "why": why}), Kill(rank)]
            return replace(s, fenced={**s.fenced, rank: why})
        case Joining(rank=rank):
            if rank in s.alive and rank not in s.plan.ranks:
                return replace(s, joiners=s.joiners | {rank})
            return s
        case ScaleUp(index=index, add=add):
            if index < s.scales_done:
                return s  # a restarted Core reads its predecessor's requests again
            s = replace(s, scales_done=index + 1)
            for _ in range(add):
                s = spawn(r, s, out)
            return s
        case Ready(rank=rank, generation=g) if g == s.plan.generation and rank in s.plan.ranks:
            return _take(r, replace(s, reports={**s.reports, rank: e.report}), e, now, out)
        case Ready():
            return s
        case Trained(rank=rank, generation=g, step=step):
            trained = {**s.trained, rank: max(g, s.trained.get(rank, -1))}
            s = replace(s, trained=trained, last_step=max(s.last_step, step))
            return _take(r, s, e, now, out)
        case StepDone(step=step, at=at):
            return _take(r, _step_done(r, s, step, at, out), e, now, out)
        case OnDisk(steps=steps):
            return replace(s, checkpoints=tuple(sorted(set(steps))))
        case Migrated(rank=rank, generation=g):
            streamed = Streamed(bytes_streamed=e.bytes_streamed, waited_s=e.waited_s)
            return replace(s, migrated={**s.migrated, (g, rank): streamed})
        case Restarted(present=present):
            s = replace(s, alive=s.alive & present)  # one the host never started is none
            labels = {Phase.AGREEING: "announced", Phase.APPLYING: "committed"}
            label = labels.get(s.change.phase.TAG) if s.change is not None else None
            out.append(Note("core.resuming", {"state": label}))
            return _take(r, s, e, now, out)
    return _take(r, s, e, now, out)


def _take(r: Rules, s: State, e: Input, now: float, out: list[Action]) -> State:
    """``e``'s effect on the change under way: its phase's transition."""
    c = s.change
    if c is None:
        return detecting.idle(r, s, e, now, out)
    match c.phase:
        case Detecting() as p:
            return detecting.take(r, s, c, p, e, now, out)
        case Stopping() as p:
            return stopping.take(r, s, c, p, e, now, out)
        case Agreeing() as p:
            return agreeing.take(r, s, c, p, e, now, out)
        case Applying() as p:
            return applying.take(r, s, c, p, e, now, out)
        case Waiting() as p:
            return waiting.take(r, s, c, p, e, now, out)
        case Checkpointing() as p:
            return checkpointing.take(r, s, c, p, e, now, out)


def _exited(r: Rules, s: State, e: Exited, now: float, out: list[Action]) -> State:
    """A worker exited: whatever the phase, it is no longer alive; a joiner leaves the
    joiners; the last member of the plan ends the job, and sends late joiners away
    (unless they wait for the plan adding them, or the job waits for joiners to restore
    a checkpoint: then they restore it)."""
    s = replace(
        s,
        alive=s.alive - {e.rank},
        codes={**s.codes, e.rank: e.code},
        errors={**s.errors, e.rank: e.why} if e.why else s.errors,
        killed_at={**s.killed_at, e.rank: e.killed_at} if e.killed_at is not None else s.killed_at,
    )
    if e.rank not in s.plan.ranks:  # a joiner not added yet
        out.append(Note("core.joiner_exited", {"rank": e.rank, "code": e.code}))
        return replace(s, joiners=s.joiners - {e.rank})
    if s.alive & set(s.plan.ranks):
        return s
    c = s.change  # the job is over: late joiners have no place
    if c is not None and isinstance(c.phase, Applying) and s.alive & set(c.joined):
        if restorable(r, s):  # roll back: the joiners take the checkpoint
            p = replace(c.phase, exited={**c.phase.exited, e.rank: (e.code, now)})
            return applying.roll_back(r, s, c, p, now, out)
        raise Stopped(applying.every_member_lost(r, s, c, c.phase, e, now))
    if e.code != 0 and restorable(r, s) and r.restore_wait_s > 0:
        return s  # the change waits for joiners to restore a checkpoint: keep these
    for rank in sorted(s.alive):
        out.append(Note("core.joiner_stopped", {"rank": rank}))
        out.append(Terminate(rank))
    return s


def _step_done(r: Rules, s: State, step: int, at: float, out: list[Action]) -> State:
    """The job completed ``step``: a change that redoes it ends its MTTR, and joiners
    scheduled by then start."""
    s = finishing.redone(replace(s, done_step=max(s.done_step, step)), step, at)
    while s.joins_done < len(r.join_steps) and r.join_steps[s.joins_done] <= s.done_step + 1:
        s = spawn(r, replace(s, joins_done=s.joins_done + 1), out)
    return s


# ----------------------------------------------------------------------------- timers


def advance(r: Rules, s: State, now: float, out: list[Action]) -> State:
    """What time and the new state make due: the phase's deadlines, the changes that
    finished, the next change."""
    if (c := s.change) is not None:
        s = _due(r, s, c, now, out)
    s = finishing.finish(r, s, now, out)
    if s.change is not None:
        return s
    return detecting.next_change(r, s, now, out)


def _due(r: Rules, s: State, c: Change, now: float, out: list[Action]) -> State:
    match c.phase:
        case Detecting() as p:
            return detecting.due(r, s, c, p, now, out)
        case Stopping() as p:
            return stopping.due(r, s, c, p, now, out)
        case Agreeing() as p:
            return agreeing.due(r, s, c, p, now, out)
        case Applying() as p:
            return applying.due(r, s, c, p, now, out)
        case Waiting() as p:
            return waiting.due(r, s, c, p, now, out)
        case Checkpointing() as p:
            return checkpointing.due(r, s, c, p, now, out)
