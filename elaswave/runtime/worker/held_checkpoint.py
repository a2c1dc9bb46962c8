"""A checkpoint written from memory when a wait for joiners runs out.

The Core's CheckpointRequest names, for every rank of the plan, who writes its shard at
the step every survivor rolls back to: the rank itself when it stopped at that step
or the next (its optimizer keeps the shard of the step before, for a one-step
rollback), else the holder of its host snapshot. Each part is
written as the periodic checkpoints are (:mod:`elaswave.fabric.checkpoint`: element
ranges of whole layers, under the owner's name, renamed into place; in a TP job each
member writes its own slices), so the union is a complete, layout-independent checkpoint
that ``--resume`` continues on any dp x pp (with the same tp).
"""

from __future__ import annotations

from elaswave.bus.schema import CheckpointRequest
from elaswave.fabric.adamw import ShardState
from elaswave.fabric.checkpoint import shard_pieces, write_pieces
from elaswave.fabric.layout import InterleavedLayout
from elaswave.runtime.worker.holders import owner_layout
from elaswave.runtime.worker.memento import Memento
from elaswave.runtime.worker.trainer import Trainer, WorkerContext


def write_part(
    ctx: WorkerContext,
    trainer: Trainer | None,
    request: CheckpointRequest,
    timeout_s: float,
    kept: Memento | None = None,
) -> list[int]:
    """Write the shards ``request`` gives this rank; returns their owners. From
    ``kept`` when the change rolls back (what the rank kept before a torn apply), else
    from ``trainer``."""
    mine = [o for o, w in zip(request.owners, request.writers, strict=True) if w == ctx.rank]
    for owner in mine:
        if kept is not None:
            plan, (layout, state) = kept.plan, _kept_shard(ctx, kept, owner, request, timeout_s)
        else:
            assert trainer is not None  # a rank that rolls back writes what it kept
            plan, (layout, state) = trainer.plan, _shard(ctx, trainer, owner, request, timeout_s)
        _, replica = plan.locate(owner)
        write_pieces(ctx.run_dir, request.step, owner, shard_pieces(layout, replica, state),
                     plan.generation, member=ctx.member, tp=ctx.cfg.layout.tp)  # fmt: skip
    return mine


def _shard(
    ctx: WorkerContext, trainer: Trainer, owner: int, request: CheckpointRequest, timeout_s: float
) -> tuple[InterleavedLayout, ShardState]:
    """``owner``'s shard at the request's step, from ``trainer``: its own optimizer's, or
    the snapshot it holds."""
    if owner != ctx.rank:
        (keeper,) = [k for k in trainer.keepers if k.owner == owner]
        return owner_layout(ctx.cfg, trainer.plan, owner)[0], keeper.wait(request.step, timeout_s)
    opt = trainer.optimizer
    if opt.committed_step == request.step:
        return opt.layout, opt.state
    if opt.committed_step == request.step + 1 and opt.previous is not None:
        return opt.layout, opt.previous  # kept for a one-step rollback
    raise RuntimeError(
        f"asked to checkpoint its own shard at step {request.step}, but rank "
        f"{ctx.rank} committed step {opt.committed_step} and keeps "
        f"{'the one before' if opt.previous is not None else 'no other'}"
    )


def _kept_shard(
    ctx: WorkerContext, kept: Memento, owner: int, request: CheckpointRequest, timeout_s: float
) -> tuple[InterleavedLayout, ShardState]:
    """``owner``'s shard at the request's step, from what this rank kept."""
    if kept.step != request.step:
        raise RuntimeError(
            f"asked to checkpoint step {request.step}, but rank {ctx.rank} kept step {kept.step}"
        )
    if owner != ctx.rank:
        return owner_layout(ctx.cfg, kept.plan, owner)[0], kept.snapshot(owner, timeout_s)
    if kept.layout is None or kept.state is None:
        raise RuntimeError(f"asked to checkpoint its own shard, but rank {ctx.rank} kept none")
    return kept.layout, kept.state
