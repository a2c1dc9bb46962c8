"""Planning a change (pure): every member left has stopped, so the Core plans generation
``g + 1`` and announces an attempt of it (the change is then agreeing), or, when too
few ranks are left for the stages and the job may wait, waits for joiners.

When the planner finds state lost (a shard and every copy of its snapshot failed) and
the job restores checkpoints, the decision restores the newest complete disk checkpoint
no member is behind (``State.checkpoints``, which the Core's shell keeps current) inside
the running job (:func:`elaswave.engine.replan.plan_restore`; ``RecoveryPlan.restore``);
without one the job stops naming what was lost.

The planner (:func:`elaswave.engine.replan.plan_fail_stop`) takes the failed and joining
ranks, the policy and the measured slowdowns (:class:`~elaswave.engine.plan_inputs.
PlanInputs`, announced in the RecoveryPlan exactly as the Core plans from them), the
survivors' reports and the step no rank may roll back before. The Core then decides how
layers migrate (:func:`elaswave.engine.migration.decide_migration`), announces the
attempt (a first attempt is preceded by RecoveryStarted) and keeps the change's record
as planned.

Entered from stopping (every member reported), agreeing (a participant lost: a new
attempt supersedes the announcement), waiting (a joiner came, a member was lost) and a
restarted Core announcing again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping

from elaswave.bus.schema import CORE_SENDER, RecoveryKind, RecoveryStarted, WaitingForNodes
from elaswave.engine.actions import Action, Note, Publish, SharePlan, Stopped
from elaswave.engine.change import Agreeing, Change, State, Waiting
from elaswave.engine.migration import MigrationDecision, MigrationMode, decide_migration
from elaswave.engine.phases.shared import ready_joiners, spawn, with_phase
from elaswave.engine.plan_inputs import PlanInputs, PlanOutcome, announcement, rebalancing
from elaswave.engine.record import MigrationRecord, PlannedRecovery, PlanSummary
from elaswave.engine.recovery import Rebalancing, plan_digest
from elaswave.engine.replan import RecoveryDecision, plan_fail_stop, plan_restore
from elaswave.engine.rules import Rules
from elaswave.fabric.errors import TooFewRanks, Unrecoverable

replace = dataclasses.replace


def slowdowns_on(s: State, ranks: Collection[int]) -> dict[int, float]:
    """The slowdowns measured on ``ranks`` (a slow rank that then failed is no input)."""
    return {x: f for x, f in s.slowdowns.items() if x in ranks}


def job_rebalancing(r: Rules, s: State, ranks: Collection[int]) -> Rebalancing:
    """The throughput planner's inputs for a plan of ``ranks``."""
    return replace(r.rebalancing, slowdowns=slowdowns_on(s, ranks))


def plan_next(
    r: Rules,
    s: State,
    c: Change,
    *,
    members: frozenset[int],
    failed: frozenset[int],
    attempt: int,
    waited_since: float | None,
    completed: Mapping[int, float],
    now: float,
    out: list[Action],
    shorten: bool = False,
) -> State:
    """``members`` have stopped, ``failed`` are lost: plan, and announce the attempt
    after ``attempt`` (-1: none was announced); or wait for joiners. ``shorten``: a
    wait ran out, and the pipeline may get fewer stages."""
    inputs = PlanInputs(
        failed=tuple(sorted(failed)),
        joined=c.joined,
        policy=r.rebalancing.policy,
        slowdowns=slowdowns_on(s, members | set(c.joined)),
        shorten=shorten,
    )
    restore = False
    try:
        try:
            decision = _plan(r, s, inputs, members)
        except TooFewRanks:
            raise  # no state is lost: wait for joiners, or stop
        except Unrecoverable as exc:  # state is lost: restore a checkpoint, or stop
            if not members and not c.joined and r.restore and (ready := ready_joiners(s)):
                # No member is left (the last died applying a plan that added these
                # joiners, which the roll-back returned to the waiting): they take the
                # checkpoint in this change.
                out.append(SharePlan(s.plan))
                c = replace(c, joined=tuple(ready), detail=f"{c.detail}; ranks {ready} join")
                return plan_next(
                    r, replace(s, joiners=frozenset()), c, members=members, failed=failed,
                    attempt=attempt, waited_since=waited_since, completed=completed, now=now,
                    out=out, shorten=shorten,
                )  # fmt: skip
            decision, restore = restored(r, s, inputs, members, exc), True
    except TooFewRanks as exc:
        if not members and not shorten:  # joiners alone do not wait (nothing of the job
            # is kept meanwhile, no one could write a checkpoint): fewer stages
            return plan_next(
                r, s, c, members=members, failed=failed, attempt=attempt,
                waited_since=waited_since, completed=completed, now=now, out=out, shorten=True,
            )  # fmt: skip
        if r.wait_for_nodes_s > 0:
            since = now if waited_since is None else waited_since
            waiting = Waiting(
                members=members, failed=failed, needed=exc.needed, step=exc.committed_step,
                since=since, attempt=attempt, completed=completed,
                deadline=since + r.wait_for_nodes_s,
            )  # fmt: skip
            return wait_for_nodes(r, s, c, waiting, exc, out)
        raise Stopped(
            f"unrecoverable: {c.detail}; {exc} (train with --wait-for-nodes SECONDS to wait "
            "for joining ranks instead)"
        ) from None
    except Unrecoverable as exc:
        raise Stopped(f"unrecoverable: {c.detail}; {exc}") from None
    attempt += 1
    stale: tuple[int, ...] = ()
    if restore:  # every layer's state is read from the checkpoint: none migrates
        migration = MigrationDecision(mode=MigrationMode.NONE, layers=())
    else:
        stale = tuple(
            sorted(x for x in members if s.reports[x].params_step != decision.committed_step)
        )
        migration = _migration(r, s, inputs, decision, stale)
    inputs = replace(inputs, stale=stale, migration=migration.mode)
    if attempt == 0:
        c = _started(s, c, inputs, decision, out)
    digest = plan_digest(decision.plan)
    rebuild = tuple(sorted({name for x in members for name in s.reports[x].tainted}))
    outcome = PlanOutcome(
        generation=c.generation + 1, attempt=attempt, kind=c.kind,
        committed_step=decision.committed_step, plan_digest=digest, reason=decision.reason,
        rebuild=rebuild, restore=restore, rollback=s.rolled_back,
    )  # fmt: skip
    out.append(Publish(announcement(inputs, outcome)))
    agreeing = Agreeing(
        members=members,
        failed=failed,
        attempt=attempt,
        digest=digest,
        plan=decision.plan,
        participants=members | set(c.joined),
        record=replace(
            _planned(c, inputs, decision, migration, attempt, waited_since, now),
            restored=restore,
        ),
        planned_at=now,
        completed=completed,
        waited_since=waited_since,
        deadline=now + r.ack_timeout_s,
    )
    return with_phase(s, c, agreeing)


def _plan(r: Rules, s: State, inputs: PlanInputs, members: frozenset[int]) -> RecoveryDecision:
    return plan_fail_stop(
        s.plan,
        list(inputs.failed),
        {x: s.reports[x].committed_step for x in members},
        newest={x: s.reports[x].newest for x in members},
        ranks_per_node=r.ranks_per_node,
        snapshots=r.snapshots,
        copies=r.snapshot_copies,
        rebalancing=rebalancing(inputs, r.rebalancing),
        joined=inputs.joined,
        floor=s.recoveries[-1].committed_step if s.recoveries else r.first_step,
    )


def restored(
    r: Rules, s: State, inputs: PlanInputs, members: frozenset[int], lost: Unrecoverable
) -> RecoveryDecision:
    """State is lost (``lost``): the decision that restores, inside the job, the newest
    complete disk checkpoint no newer than any member's committed step (with no member
    left, than the job's last completed step: the joiners take it); ``lost`` again when
    the job restores none, or no member survives and none joins."""
    if not r.restore or not (members or inputs.joined):
        raise lost
    oldest = min((s.reports[x].committed_step for x in members), default=s.done_step)
    usable = [x for x in s.checkpoints if x <= oldest]
    if not usable:
        raise Unrecoverable(f"{lost}; no complete checkpoint of step {oldest} or before to restore")
    rebalance = rebalancing(inputs, r.rebalancing)
    return plan_restore(s.plan, inputs.failed, max(usable), lost, rebalance, inputs.joined)


def _migration(
    r: Rules, s: State, inputs: PlanInputs, decision: RecoveryDecision, stale: tuple[int, ...]
) -> MigrationDecision:
    """How the change moves layers, decided once by the Core and announced."""
    reb = r.rebalancing
    assert reb.device is not None, "the rules carry the cost model's device"
    return decide_migration(
        r.migration,
        s.plan,
        decision.plan,
        stale=stale,
        joined=inputs.joined,
        layers=reb.layers,
        device=reb.device,
        early=r.migration_early,
    )


def _started(
    s: State, c: Change, inputs: PlanInputs, decision: RecoveryDecision, out: list[Action]
) -> Change:
    """The change's first attempt: announce RecoveryStarted; a failure's cause is its
    earliest kill (the workers' own record of it)."""
    origin = c.origin
    if c.kind is RecoveryKind.FAIL_STOP:
        killed = [s.killed_at[x] for x in inputs.failed if x in s.killed_at]
        origin = min(killed, default=c.seen_at)
    out.append(
        Publish(
            RecoveryStarted(
                sender=CORE_SENDER,
                generation=c.generation + 1,
                step=decision.committed_step + 1,
                kind=c.kind,
                ranks=_ranks(c, inputs),
                reason=decision.reason,
            )
        )
    )
    return replace(c, origin=origin)


def _ranks(c: Change, inputs: PlanInputs) -> list[int]:
    """The ranks the change is about: its own, and every failed one."""
    return sorted(set(c.ranks) | set(inputs.failed))


def _planned(
    c: Change,
    inputs: PlanInputs,
    decision: RecoveryDecision,
    migration: MigrationDecision,
    attempt: int,
    waited_since: float | None,
    now: float,
) -> PlannedRecovery:
    return PlannedRecovery(
        step=decision.committed_step + 1,
        kind=c.kind,
        ranks=tuple(_ranks(c, inputs)),
        generation=c.generation + 1,
        committed_step=decision.committed_step,
        reason=decision.reason,
        superseded=attempt,
        migration=MigrationRecord(decision=migration),
        plan=PlanSummary.of(decision.plan),
        joined=c.joined,
        waited_s=None if waited_since is None else now - waited_since,
    )


def wait_for_nodes(
    r: Rules, s: State, c: Change, p: Waiting, exc: TooFewRanks, out: list[Action]
) -> State:
    """Too few ranks are left for the stages: the stopped members keep their state and
    wait for joiners (``p``) until ``r.wait_for_nodes_s`` after the wait began (its
    deadline, at which :mod:`.waiting` asks for a checkpoint). Announced again whenever what is
    missing changes; the joiners the job schedules start at once (:func:`spawn_scheduled`)."""
    s = announce_wait(
        s, c, p, wait_s=r.wait_for_nodes_s, reason=f"{c.detail}; {exc}",
        note={"joined": list(c.joined)}, out=out,
    )  # fmt: skip
    return spawn_scheduled(r, s, c, exc.needed, out)


def announce_wait(
    s: State,
    c: Change,
    p: Waiting,
    *,
    wait_s: float,
    reason: str,
    note: dict[str, object],
    out: list[Action],
) -> State:
    """``s`` with change ``c`` waiting for joiners (``p``), announced (again):
    ``WaitingForNodes`` tells every stopped member to extend its wait by ``wait_s``."""
    out.append(Note("core.waiting_for_nodes", {"needed": p.needed, **note}))
    out.append(Publish(WaitingForNodes(
        sender=CORE_SENDER, generation=c.generation + 1, needed=p.needed, wait_s=wait_s,
        since=p.since, reason=reason,
    )))  # fmt: skip
    return with_phase(s, c, p)


def spawn_scheduled(r: Rules, s: State, c: Change, needed: int, out: list[Action]) -> State:
    """While the change waits for ``needed`` joiners: start the joiners the job
    schedules (``join@STEP``) at once, as many as are missing, for the steps they were
    due at cannot come while the job waits."""
    coming = s.alive - set(s.plan.ranks) - set(c.joined)  # started, not joining yet
    while len(coming) < needed and s.joins_done < len(r.join_steps) and r.can_spawn:
        s = spawn(r, replace(s, joins_done=s.joins_done + 1), out)
        coming = s.alive - set(s.plan.ranks) - set(c.joined)
    return s
