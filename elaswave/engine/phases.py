"""The phases of a plan change, and its timers: the transitions
:func:`elaswave.engine.protocol.step` composes (pure; see that module for the protocol)."""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Collection, Mapping
from typing import Any

from elaswave.bus.schema import (
    FailureDetected,
    PauseRequest,
    RecoveryFinished,
    RecoveryKind,
    RecoveryStarted,
)
from elaswave.engine import plan_inputs
from elaswave.engine.change import (
    Action,
    Applied,
    Change,
    Finishing,
    Kill,
    Note,
    Phase,
    Publish,
    Rules,
    SharePlan,
    State,
    Stopped,
)
from elaswave.engine.dataflow import resize_after_failure
from elaswave.engine.migration import NONBLOCKING, MigrationDecision, decide_migration
from elaswave.engine.plan import plan_summary
from elaswave.engine.plan_inputs import PlanInputs, PlanOutcome, announcement
from elaswave.engine.recovery import Rebalancing, plan_digest
from elaswave.engine.replan import plan_fail_stop
from elaswave.engine.stopping import Announce, Outcome, Stopping, on_report, outcome, stop_phase
from elaswave.engine.waiting import (
    begin_checkpoint,
    checkpoint_failed,
    wait_for_nodes,
)
from elaswave.fabric.errors import TooFewRanks, Unrecoverable

KILLED = -int(signal.SIGKILL)
"""The exit code of a process the Core fenced."""

replace = dataclasses.replace


def deadline(rules: Rules, state: State) -> float | None:
    """The earliest time a :class:`Tick` would change something (None: no timer)."""
    times = [
        f.deadline if f.redone_at is None else f.redone_at + rules.migrated_wait_s
        for f in state.finishing
    ]
    if (c := state.change) is not None:
        times.append(c.deadline)
        times += [t + rules.exit_grace_s for _, t in c.exited.values()]
    return min(times, default=None)


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


# ----------------------------------------------------------------------------- phases


def new_change(s: State, kind: RecoveryKind, stop: Stopping, now: float, due: float) -> Change:
    """A change of ``kind`` seen at ``now``, detecting until ``due``."""
    return Change(
        kind=kind,
        phase=Phase.DETECTING,
        generation=s.plan.generation,
        ranks=(),
        detail="",
        stop=stop,
        seen_at=now,
        origin=now,
        deadline=due,
    )


def begin_stop(r: Rules, s: State, c: Change, now: float, out: list[Action]) -> State:
    """Announce the change: every member stops; members already gone are failed."""
    gone = {x: s.codes.get(x, KILLED) for x in s.plan.ranks if x not in s.alive}
    stop, announce = stop_phase(c.generation, frozenset(s.plan.ranks), {**gone, **c.stop.failed})
    for rank in s.reports:
        stop = on_report(stop, rank, c.generation)
    c = replace(c, phase=Phase.STOPPING, stop=stop, deadline=now + r.stop_timeout_s)
    s = replace(s, change=c)
    if c.after_step >= 0:
        out.append(Publish(pause_request(s, c)))
    announce_failures(s, announce, out)
    return after_stop(r, s, now, out)


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
    stop = stop_phase(s.plan.generation, frozenset(), {})[0]
    c = replace(
        new_change(s, kind, stop, now, now),
        ranks=tuple(ranks),
        detail=detail,
        joined=joined,
        after_step=s.last_step + 1,
    )
    return begin_stop(r, s, c, now, out)


def pause_request(s: State, c: Change) -> PauseRequest:
    """The announcement of a pause (a join or a rebalance)."""
    return PauseRequest(
        sender="core", generation=c.generation, after_step=c.after_step, reason=c.detail
    )


def stop_text(s: State, c: Change) -> str:
    """What the change is about while members stop: its cause and every loss so far."""
    failed = dict(c.stop.failed)
    if c.kind is RecoveryKind.FAIL_STOP:
        return describe(s, failed)
    return f"{c.detail}; then, while pausing: {describe(s, failed)}" if failed else c.detail


def _text(s: State, c: Change) -> str:
    """What the change is about, in words, for messages."""
    return stop_text(s, c) if c.phase in (Phase.DETECTING, Phase.STOPPING) else c.detail


def announce_failures(s: State, announce: list[Announce], out: list[Action]) -> None:
    c = s.change
    assert c is not None
    for a in announce:
        why = stop_text(s, c)
        out.append(
            Note("core.failure_detected", {"ranks": list(a.ranks), "generation": a.generation})
        )
        out.append(
            Publish(
                FailureDetected(
                    sender="core",
                    generation=a.generation,
                    ranks=list(a.ranks),
                    source="process-exit",
                    detail=why,
                )
            )
        )


def after_stop(r: Rules, s: State, now: float, out: list[Action]) -> State:
    c = s.change
    assert c is not None
    result = outcome(c.stop)
    if result is Outcome.NONE_LEFT and c.stop.failed and not any(c.stop.failed.values()):
        # Every member exited with code 0: they trained the last step before they could
        # pause (a join or a rebalance asked for too late). The job is done; the change
        # has nothing left to change (late joiners are sent away as the job ends).
        out.append(Note("core.change_dropped", {"generation": c.generation, "why": c.detail}))
        return replace(s, change=None)
    if result is Outcome.NONE_LEFT:
        raise Stopped(f"{stop_text(s, c)}; no worker survives")
    if result is Outcome.STOPPED:
        return plan_next(r, replace(s, change=replace(c, detail=stop_text(s, c))), now, out)
    return s


def rebalancing(r: Rules, s: State, ranks: Collection[int]) -> Rebalancing:
    """The throughput planner's inputs for a plan of ``ranks``: the slowdowns measured
    on those (a slow rank that then failed is no input)."""
    return replace(r.rebalancing, slowdowns=_slow(s, ranks))


def _slow(s: State, ranks: Collection[int]) -> dict[int, float]:
    return {x: f for x, f in s.slowdowns.items() if x in ranks}


def plan_next(r: Rules, s: State, now: float, out: list[Action]) -> State:
    """Every member left has stopped: plan, and announce the next attempt."""
    c = s.change
    assert c is not None
    survivors = c.stop.members
    failed = sorted(c.stop.failed)
    inputs = PlanInputs(
        failed=tuple(failed),
        joined=c.joined,
        policy=r.rebalancing.policy,
        slowdowns=_slow(s, survivors | set(c.joined)),
    )
    try:
        decision = plan_fail_stop(
            s.plan,
            failed,
            {x: s.reports[x].committed_step for x in survivors},
            newest={x: s.reports[x].newest for x in survivors},
            ranks_per_node=r.ranks_per_node,
            snapshots=r.snapshots,
            rebalancing=plan_inputs.rebalancing(inputs, r.rebalancing),
            joined=c.joined,
            floor=s.recoveries[-1]["committed_step"] if s.recoveries else r.first_step,
        )
    except TooFewRanks as exc:
        if r.wait_for_nodes_s > 0:
            return wait_for_nodes(r, s, exc, now, out)
        raise Stopped(
            f"unrecoverable: {c.detail}; {exc} (train with --wait-for-nodes SECONDS to wait "
            "for joining ranks instead)"
        ) from None
    except Unrecoverable as exc:
        raise Stopped(f"unrecoverable: {c.detail}; {exc}") from None
    attempt, redo = c.attempt + 1, decision.committed_step + 1
    stale = sorted(x for x in survivors if s.reports[x].params_step != decision.committed_step)
    reb = r.rebalancing
    assert reb.device is not None, "the rules carry the cost model's device"
    migration = decide_migration(
        r.migration,
        s.plan,
        decision.plan,
        stale=stale,
        joined=c.joined,
        layers=reb.layers,
        device=reb.device,
        early=r.migration_early,
    )
    inputs = dataclasses.replace(inputs, stale=tuple(stale), migration=migration.mode)
    ranks = sorted(set(c.ranks) | set(failed))
    origin = c.origin
    if attempt == 0:
        if c.kind is RecoveryKind.FAIL_STOP:
            killed = [s.killed_at[x] for x in failed if x in s.killed_at]
            origin = min(killed, default=c.seen_at)
        out.append(
            Publish(
                RecoveryStarted(
                    sender="core",
                    generation=c.generation + 1,
                    step=redo,
                    kind=c.kind,
                    ranks=ranks,
                    reason=decision.reason,
                )
            )
        )
    digest = plan_digest(decision.plan)
    outcome = PlanOutcome(
        generation=c.generation + 1,
        attempt=attempt,
        kind=c.kind,
        committed_step=decision.committed_step,
        plan_digest=digest,
        reason=decision.reason,
        rebuild=tuple(sorted({name for x in survivors for name in s.reports[x].tainted})),
    )
    out.append(Publish(announcement(inputs, outcome)))
    record = {
        "step": redo,
        "kind": str(c.kind),
        "ranks": ranks,
        "generation": c.generation + 1,
        "committed_step": decision.committed_step,
        "reason": decision.reason,
        "superseded": attempt,
        "migration": _migration_record(migration),
        "plan": plan_summary(decision.plan),
        "joined": list(c.joined),
    }
    if c.waiting_since >= 0:
        record["waited_s"] = now - c.waiting_since
    c = replace(
        c,
        phase=Phase.AGREEING,
        attempt=attempt,
        digest=digest,
        plan=decision.plan,
        participants=survivors | set(c.joined),
        acked=frozenset(),
        deadline=now + r.ack_timeout_s,
        planned_at=now,
        origin=origin,
        record=record,
    )
    return replace(s, change=c)


def _migration_record(m: MigrationDecision) -> dict[str, object]:
    """``m`` as summary.json records it."""
    doc: dict[str, object] = {"mode": str(m.mode), "layers": list(m.layers)}
    if m.why is not None:
        doc["why"] = m.why
    if m.early_micro_batches is not None:
        doc["early_micro_batches"] = m.early_micro_batches
    return doc


def lose(r: Rules, s: State, lost: Mapping[int, int], now: float, out: list[Action]) -> State:
    """Participants lost before the commit: a new attempt supersedes the announcement
    (before one is announced, a lost joiner just leaves the change)."""
    c = s.change
    assert c is not None
    joined = tuple(x for x in c.joined if x not in lost)
    if c.phase is Phase.WAITING:  # one more rank is missing
        return plan_next(r, replace(s, change=replace(c, joined=joined)), now, out)
    if c.phase is not Phase.AGREEING:
        return replace(s, change=replace(c, joined=joined))
    why = describe(s, lost)
    out.append(Note("core.plan_superseded", {"generation": c.generation + 1, "attempt": c.attempt}))
    stop = replace(
        c.stop,
        members=c.stop.members - set(lost),
        failed={**c.stop.failed, **{x: code for x, code in lost.items() if x not in c.joined}},
    )
    c = replace(
        c,
        stop=stop,
        joined=joined,
        ranks=tuple(sorted(set(c.ranks) | set(lost))),
        detail=f"{c.detail}; then before the plan ran: {why}",
        participants=c.participants - set(lost),
    )
    if not c.participants & set(s.plan.ranks):
        raise Stopped(f"{c.detail}; no worker survives")
    return plan_next(r, replace(s, change=c), now, out)


def take_applied(
    r: Rules, s: State, rank: int, applied: Applied, now: float, out: list[Action]
) -> State:
    c = s.change
    assert c is not None
    plan = c.plan
    assert plan is not None
    exited = {x: v for x, v in c.exited.items() if x != rank}
    c = replace(c, applied={**c.applied, rank: applied}, exited=exited)
    if not c.participants <= set(c.applied):
        return replace(s, change=c)
    # Every participant applied the plan: it is current; record the change.
    done = c.applied.values()
    record = {
        **c.record,
        "mttr_s": now - c.origin,
        "phases": {
            "detect": c.seen_at - c.origin,
            "plan": c.planned_at - c.seen_at,
            "ack": c.committed_at - c.planned_at,
            "comm": max((a.comm_s for a in done), default=0.0),
            "remap": max((a.remap_s for a in done), default=0.0),
            "resume": max((a.resume_s for a in done), default=0.0),
            "redo": None,
        },
        "bytes_moved": sum(a.bytes_sent for a in done),
        "params_s": max((a.params_s for a in done), default=0.0),
    }
    nonblocking = record["migration"]["mode"] == NONBLOCKING
    finishing = Finishing(
        index=len(s.recoveries),
        generation=c.generation + 1,
        redo=record["step"],
        origin=c.origin,
        planned_at=c.planned_at,
        done_at=now,
        deadline=now + r.stop_timeout_s,
        ranks=len(plan.ranks) if nonblocking else 0,
    )
    if (at := c.completed.get(finishing.redo)) is not None:  # the redone step is done
        record["mttr_s"] = at - c.origin
        record["phases"] = {**record["phases"], "redo": max(0.0, at - now)}
        finishing = replace(finishing, redone_at=at)
    out.append(Note("core.recovered", {k: v for k, v in record.items() if k != "reason"}))
    return replace(
        s,
        plan=plan,
        slowdowns=_slow(s, plan.ranks),
        change=None,
        reports={},
        recoveries=(*s.recoveries, record),
        finishing=(*s.finishing, finishing),
    )


def set_record(s: State, index: int, record: dict[str, Any]) -> State:
    return replace(s, recoveries=(*s.recoveries[:index], record, *s.recoveries[index + 1 :]))


# ----------------------------------------------------------------------------- timers


def advance(r: Rules, s: State, now: float, out: list[Action]) -> State:
    """What time and the new state make due: deadlines, the next change."""
    c = s.change
    if c is not None and c.phase is Phase.DETECTING and now >= c.deadline:
        s = begin_stop(r, s, c, now, out)
    elif c is not None and c.phase is Phase.STOPPING and now >= c.deadline:
        missing = sorted(c.stop.members - c.stop.reported)
        what = "stop" if c.after_step < 0 else "pause"
        raise Stopped(
            f"{_text(s, c)}; ranks {missing} did not {what} at a step boundary "
            f"within {r.stop_timeout_s:g} s"
        )
    elif c is not None and c.phase is Phase.AGREEING and now >= c.deadline:
        silent = sorted(c.participants - c.acked)
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
        s = lose(r, s, {x: KILLED for x in silent}, now, out)
    elif c is not None and c.phase is Phase.WAITING:
        ready = sorted(x for x in s.joiners if x in s.alive and x not in s.plan.ranks)
        if ready:  # nodes came back: plan with them
            out.append(SharePlan(s.plan))
            c = replace(c, joined=(*c.joined, *ready), detail=f"{c.detail}; ranks {ready} join")
            s = plan_next(r, replace(s, joiners=frozenset(), change=c), now, out)
        elif now >= c.deadline:
            s = begin_checkpoint(r, s, now, out)
    elif c is not None and c.phase is Phase.CHECKPOINTING and now >= c.deadline:
        raise Stopped(checkpoint_failed(r, s, c, f"within {r.stop_timeout_s:g} s"))
    elif c is not None and c.phase is Phase.APPLYING:
        if any(now >= t + r.exit_grace_s for _, t in c.exited.values()):
            raise Stopped(window(r, s, c))
        if now >= c.deadline:
            missing = sorted(c.participants - set(c.applied))
            raise Stopped(
                f"{_text(s, c)}; ranks {missing} did not apply the recovery plan "
                f"within {r.stop_timeout_s:g} s"
            )
    s = _finish(r, s, now, out)
    if s.change is not None:
        return s
    if later := {x: code for x, code in s.later.items() if x in s.plan.ranks}:
        s = replace(s, later={})
        if not r.recovery:
            raise Stopped(f"{describe(s, later)} (recovery is off)")
        stop = stop_phase(s.plan.generation, frozenset(), later)[0]
        return begin_stop(r, s, new_change(s, RecoveryKind.FAIL_STOP, stop, now, now), now, out)
    ready = sorted(x for x in s.joiners if x in s.alive and x not in s.plan.ranks)
    if ready and s.done_step + 2 < r.steps and s.alive & set(s.plan.ranks):
        out.append(SharePlan(s.plan))
        s = replace(s, joiners=frozenset())
        detail = f"ranks {ready} join"
        return pause(r, s, RecoveryKind.JOIN, ready, detail, tuple(ready), now, out)
    return s


def window(r: Rules, s: State, c: Change) -> str:
    """Why a failure while the plan is applied stops the job."""
    gone = {x: code for x, (code, _) in c.exited.items()}
    # Those killed (or fenced) are the cause; peers that then failed on their links with
    # them are named, their errors left to their logs.
    cause = {x: code for x, code in gone.items() if code < 0 or x in s.fenced} or gone
    then = sorted(set(gone) - set(cause))
    after = f"; then ranks {then} stopped on errors with them (see logs/rankN.log)" if then else ""
    return (
        f"{_text(s, c)}; then, while waiting for every rank to apply the recovery plan: "
        f"{describe(s, cause)}{after} (a failure in that window is not recovered: the job "
        f"stops; {r.resume_hint})"
    )


def all_lost(s: State, c: Change) -> str:
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
        f"{_text(s, c)}; then, while waiting for every rank to apply the recovery plan: "
        f"{describe(s, gone)}; unrecoverable: {lost} (joining ranks {joiners} hold no "
        "state until the plan adding them is applied)"
    )


def _finish(r: Rules, s: State, now: float, out: list[Action]) -> State:
    """Announce RecoveryFinished for each change whose redone step completed (and whose
    migration every rank finished), or whose wait ran out."""
    keep = []
    for f in s.finishing:
        migrated = {k: v for k, v in s.migrated.items() if k.startswith(f"{f.generation}:")}
        if f.redone_at is None:
            due = now >= f.deadline
        else:
            due = len(migrated) >= f.ranks or now >= f.redone_at + r.migrated_wait_s
        if not due:
            keep.append(f)
            continue
        record = dict(s.recoveries[f.index])
        if migrated:
            record["migration"] = {
                **record["migration"],
                "bytes_streamed": sum(b for b, _ in migrated.values()),
                "waited_s": max(w for _, w in migrated.values()),
            }
            s = set_record(s, f.index, record)
            gone = {k for k in s.migrated if k.startswith(f"{f.generation}:")}
            s = replace(s, migrated={k: v for k, v in s.migrated.items() if k not in gone})
        out.append(
            Publish(
                RecoveryFinished(
                    sender="core",
                    generation=f.generation,
                    step=f.redo,
                    kind=record["kind"],
                    ranks=record["ranks"],
                    mttr_s=record["mttr_s"],
                    joined=record.get("joined", []),
                )
            )
        )
    if len(keep) == len(s.finishing):
        return s
    return replace(s, finishing=tuple(keep))
