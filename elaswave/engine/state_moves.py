"""Which optimizer shards move in a plan change: a pure planner every rank runs alike.

For each layer of a stage whose members or layers change, its old stage's shards (or,
for an owner that failed, the host snapshot its holder keeps) go to its new stage's
owners under the interleaved layout (:func:`elaswave.fabric.remap.plan_reshard`). Every
survivor and every joiner computes the same transfer list from the same two plans, so
each knows what to send and receive without asking.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from elaswave.engine.plan import Plan, snapshot_placement
from elaswave.fabric.remap import LayerShards, RemapPlan, plan_reshard


def changed_stages(old: Plan, new: Plan) -> set[int]:
    """Stages whose members or layers differ between the plans (all of them when the
    pipeline changes its number of stages)."""
    if old.pp != new.pp:
        return set(range(max(old.pp, new.pp)))
    return {
        a.stage
        for a, b in zip(old.stages, new.stages, strict=True)
        if a.ranks != b.ranks or a.layers != b.layers
    }


def plan_state_moves(
    old: Plan,
    new: Plan,
    failed: Collection[int],
    *,
    numels: Mapping[int, int],
    ranks_per_node: int,
    snapshots: bool,
    copies: int = 1,
) -> RemapPlan:
    """Every optimizer-shard transfer from ``old`` to ``new``. ``numels``: each layer's
    parameter count (every layer of the model); ``snapshots``: whether failed owners'
    shards have host snapshots (``copies`` of each, placed by ``ranks_per_node``) to be
    rebuilt from."""
    changed = changed_stages(old, new)
    placement = snapshot_placement(old, ranks_per_node, copies)
    holder_of = {o: placement.holders_of(o) for o in placement.holder} if snapshots else {}
    items = []
    for layer in sorted(numels):
        src = next(s for s in old.stages if layer in s.layers)
        dst = next(s for s in new.stages if layer in s.layers)
        if src.stage in changed or dst.stage in changed:
            items.append(LayerShards(layer, numels[layer], src.ranks, dst.ranks))
    return plan_reshard(items, failed=set(failed), holder_of=holder_of)
