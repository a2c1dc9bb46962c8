"""The non-blocking migration planner: moves, streams, paybacks, early micro-batches."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elaswave.engine.cost import LayerKind, device, layer_costs
from elaswave.engine.migration import layer_moves, plan_transition, why_blocking
from elaswave.engine.plan import Plan, initial_plan
from elaswave.engine.rebalance import Policy
from elaswave.engine.recovery import Rebalancing, next_plan
from elaswave.model.config import ModelConfig

pytestmark = pytest.mark.timeout(120)

MODEL = ModelConfig(num_blocks=14)  # 16 layers
LAYERS = layer_costs(MODEL, dtype_bytes=4)
EMULATED = device("emulated")


def _plan(counts=None) -> Plan:
    return initial_plan(
        num_layers=16, dp=4, pp=4, global_batch=64, micro_batch=2, layer_counts=counts
    )


def _kill(plan: Plan, rank: int) -> Plan:
    new, _ = next_plan(
        plan, [rank], Rebalancing(policy=Policy.MIGRATE, layers=LAYERS, device=EMULATED)
    )
    return new


def test_a_kill_with_migration_moves_layers_off_the_resized_stage():
    old = _plan()
    new = _kill(old, 5)
    moves = layer_moves(old, new)
    assert moves, "the migrate policy should move a layer off stage 1"
    assert len(new.stages[1].layers) < len(old.stages[1].layers)
    for m in moves:
        assert m.layer in old.stages[m.src].layers and m.layer in new.stages[m.dst].layers


def test_streams_reach_every_target_replica_and_paybacks_leave_every_source_once():
    old = _plan()
    new = _kill(old, 5)
    t = plan_transition(old, new, layers=LAYERS, device=EMULATED, early=2)
    assert t is not None
    for m in t.moves:
        streams = [s for s in t.streams if s.layer == m.layer]
        assert sorted(s.dst for s in streams) == sorted(new.stages[m.dst].ranks)
        assert {s.src for s in streams} <= set(new.stages[m.src].ranks)
        paybacks = [p for p in t.paybacks if p.layer == m.layer]
        assert Counter(p.src for p in paybacks) == Counter(new.stages[m.src].ranks)
        assert {p.dst for p in paybacks} <= set(new.stages[m.dst].ranks)
    assert t.early == 2
    assert len(t.paybacks) == sum(new.stages[m.src].dp for m in t.moves)


def test_no_shadow_runs_when_the_streams_arrive_before_they_are_needed():
    old = _plan()
    new = _kill(old, 5)
    t = plan_transition(old, new, layers=LAYERS, device=EMULATED)
    assert t is not None and t.early == 0 and t.paybacks == ()
    # A link 100x slower: the stream to the first stage outlasts its first forwards.
    slow_link = dataclasses.replace(EMULATED, p2p_bytes_per_s=EMULATED.p2p_bytes_per_s / 100)
    slow = plan_transition(old, new, layers=LAYERS, device=slow_link)
    assert slow is not None and slow.early >= 1 and slow.paybacks
    with pytest.raises(ValueError, match="early = -1"):
        plan_transition(old, new, layers=LAYERS, device=EMULATED, early=-1)


PARTITIONS = st.sets(st.integers(1, 15), min_size=3, max_size=3).map(
    lambda cuts: [b - a for a, b in zip([0, *sorted(cuts)], [*sorted(cuts), 16], strict=True)]
)


@given(PARTITIONS, PARTITIONS)
def test_any_repartition_is_a_set_of_moves_with_consistent_routes(a, b):
    old, new = _plan(a), _plan(b)
    moves = layer_moves(old, new)
    assert len(moves) == sum(
        1 for s, n in zip(old.stages, new.stages, strict=True) for i in s.layers
        if i not in n.layers
    )  # fmt: skip
    t = plan_transition(old, new, layers=LAYERS, device=EMULATED, early=1)
    if not moves:
        assert t is None
        return
    assert t is not None
    for m in moves:
        assert Counter(p.src for p in t.paybacks if p.layer == m.layer) == Counter(
            new.stages[m.src].ranks
        )
        assert len([s for s in t.streams if s.layer == m.layer]) == new.stages[m.dst].dp


def test_early_micro_batches_grow_with_the_stream_time():
    old = _plan()
    new = _kill(old, 5)
    fast = plan_transition(old, new, layers=LAYERS, device=EMULATED)
    slow_link = dataclasses.replace(EMULATED, p2p_bytes_per_s=EMULATED.p2p_bytes_per_s / 8)
    slow = plan_transition(old, new, layers=LAYERS, device=slow_link)
    assert fast is not None and slow is not None
    assert fast.early <= slow.early <= new.num_micro_batches
    assert slow.early >= fast.early


def test_when_a_migration_must_block():
    old = _plan()
    new = _kill(old, 5)
    kw = {"layers": LAYERS}
    assert why_blocking("nonblocking", old, new, **kw) is None
    assert why_blocking("blocking", old, new, **kw) == "blocking migration was asked for"
    assert "ranks [3] hold parameters newer" in why_blocking(
        "nonblocking", old, new, stale=[3], **kw
    )
    assert "ranks [16] join" in why_blocking("nonblocking", old, new, joined=[16], **kw)
    # Only blocks can sit at a stage boundary; the guard holds for any cost model.
    moves = _plan([4, 4, 4, 4]), _plan([4, 4, 5, 3])
    odd = [dataclasses.replace(c, kind=LayerKind.HEAD) if c.index == 12 else c for c in LAYERS]
    assert why_blocking("nonblocking", *moves, layers=odd) == "layer 12 is not a transformer block"
    assert why_blocking("nonblocking", *moves, **kw) is None
    wide = (
        initial_plan(num_layers=16, dp=600, pp=2, global_batch=1200, micro_batch=2),
        initial_plan(
            num_layers=16, dp=600, pp=2, global_batch=1200, micro_batch=2, layer_counts=[6, 10]
        ),
    )
    assert "1200 streams or paybacks exceed the 1024 tags" in why_blocking(
        "nonblocking", *wide, **kw
    )
    with pytest.raises(ValueError, match="unknown migration mode 'lazy'"):
        why_blocking("lazy", old, new, **kw)
