"""What a snapshot holder knows of the owners whose shards it keeps.

Snapshots live in another stage than their owner's (:func:`~elaswave.engine.plan.
snapshot_placement`), so a holder cannot read an owner's shard layout, decay mask or
initial state off its own optimizer: it derives them from the plan and the model
config, as the owner does. The layout comes from the owner's stage (its layers and
width), the decay mask from the layers' parameter shapes (cached per process),
and the state before the first step from the layers' seeded initialisation.
"""

from __future__ import annotations

import torch

from elaswave.engine.plan import Plan, snapshot_placement
from elaswave.fabric.adamw import ShardState
from elaswave.fabric.layout import InterleavedLayout
from elaswave.fabric.placement import SnapshotPlacement
from elaswave.model.protocol import pipeline_model
from elaswave.model.tensor_parallel import TpShard
from elaswave.runtime.job.config import JobConfig


def placement_of(cfg: JobConfig, plan: Plan) -> SnapshotPlacement:
    """Where the snapshots of ``plan``'s shards live, for this job (its nodes, its copies)."""
    return snapshot_placement(plan, cfg.layout.units_per_node, cfg.state.snapshot_copies)


def owner_layout(cfg: JobConfig, plan: Plan, owner: int) -> tuple[InterleavedLayout, int]:
    """The interleaved layout of ``owner``'s stage under ``plan``, and its replica."""
    stage, replica = plan.locate(owner)
    s = plan.stages[stage]
    numels = {c.index: c.params for c in cfg.layer_costs}
    return InterleavedLayout.build([(i, numels[i]) for i in s.layers], s.dp), replica


def owner_decay_mask(cfg: JobConfig, plan: Plan, owner: int) -> torch.Tensor:
    """1 where ``owner``'s shard elements take weight decay (matrices), else 0."""
    layout, replica = owner_layout(cfg, plan, owner)
    masks = [
        torch.cat(
            [
                torch.full((numel,), 1.0 if decays else 0.0)
                for numel, decays in pipeline_model(cfg.model).decay_flags(
                    item.layer, cfg.layout.tp
                )
            ]
        )
        for item in layout.layers
    ]
    return layout.shard_of(masks, replica)


def owner_initial_state(cfg: JobConfig, plan: Plan, owner: int, *, member: int = 0) -> ShardState:
    """``owner``'s shard before the first step: its layers' seeded initial parameters
    (TP piece ``member``, the holder's own: it keeps the owner's shard of its plane),
    zero moments."""
    layout, replica = owner_layout(cfg, plan, owner)
    with torch.no_grad():
        flats = [
            torch.cat(
                [
                    p.detach().float().reshape(-1)
                    for p in pipeline_model(cfg.model)
                    .build_layer(
                        item.layer, seed=cfg.schedule.seed, tp=TpShard(member, cfg.layout.tp)
                    )
                    .parameters()
                ]
            )
            for item in layout.layers
        ]
        master = layout.shard_of(flats, replica)
    decay = owner_decay_mask(cfg, plan, owner)
    return ShardState(master, torch.zeros_like(master), torch.zeros_like(master), decay)
