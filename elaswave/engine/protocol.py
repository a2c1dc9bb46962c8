"""The Core's change protocol as a pure state machine: ``step(rules, state, input, now)
-> (state, actions)``.

A change leaves generation ``g`` for ``g + 1`` (docs/protocol.md):

1. **Detect**: a member exits non-zero (exits within ``grace_s`` are one failure), is
   fenced, or a join or a rebalance is due.
2. **Stop** (:mod:`elaswave.engine.stopping`): a failure is announced
   (``FailureDetected``), a join or rebalance asks for a pause (``PauseRequest``); every
   member stops at a step boundary and reports (``RecoveryReady``). A member lost
   meanwhile widens the announced failed set.
3. **Plan**: the pure planner computes plan ``g + 1``; it is announced (``RecoveryPlan``,
   attempt ``a``).
4. **Agree**: every participant acknowledges the attempt's digest. One that exits, or
   stays silent past ``ack_timeout_s`` (fenced), joins the failed set; attempt ``a + 1``
   supersedes the announcement, which never runs.
5. **Commit** (``PlanCommit``) once every participant of the final attempt acknowledged.
6. **Apply**: every participant applies the plan and reports (``RecoveryDone``); the plan
   becomes current and the change is recorded. MTTR ends when the redone step completes
   (``RecoveryFinished``).

Nothing here does I/O or reads a clock: the Core's shell (:mod:`elaswave.runtime.
supervisor`) feeds it the events it observes, persists each new state before it carries
out the actions, and a restarted Core continues from the persisted state
(:class:`~elaswave.engine.change.Restarted`). tests/unit/test_protocol.py model-checks it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from elaswave.bus.schema import (
    PlanCommit,
    RecoveryKind,
    StragglerDetected,
)
from elaswave.engine.change import (
    Acked,
    Action,
    Applied,
    Checkpointed,
    Done,
    Exited,
    Input,
    Joining,
    Kill,
    Migrated,
    Note,
    Phase,
    Publish,
    Ready,
    Restarted,
    Rules,
    ScaleUp,
    Silent,
    State,
    StepDone,
    Stop,
    Stopped,
    Straggling,
    Terminate,
    Tick,
    Trained,
)
from elaswave.engine.phases import (
    advance,
    after_stop,
    all_lost,
    announce_failures,
    describe,
    lose,
    new_change,
    pause,
    pause_request,
    plan_next,
    rebalancing,
    set_record,
    take_applied,
    window,
)
from elaswave.engine.recovery import next_plan
from elaswave.engine.stopping import Announce, on_exit, on_report, stop_phase
from elaswave.engine.waiting import (
    checkpoint_failed,
    checkpoint_request,
    checkpoint_writers,
    checkpointed,
    spawn,
)

replace = dataclasses.replace


def step(rules: Rules, state: State, event: Input, now: float) -> tuple[State, list[Action]]:
    """The state after ``event`` at wall time ``now``, and what to do, in order."""
    if state.stopped:
        return state, []
    out: list[Action] = []
    try:
        state = _HANDLERS[type(event)](rules, state, event, now, out)
        state = advance(rules, state, now, out)
    except Stopped as exc:
        reason = str(exc)
        return replace(state, stopped=reason), [*out, Stop(reason)]
    return state, out


# ----------------------------------------------------------------------------- inputs


def _exited(r: Rules, s: State, e: Exited, now: float, out: list[Action]) -> State:
    if e.rank not in s.alive:
        return s  # fenced and dropped already, or reported twice
    s = replace(
        s,
        alive=s.alive - {e.rank},
        codes={**s.codes, e.rank: e.code},
        errors={**s.errors, e.rank: e.why} if e.why else s.errors,
        killed_at={**s.killed_at, e.rank: e.killed_at} if e.killed_at is not None else s.killed_at,
    )
    c = s.change
    if e.rank not in s.plan.ranks:  # a joiner not added yet
        s = replace(s, joiners=s.joiners - {e.rank})
        out.append(Note("core.joiner_exited", {"rank": e.rank, "code": e.code}))
        if c is None or e.rank not in c.joined:
            return s
        if c.phase is not Phase.APPLYING:
            return lose(r, s, {e.rank: e.code}, now, out)
        # A joiner lost while the plan that adds it is applied: as any participant.
    elif not s.alive & set(s.plan.ranks):  # the job is over; late joiners have no place
        if c is not None and c.phase is Phase.APPLYING and s.alive & set(c.joined):
            # A joiner holds nothing until the plan adding it is applied: the state is gone,
            # lost to the faults themselves, or to members failing on their links with a
            # lost peer while they applied it (the window a failure is not recovered in).
            faults = all(s.codes.get(x, 0) < 0 or x in s.fenced for x in s.plan.ranks)
            c = replace(c, exited={**c.exited, e.rank: (e.code, now)})  # this exit too
            raise Stopped(all_lost(s, c) if faults else window(r, s, c))
        for rank in sorted(s.alive):
            out.append(Note("core.joiner_stopped", {"rank": rank}))
            out.append(Terminate(rank))
    if c is None:
        if e.code == 0:
            return s
        if not r.recovery:
            raise Stopped(f"{describe(s, {e.rank: e.code})} (recovery is off)")
        stop = stop_phase(s.plan.generation, frozenset(), {e.rank: e.code})[0]
        return replace(s, change=new_change(s, RecoveryKind.FAIL_STOP, stop, now, now + r.grace_s))
    if c.phase is Phase.DETECTING:
        if e.code == 0:
            return s  # the stop phase counts it lost with the others
        stop = replace(c.stop, failed={**c.stop.failed, e.rank: e.code})
        return replace(s, change=replace(c, stop=stop))
    if c.phase is Phase.STOPPING:
        stop, announce = on_exit(c.stop, e.rank, e.code)
        s = replace(s, change=replace(c, stop=stop))
        announce_failures(s, announce, out)
        return after_stop(r, s, now, out)
    if c.phase is Phase.AGREEING:
        return lose(r, s, {e.rank: e.code}, now, out) if e.rank in c.participants else s
    if c.phase is Phase.CHECKPOINTING:
        if e.rank in c.writers - c.written:
            raise Stopped(checkpoint_failed(r, s, c, describe(s, {e.rank: e.code})))
        return s
    if c.phase is Phase.WAITING:  # a stopped member lost while waiting: plan without it
        if e.rank not in c.stop.members:
            return s
        stop = replace(
            c.stop, members=c.stop.members - {e.rank}, failed={**c.stop.failed, e.rank: e.code}
        )
        why = describe(s, {e.rank: e.code})
        c = replace(c, stop=stop, detail=f"{c.detail}; then, while waiting for nodes: {why}")
        return plan_next(r, replace(s, change=c), now, out)
    if e.rank in c.participants and e.rank not in c.applied:  # applying
        if e.code == 0:  # it went past the change and finished
            return take_applied(r, s, e.rank, Applied(), now, out)
        return replace(s, change=replace(c, exited={**c.exited, e.rank: (e.code, now)}))
    if e.code != 0:  # a later failure: the next change takes it
        return replace(s, later={**s.later, e.rank: e.code})
    return s


def _silent(r: Rules, s: State, e: Silent, now: float, out: list[Action]) -> State:
    if e.rank not in s.alive or e.rank in s.fenced:
        return s
    out += [Note("core.fencing", {"rank": e.rank, "why": e.why}), Kill(e.rank)]
    return replace(s, fenced={**s.fenced, e.rank: e.why})


def _joining(r: Rules, s: State, e: Joining, now: float, out: list[Action]) -> State:
    if e.rank in s.alive and e.rank not in s.plan.ranks:
        return replace(s, joiners=s.joiners | {e.rank})
    return s


def _scale_up(r: Rules, s: State, e: ScaleUp, now: float, out: list[Action]) -> State:
    if e.index < s.scales_done:
        return s  # a restarted Core reads its predecessor's requests again
    s = replace(s, scales_done=e.index + 1)
    for _ in range(e.add):
        s = spawn(r, s, out)
    return s


def _straggling(r: Rules, s: State, e: Straggling, now: float, out: list[Action]) -> State:
    if s.change is not None:
        return s
    ranks = sorted(e.slowdowns)
    out.append(
        Publish(
            StragglerDetected(
                sender="core",
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
    candidate, _ = next_plan(s.plan, (), rebalancing(r, s, s.plan.ranks))
    if s.last_step + 2 >= r.steps or candidate == s.plan or not s.alive:
        return s  # the job ends before a change could pay off, or nothing changes
    detail = f"{RecoveryKind.FAIL_SLOW}: {e.reason}"
    return pause(r, s, RecoveryKind.FAIL_SLOW, ranks or list(e.recovered), detail, (), now, out)


def _ready(r: Rules, s: State, e: Ready, now: float, out: list[Action]) -> State:
    if e.generation != s.plan.generation or e.rank not in s.plan.ranks:
        return s
    s = replace(s, reports={**s.reports, e.rank: e.report})
    c = s.change
    if c is None or c.phase is not Phase.STOPPING:
        return s
    s = replace(s, change=replace(c, stop=on_report(c.stop, e.rank, e.generation)))
    return after_stop(r, s, now, out)


def _acked(r: Rules, s: State, e: Acked, now: float, out: list[Action]) -> State:
    c = s.change
    if (
        c is None
        or c.phase is not Phase.AGREEING
        or (e.generation, e.attempt, e.digest) != (c.generation + 1, c.attempt, c.digest)
        or e.rank not in c.participants
    ):
        return s
    c = replace(c, acked=c.acked | {e.rank})
    if c.acked < c.participants:
        return replace(s, change=c)
    out.append(
        Publish(
            PlanCommit(
                sender="core", generation=c.generation + 1, plan_digest=c.digest, attempt=c.attempt
            )
        )
    )
    c = replace(c, phase=Phase.APPLYING, committed_at=now, deadline=now + r.stop_timeout_s)
    return replace(s, change=c)


def _done(r: Rules, s: State, e: Done, now: float, out: list[Action]) -> State:
    c = s.change
    if c is None or c.phase is not Phase.APPLYING or e.generation != c.generation + 1:
        return s
    return take_applied(r, s, e.rank, e.applied, now, out) if e.rank in c.participants else s


def _trained(r: Rules, s: State, e: Trained, now: float, out: list[Action]) -> State:
    s = replace(
        s,
        trained={**s.trained, e.rank: max(e.generation, s.trained.get(e.rank, -1))},
        last_step=max(s.last_step, e.step),
    )
    c = s.change
    if (
        c is not None
        and c.phase is Phase.APPLYING
        and e.generation > c.generation
        and e.rank in c.participants
        and e.rank not in c.applied
    ):  # it went past the change: its report was lost with no sender left to repeat it
        return take_applied(r, s, e.rank, Applied(), now, out)
    return s


def _step_done(r: Rules, s: State, e: StepDone, now: float, out: list[Action]) -> State:
    s = replace(s, done_step=max(s.done_step, e.step))
    c = s.change
    if c is not None and c.phase in (Phase.AGREEING, Phase.APPLYING) and e.at >= c.planned_at:
        s = replace(s, change=replace(c, completed={**c.completed, e.step: e.at}))
    finishing = []
    for f in s.finishing:
        if f.redone_at is None and f.redo == e.step and e.at >= f.planned_at:
            record = dict(s.recoveries[f.index])
            record["mttr_s"] = e.at - f.origin
            record["phases"] = {**record["phases"], "redo": max(0.0, e.at - f.done_at)}
            s = set_record(s, f.index, record)
            f = replace(f, redone_at=e.at)
        finishing.append(f)
    s = replace(s, finishing=tuple(finishing))
    while s.joins_done < len(r.join_steps) and r.join_steps[s.joins_done] <= s.done_step + 1:
        s = spawn(r, replace(s, joins_done=s.joins_done + 1), out)
    return s


def _migrated(r: Rules, s: State, e: Migrated, now: float, out: list[Action]) -> State:
    key = f"{e.generation}:{e.rank}"
    return replace(s, migrated={**s.migrated, key: (e.bytes_streamed, e.waited_s)})


def _checkpointed(r: Rules, s: State, e: Checkpointed, now: float, out: list[Action]) -> State:
    c = s.change
    if (
        c is None
        or c.phase is not Phase.CHECKPOINTING
        or (e.generation, e.step) != (c.generation + 1, c.checkpoint_step)
        or e.rank not in c.writers
    ):
        return s
    return checkpointed(r, s, e.rank, now)


def _tick(r: Rules, s: State, e: Tick, now: float, out: list[Action]) -> State:
    return s


def _restarted(r: Rules, s: State, e: Restarted, now: float, out: list[Action]) -> State:
    """Take over from a predecessor: redo the effects of the persisted state that may
    not have happened (each is idempotent for the workers)."""
    s = replace(s, alive=s.alive & e.present)  # one the host never started is not a worker
    c = s.change
    states = {Phase.AGREEING: "announced", Phase.APPLYING: "committed"}
    out.append(Note("core.resuming", {"state": states.get(c.phase) if c else None}))
    if c is None or c.phase is Phase.DETECTING:
        return s
    if c.phase is Phase.STOPPING:
        s = replace(s, change=replace(c, deadline=now + r.stop_timeout_s))
        if c.after_step >= 0:
            out.append(Publish(pause_request(s, c)))
        if c.stop.failed and c.stop.members:
            a = Announce(c.generation, tuple(sorted(c.stop.failed)), ())
            announce_failures(s, [a], out)
        return after_stop(r, s, now, out)
    if c.phase is Phase.CHECKPOINTING:  # ask again (a part is written idempotently)
        writers = checkpoint_writers(s, c, r.ranks_per_node)
        assert writers is not None, "the writers were found before"
        out.append(Publish(checkpoint_request(c, writers)))
        return replace(s, change=replace(c, deadline=now + r.stop_timeout_s))
    if c.phase in (Phase.AGREEING, Phase.WAITING):  # announce again: a new attempt, or
        return plan_next(r, s, now, out)  # the wait (its deadline kept)
    # Applying: every participant acknowledged this plan; send its commit again.
    out.append(
        Publish(
            PlanCommit(
                sender="core", generation=c.generation + 1, plan_digest=c.digest, attempt=c.attempt
            )
        )
    )
    return replace(s, change=replace(c, deadline=now + r.stop_timeout_s))


_HANDLERS: dict[type, Callable[[Rules, State, Any, float, list[Action]], State]] = {
    Exited: _exited,
    Silent: _silent,
    Joining: _joining,
    ScaleUp: _scale_up,
    Straggling: _straggling,
    Ready: _ready,
    Acked: _acked,
    Done: _done,
    Trained: _trained,
    StepDone: _step_done,
    Migrated: _migrated,
    Checkpointed: _checkpointed,
    Tick: _tick,
    Restarted: _restarted,
}
