"""The plan change every runtime process computes alike (pure).

:func:`replan` is the planner a running job applies: :func:`~elaswave.engine.recovery.
next_plan` while every stage keeps a rank, unless a pipeline of another number of
stages prices lower (:func:`~elaswave.engine.reshape.reformed`: one that lost stages
grows back when joiners come; with ``Rebalancing.reform``, damaged replicas become
fewer, full stages); when failures empty a stage, ranks change
stage (:func:`~elaswave.engine.reshape.reshape`: a survivor of a wider stage takes the
emptied stage's layers, rebuilt from the host snapshots that
:func:`~elaswave.engine.plan.snapshot_placement` keeps in other stages). The pipeline
keeps its number of stages while the ranks can fill them. With fewer ranks than stages
it gets fewer stages (``Rebalancing.shorten``: the job does not wait for joiners; every
shorter pipeline that fits in memory is priced), or the change raises
:class:`~elaswave.fabric.errors.TooFewRanks` for a job that waits, once no state is
found lost.
Every process of the job reruns it before it acknowledges the plan, so it prices only
the first assignment (``search=False``: the best donor for each emptied stage), not
every vector of widths as the simulator does.

:func:`plan_fail_stop` adds what a recovery needs besides the plan: the step every
survivor rolls back to (the oldest committed step: ranks are at most one step apart,
and each keeps one step of history), the integrity check of the failed ranks' state,
and a reason; or it raises Unrecoverable naming the state that is gone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from elaswave.engine.plan import Plan, snapshot_placement
from elaswave.engine.recovery import Rebalancing, next_plan, with_schedule
from elaswave.engine.reshape import reformed, reshape
from elaswave.fabric.errors import TooFewRanks, Unrecoverable
from elaswave.fabric.placement import SnapshotPlacement
from elaswave.fabric.remap import check_integrity


@dataclass(frozen=True)
class RecoveryDecision:
    plan: Plan
    failed: tuple[int, ...]
    committed_step: int
    reason: str


def emptied_stages(plan: Plan, failed: Collection[int]) -> list[int]:
    """Stages of ``plan`` that ``failed`` leave without a rank."""
    return [s.stage for s in plan.stages if not set(s.ranks) - set(failed)]


def replan(
    plan: Plan,
    failed: Collection[int],
    rebalancing: Rebalancing | None = None,
    joined: Sequence[int] = (),
) -> tuple[Plan, str]:
    """The plan after ``failed`` leave and ``joined`` arrive (see the module docstring)."""
    emptied = emptied_stages(plan, failed)
    if not emptied or rebalancing is None or rebalancing.device is None:
        return _kept_or_reformed(plan, failed, rebalancing, joined)
    left = len(set(plan.ranks) - set(failed)) + len(joined)
    lost = ", ".join(
        f"stage {k} (layers {plan.stages[k].layer_start}-{plan.stages[k].layer_stop - 1}) "
        f"lost all its ranks {list(plan.stages[k].ranks)}"
        for k in emptied
    )
    if left < plan.pp and not rebalancing.shorten:
        raise TooFewRanks(
            f"{lost}, and {left} ranks are left for a pipeline of {plan.pp} stages: every "
            "stage needs a rank (this job waits for joiners rather than shortening the "
            "pipeline)",
            needed=plan.pp - left,
        )
    shaped = reshape(
        plan, failed, joined, rebalancing=rebalancing,
        max_stages=max(plan.pp, rebalancing.stages or plan.pp), search=False,
    )  # fmt: skip
    chosen = with_schedule(shaped.plan, rebalancing)
    if chosen.schedule is not shaped.plan.schedule:
        return chosen, f"{lost}; {shaped.reason}; schedule {chosen.schedule} (simulated faster)"
    return chosen, f"{lost}; {shaped.reason}"


def _kept_or_reformed(
    plan: Plan, failed: Collection[int], rebalancing: Rebalancing | None, joined: Sequence[int]
) -> tuple[Plan, str]:
    """:func:`next_plan`, or a pipeline of another number of stages that prices lower
    (:func:`~elaswave.engine.reshape.reformed`)."""
    kept, reason = next_plan(plan, failed, rebalancing, joined=joined)
    if rebalancing is None:
        return kept, reason
    other = reformed(plan, failed, joined, kept=kept, rebalancing=rebalancing)
    if other is None:
        return kept, reason
    chosen = with_schedule(other.plan, rebalancing)
    moved = ", ".join(f"{r}: {a} -> {b}" for r, a, b in other.moved)
    why = f"{other.reason} (ranks change stage: {moved}), priced lower than keeping {plan.pp}"
    if chosen.schedule is not other.plan.schedule:
        why = f"{why}; schedule {chosen.schedule} (simulated faster)"
    return chosen, why


def plan_restore(
    plan: Plan,
    failed: Collection[int],
    step: int,
    lost: Unrecoverable,
    rebalancing: Rebalancing | None = None,
    joined: Sequence[int] = (),
) -> RecoveryDecision:
    """The decision when :func:`plan_fail_stop` finds state lost (``lost``) and the job
    restores the disk checkpoint of ``step`` inside its running processes: the plan the
    survivors and ``joined`` form (every layer's state read from the checkpoint, so a
    stage lost whole is taken over as from snapshots). TooFewRanks when the ranks
    cannot fill the stages."""
    new, reason = replan(plan, failed, rebalancing, joined=joined)
    why = f"{lost}; restored from the checkpoint of step {step} inside the job; {reason}"
    return _decision(plan, new, failed, step, f"{why}; every rank resumes after step {step}")


def advanced(plan: Plan, new: Plan) -> Plan:
    """``new``, the plan a change from ``plan`` leads to, in the generation after
    ``plan``'s even when nothing changed (the joiners it was for are gone, say): the
    members are stopped all the same, and every change advances it. The Core, every
    worker and replay number a plan so."""
    if new.generation == plan.generation:
        return dataclasses.replace(new, generation=plan.generation + 1)
    return new


def _decision(
    plan: Plan, new: Plan, failed: Collection[int], committed: int, reason: str
) -> RecoveryDecision:
    """The change from ``plan`` to ``new`` (:func:`advanced`)."""
    return RecoveryDecision(advanced(plan, new), tuple(sorted(failed)), committed, reason)


def plan_fail_stop(
    plan: Plan,
    failed: Collection[int],
    commits: Mapping[int, int],
    *,
    ranks_per_node: int,
    snapshots: bool,
    copies: int = 1,
    rebalancing: Rebalancing | None = None,
    joined: Sequence[int] = (),
    floor: int = -1,
    newest: Mapping[int, int] | None = None,
) -> RecoveryDecision:
    """The decision for ``plan`` after ``failed`` leave and ``joined`` arrive, given each
    survivor's committed step (``commits``). ``floor``: the step no survivor can roll
    back before (the committed step of the change that made ``plan``, or the step a
    resumed job started after). ``newest``: a survivor's newest committed step when it
    is newer than its ``commits`` entry (a TP group whose members stopped a step apart:
    it holds only its ``commits`` step, the one before its newest); default ``commits``.

    Survivors roll back to the oldest committed step among them. A stage that lost every
    rank may have stopped a step behind them (it died before its optimizer step while
    the others finished theirs), and the loss of a step is known only to the last stage:
    then every survivor rolls back to the oldest step all of them hold (one before the
    newest, not before ``floor``), which the lost stage's snapshots also hold, and the
    new pipeline redoes the step after it.

    Raises Unrecoverable naming the state that is gone; TooFewRanks when none is but
    fewer ranks than stages are left.
    """
    failed = set(failed)
    survivors = set(plan.ranks) - failed
    missing = survivors - set(commits)
    if missing:
        raise ValueError(f"no committed step reported by surviving ranks {sorted(missing)}")
    steps = {commits[r] for r in survivors}
    tops = {max(commits[r], (newest or {}).get(r, commits[r])) for r in survivors}
    if steps and max(tops) - min(steps) > 1:
        raise Unrecoverable(
            f"survivors' committed steps {sorted(steps | tops)} are more than one apart"
        )
    too_few: TooFewRanks | None = None
    if snapshots:
        try:
            new, reason = replan(plan, failed, rebalancing, joined=joined)
        except TooFewRanks as exc:  # raised once no state is found lost (below)
            too_few, new, reason = exc, plan, ""
        placement = snapshot_placement(plan, ranks_per_node, copies)
    else:  # no copy of a failed rank's state exists: an emptied stage is lost
        new, reason = next_plan(plan, failed, rebalancing, joined=joined)
        placement = SnapshotPlacement({}, node_safe=False)
    lost = []
    for stage in plan.stages:  # every stage's lost shards are named, not the first's only
        if failed & set(stage.ranks):
            try:
                check_integrity(stage.ranks, failed, placement)
            except Unrecoverable as exc:
                lost.append(str(exc))
    if lost:
        raise Unrecoverable("; ".join(lost))
    if not steps:
        raise Unrecoverable(f"ranks {sorted(failed)} failed: no rank of the plan survives")
    committed = min(steps)
    if snapshots and emptied_stages(plan, failed):
        committed = max(max(tops) - 1, min(floor, committed))
    if too_few is not None:
        raise TooFewRanks(str(too_few), too_few.needed, committed_step=committed)
    return _decision(
        plan, new, failed, committed, f"{reason}; every survivor resumes after step {committed}"
    )
