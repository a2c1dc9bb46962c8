"""Dataflow planner (paper §4.1): micro-batch resizing after ranks leave.

A failed rank's share of every global micro-batch is sliced evenly over its stage's
surviving replicas, so DP x micro-batch size, the global batch and the gradient scale stay
unchanged and the pipeline keeps its schedule. Adjacent stages may then have different
DP widths; activations follow the plan's routes by sample offset (fan-in, fan-out).
When the survivors do not divide the micro-batch (3 samples over 2), the shares rotate
over them from one micro-batch to the next (:attr:`StagePlan.rotate`), so that no
replica runs the largest share every time (what that saves depends on the pipeline
around the stage: :func:`elaswave.engine.steptime.plan_step_time`).
Rotation has a price: two adjacent rotating stages run near their largest share (the
1F1B loop between them keeps meeting the same replica's larger share). The global
micro-batch can be *regrouped* instead (:func:`regroupings`, :func:`regroup`): the same
global batch in micro-batches of another size that every stage's width divides (3 samples
over 2 survivors and 3 replicas become 6 over both: 3 + 3 and 2 + 2 + 2, half as many
micro-batches). Every sample keeps its id, hence its data and dropout masks, and the
loss is still normalised by the global batch, so the gradient is the same; the throughput
planner keeps whichever grouping simulates fastest within memory.
The planner is a pure function of (plan, failed ranks) returning a plan and a reason.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

from elaswave.comm.spec import MAX_MICRO_BATCHES
from elaswave.data.sampler import even_split, spread_split
from elaswave.engine.plan import Plan, StagePlan
from elaswave.fabric.errors import Unrecoverable

__all__ = [
    "Unrecoverable",
    "add_ranks",
    "regroup",
    "regroupings",
    "resize_after_failure",
    "split_shares",
]


def split_shares(total: int, replicas: int, grain: int = 1) -> dict[str, Any]:
    """``sizes``, ``rotate`` and ``block`` of a stage whose ``replicas`` split ``total`` samples per
    micro-batch evenly, in whole blocks of ``grain`` samples (:attr:`Plan.grain`; a
    ``total`` that is not a whole number of them is split by samples): equal shares
    when they divide it, else shares one block apart, the larger spread out, rotating
    (any run of micro-batches then gives every replica within one block of its mean).
    Fewer blocks than replicas: some take none."""
    if total % grain:
        grain = 1
    units = total // grain
    if units % replicas == 0 or units < replicas:
        sizes, rotate = even_split(units, replicas), False
    else:
        sizes, rotate = spread_split(units, replicas), True
    return {"sizes": tuple(grain * n for n in sizes), "rotate": rotate, "block": 1}


def _describe(stage: StagePlan) -> str:
    if stage.rotate:
        return (
            f"{list(stage.sizes)} in rotation ({sum(stage.sizes) / stage.dp:.3g} each on average)"
        )
    return str(list(stage.sizes))


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
        shares = split_shares(total, len(survivors), plan.grain)
        shrunk = dataclasses.replace(stage, ranks=survivors, **shares)
        stages.append(shrunk)
        reasons.append(
            f"stage {stage.stage}: ranks {lost} failed; ranks {list(survivors)} now take "
            f"{_describe(shrunk)} of every {total}-sample micro-batch"
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
        shares = split_shares(sum(old.sizes), len(ranks), plan.grain)
        grown = dataclasses.replace(old, ranks=ranks, **shares)
        stages[stage] = grown
        reasons.append(f"rank {rank} joins stage {stage}, which now takes {_describe(grown)}")
    if not reasons:
        return plan, "no rank joined"
    new = dataclasses.replace(plan, generation=plan.generation + 1, stages=tuple(stages))
    return new, "; ".join(reasons)


def _even_over(samples: int, width: int, grain: int) -> bool:
    """Whether ``width`` replicas take ``samples`` (a whole number of blocks of
    ``grain``) without rotating (fewer blocks than replicas leave some idle)."""
    units, rest = divmod(samples, grain)
    return rest == 0 and (units % width == 0 or units < width)


def regroupings(plan: Plan, *, reach: int = 4) -> tuple[int, ...]:
    """Global micro-batch sizes, other than the plan's, under which no stage's shares
    rotate: the largest below the current size and the smallest above it (at most
    ``reach`` times it), among the divisors of the global batch that give at most
    :data:`~elaswave.comm.group.MAX_MICRO_BATCHES` micro-batches. Larger micro-batches
    hold more activations; the graph planner checks that they fit."""
    current = plan.global_batch // plan.num_micro_batches
    widths = {s.dp for s in plan.stages}
    floor = -(-plan.global_batch // MAX_MICRO_BATCHES)

    def fits(samples: int) -> bool:
        return plan.global_batch % samples == 0 and all(
            _even_over(samples, w, plan.grain) for w in widths
        )

    below = next((g for g in range(current - 1, floor - 1, -1) if fits(g)), None)
    above = next((g for g in range(current + 1, reach * current + 1) if fits(g)), None)
    return tuple(g for g in (below, above) if g is not None)


def regroup(plan: Plan, samples: int) -> tuple[Plan, str]:
    """``plan`` with global micro-batches of ``samples`` samples: the same global batch
    in ``global_batch / samples`` micro-batches, every stage's shares re-split evenly.
    The generation is the caller's to advance."""
    if samples < 1 or plan.global_batch % samples or samples % plan.grain:
        raise ValueError(
            f"micro-batches of {samples} samples: must be a positive divisor of the global "
            f"batch {plan.global_batch} and a multiple of the plan's grain {plan.grain}"
        )
    count = plan.global_batch // samples
    if count > MAX_MICRO_BATCHES:
        raise ValueError(
            f"micro-batches of {samples} samples: {count} per step, at most {MAX_MICRO_BATCHES}"
        )
    stages = tuple(
        dataclasses.replace(s, **split_shares(samples, s.dp, plan.grain)) for s in plan.stages
    )
    before = plan.global_batch // plan.num_micro_batches
    new = dataclasses.replace(plan, num_micro_batches=count, stages=stages)
    reason = (
        f"global micro-batches regrouped from {before} to {samples} samples "
        f"({plan.num_micro_batches} -> {count} per step): "
        + "; ".join(f"stage {s.stage} takes {_describe(s)}" for s in stages)
    )
    return new, reason
