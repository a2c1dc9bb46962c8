"""A checkpoint written from memory when a wait for joiners runs out.

The Core's CheckpointRequest names, for every rank of the plan, who writes its shard at
the step every survivor rolls back to: the rank itself when it stopped at that step
or the next (its optimizer keeps the shard of the step before, for a one-step
rollback), else the holder of its host snapshot. Each part is
written as the periodic checkpoints are (:mod:`elaswave.fabric.checkpoint`: element
ranges of whole layers, under the owner's name, renamed into place), so the union is a
complete, layout-independent checkpoint that ``--resume`` continues on any layout.
"""

from __future__ import annotations

from elaswave.bus.schema import CheckpointRequest
from elaswave.fabric.checkpoint import shard_pieces, write_pieces
from elaswave.runtime.worker.holders import owner_layout
from elaswave.runtime.worker.trainer import Trainer, WorkerContext


def write_part(
    ctx: WorkerContext, trainer: Trainer, request: CheckpointRequest, timeout_s: float
) -> list[int]:
    """Write the shards ``request`` gives this rank; returns their owners."""
    mine = [o for o, w in zip(request.owners, request.writers, strict=True) if w == ctx.rank]
    for owner in mine:
        if owner == ctx.rank:
            opt = trainer.optimizer
            if opt.committed_step == request.step:
                state = opt.state
            elif opt.committed_step == request.step + 1 and opt.previous is not None:
                state = opt.previous  # kept for a one-step rollback
            else:
                raise RuntimeError(
                    f"asked to checkpoint its own shard at step {request.step}, but rank "
                    f"{ctx.rank} committed step {opt.committed_step} and keeps "
                    f"{'the one before' if opt.previous is not None else 'no other'}"
                )
            _, replica = trainer.plan.locate(ctx.rank)
            pieces = shard_pieces(opt.layout, replica, state)
        else:
            (keeper,) = [k for k in trainer.keepers if k.owner == owner]
            state = keeper.wait(request.step, timeout_s)
            layout, replica = owner_layout(ctx.cfg, trainer.plan, owner)
            pieces = shard_pieces(layout, replica, state)
        write_pieces(ctx.run_dir, request.step, owner, pieces, trainer.plan.generation)
    return mine
