"""Dataflow planner (paper §4.1): micro-batch resizing after ranks leave.

A failed rank's share of every global micro-batch is sliced evenly over its stage's
surviving replicas, so DP x micro-batch size, the global batch and the gradient scale stay
unchanged and the pipeline keeps its schedule. Adjacent stages may then have different
DP widths; activations follow the plan's routes by sample offset (fan-in, fan-out).
The planner is a pure function of (plan, failed ranks) returning a plan and a reason.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping

from elaswave.data.sampler import even_split
from elaswave.engine.plan import Plan
from elaswave.fabric.errors import Unrecoverable

__all__ = ["Unrecoverable", "add_ranks", "resize_after_failure"]


def resize_after_failure(plan: Plan, failed: Collection[int]) -> tuple[Plan, str]:
    """The next plan without ``failed``: every stage's shares re-split over its survivors."""
    failed = set(failed)
    unknown = failed - set(plan.ranks)
    if unknown:
        raise ValueError(f"ranks {sorted(unknown)} are not in plan generation {plan.generation}")
    stages, reasons = [], []
    for stage in plan.stages:
        lost = [r for r in stage.ranks if r in failed]
        if not lost:
            stages.append(stage)
            continue
        survivors = tuple(r for r in stage.ranks if r not in failed)
        if not survivors:
            raise Unrecoverable(
                f"stage {stage.stage} (layers {stage.layer_start}-{stage.layer_stop - 1}) lost "
                f"all its ranks {list(stage.ranks)}: no replica holds its layers"
            )
        total = sum(stage.sizes)
        sizes = even_split(total, len(survivors))
        stages.append(dataclasses.replace(stage, ranks=survivors, sizes=sizes))
        reasons.append(
            f"stage {stage.stage}: ranks {lost} failed; ranks {list(survivors)} now take "
            f"{list(sizes)} of every {total}-sample micro-batch"
        )
    if not reasons:
        return plan, "no rank of the plan failed"
    new = dataclasses.replace(plan, generation=plan.generation + 1, stages=tuple(stages))
    return new, "; ".join(reasons)


def add_ranks(plan: Plan, placement: Mapping[int, int]) -> tuple[Plan, str]:
    """The plan with each new rank of ``placement`` (rank -> stage) appended to its
    stage's replicas; that stage's shares are re-split evenly (same global batch)."""
    known = set(plan.ranks) & set(placement)
    if known:
        raise ValueError(f"ranks {sorted(known)} are already in plan generation {plan.generation}")
    stages, reasons = list(plan.stages), []
    for rank, stage in sorted(placement.items()):
        if not 0 <= stage < plan.pp:
            raise ValueError(f"rank {rank}: stage {stage} is not in 0..{plan.pp - 1}")
        old = stages[stage]
        ranks = (*old.ranks, rank)
        sizes = even_split(sum(old.sizes), len(ranks))
        stages[stage] = dataclasses.replace(old, ranks=ranks, sizes=sizes)
        reasons.append(f"rank {rank} joins stage {stage}, which now takes {list(sizes)}")
    if not reasons:
        return plan, "no rank joined"
    new = dataclasses.replace(plan, generation=plan.generation + 1, stages=tuple(stages))
    return new, "; ".join(reasons)
