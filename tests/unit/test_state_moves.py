"""Which optimizer shards move in a change (engine.state_moves): every element of every
changed stage's new shards comes from exactly one live source, never from a failed rank."""

from __future__ import annotations

import pytest

from elaswave.engine.plan import snapshot_placement
from elaswave.engine.rebalance import Policy
from elaswave.engine.recovery import Rebalancing, next_plan
from elaswave.engine.state_moves import changed_stages, plan_state_moves
from elaswave.fabric.errors import Unrecoverable
from elaswave.fabric.remap import Source
from elaswave.runtime.job.config import JobConfig
from elaswave.runtime.job.sections import LayoutConfig, ScheduleConfig

CFG = JobConfig(
    layout=LayoutConfig(dp=3, pp=2), schedule=ScheduleConfig(global_batch=12, micro_batch=2)
)
NUMELS = {c.index: c.params for c in CFG.layer_costs}


def _rebalancing() -> Rebalancing:
    return Rebalancing(policy=Policy.RESIZE, slowdowns={}, layers=CFG.layer_costs,
                       device=CFG.cost_device, power_budget=None)  # fmt: skip


def _coverage(moves, layer: int) -> list[tuple[int, int, int]]:
    return sorted((t.dst, t.lo, t.hi) for t in moves.transfers if t.layer == layer)


@pytest.mark.parametrize(("failed", "joined"), [([1], []), ([4], [6]), ([1, 3], []), ([], [6])])
def test_every_new_shard_is_filled_once_from_a_live_source(failed, joined):
    old = CFG.plan()
    new, _ = next_plan(old, failed, _rebalancing(), joined=joined)
    moves = plan_state_moves(old, new, failed, numels=NUMELS, ranks_per_node=1, snapshots=True)
    assert not {t.src for t in moves.transfers} & set(failed), "a failed rank cannot send"
    holders = snapshot_placement(old, 1).holder
    for t in moves.transfers:
        if t.owner in failed:
            assert t.kind is Source.HOST and t.src == holders[t.owner], t
    for stage in changed_stages(old, new):
        ranks = new.stages[stage].ranks
        for layer in new.stages[stage].layers:
            per_rank: dict[int, int] = {}
            for dst, lo, hi in _coverage(moves, layer):
                per_rank[dst] = per_rank.get(dst, 0) + hi - lo
            # Interleaved layout: each owner holds 1/dp of the layer (rounded up).
            share = -(-NUMELS[layer] // len(ranks))
            assert set(per_rank) == set(ranks), (layer, per_rank)
            assert sum(per_rank.values()) == NUMELS[layer], (layer, per_rank)
            assert all(n <= share for n in per_rank.values()), (layer, per_rank, share)


@pytest.mark.parametrize(("failed", "snapshots"), [([1], False), ([0, 3], True)])
def test_a_shard_with_no_copy_left_is_named_lost(failed, snapshots):
    """Without snapshots a failed owner's shard is gone; with them, so is one whose
    owner and holder both failed (rank 3's snapshot is on rank 0, in the other stage)."""
    old = CFG.plan()
    new, _ = next_plan(old, failed, _rebalancing())
    with pytest.raises(Unrecoverable, match="optimizer state lost"):
        plan_state_moves(old, new, failed, numels=NUMELS, ranks_per_node=1, snapshots=snapshots)
