"""The fail-stop planner: a pure function of (plan, failed ranks, survivors' commits).

It returns the next plan (micro-batch resizing over the survivors), the step every
survivor rolls back to (the oldest committed step: ranks are at most one step apart,
and each keeps one step of history), and a reason; or raises Unrecoverable naming the
state that is gone. Workers rerun :func:`next_plan` themselves and compare
:func:`plan_digest` with the Core's, so a plan is never shipped, only its inputs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from elaswave.engine.dataflow import resize_after_failure
from elaswave.engine.plan import Plan, snapshot_placements
from elaswave.fabric.errors import Unrecoverable
from elaswave.fabric.placement import SnapshotPlacement
from elaswave.fabric.remap import check_integrity


@dataclass(frozen=True)
class RecoveryDecision:
    plan: Plan
    failed: tuple[int, ...]
    committed_step: int
    reason: str


def plan_digest(plan: Plan) -> str:
    doc = json.dumps(dataclasses.asdict(plan), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


def next_plan(plan: Plan, failed: Collection[int]) -> tuple[Plan, str]:
    return resize_after_failure(plan, failed)


def plan_fail_stop(
    plan: Plan,
    failed: Collection[int],
    commits: Mapping[int, int],
    *,
    ranks_per_node: int,
    snapshots: bool,
) -> RecoveryDecision:
    failed = set(failed)
    survivors = set(plan.ranks) - failed
    missing = survivors - set(commits)
    if missing:
        raise ValueError(f"no committed step reported by surviving ranks {sorted(missing)}")
    steps = {commits[r] for r in survivors}
    if max(steps) - min(steps) > 1:
        raise Unrecoverable(f"survivors' committed steps {sorted(steps)} are more than one apart")
    new, reason = next_plan(plan, failed)
    placements = (
        snapshot_placements(plan, ranks_per_node)
        if snapshots
        else {s.stage: SnapshotPlacement({}, node_safe=False) for s in plan.stages}
    )
    for stage in plan.stages:
        if failed & set(stage.ranks):
            check_integrity(stage.ranks, failed, placements[stage.stage])
    committed = min(steps)
    return RecoveryDecision(
        new,
        tuple(sorted(failed)),
        committed,
        f"{reason}; every survivor resumes after step {committed}",
    )
