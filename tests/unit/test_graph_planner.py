import dataclasses
import itertools
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elaswave.data.sampler import even_split
from elaswave.engine.cost import DEVICES, StageSpec, layer_costs
from elaswave.engine.graph import Infeasible, Partition, minimax_partition, plan_layers
from elaswave.model.config import LLAMA2_13B, TINY

pytestmark = pytest.mark.timeout(120)


def brute_force(times, memory, caps):
    """(optimum, boundaries) over every composition, lexicographically first on ties."""
    num_stages, num_layers = times.shape[0], times.shape[1] - 1
    best = None
    for cuts in itertools.combinations(range(1, num_layers), num_stages - 1):
        bounds = (0, *cuts, num_layers)
        spans = list(itertools.pairwise(bounds))
        if any(memory[p, a, b] > caps[p] for p, (a, b) in enumerate(spans)):
            continue
        worst = max(times[p, a, b] for p, (a, b) in enumerate(spans))
        if best is None or worst < best[0]:
            best = (worst, bounds)
    return best


def random_instance(seed, num_stages, num_layers, structured, levels):
    """Tables for the brute-force comparison; ``levels`` > 0 draws times from few values.

    Structured tables are prefix sums of per-layer costs, like real cost tables;
    arbitrary tables are independent per segment, with junk below the diagonal that the
    planner must ignore. Minimax has ties even with distinct values (the bottleneck
    often belongs to one stage while others vary), so both kinds exercise the tie-break.
    """
    rng = np.random.default_rng(seed)
    shape = (num_stages, num_layers + 1, num_layers + 1)
    if structured:

        def segments(weights):
            prefix = np.concatenate((np.zeros((num_stages, 1)), weights.cumsum(axis=1)), axis=1)
            return prefix[:, None, :] - prefix[:, :, None]

        weights = rng.integers(1, levels + 1, (num_stages, num_layers)) if levels else None
        if weights is None:
            weights = rng.uniform(0.01, 10.0, (num_stages, num_layers))
        times = segments(weights.astype(float))
        memory = segments(rng.integers(1, 4, (num_stages, num_layers)).astype(float))
        caps = rng.integers(2, 4 * num_layers // num_stages + 4, num_stages)
    else:
        if levels:
            times = rng.integers(1, levels + 1, shape).astype(float)
        else:
            times = rng.uniform(0.01, 100.0, shape)
        memory = rng.integers(1, 11, shape).astype(float)
        caps = rng.integers(5, 11, num_stages)
    return times, memory, [float(c) for c in caps]


@st.composite
def instances(draw):
    num_stages = draw(st.integers(1, 4))
    num_layers = draw(st.integers(num_stages, 8))
    return random_instance(
        draw(st.integers(0, 2**32 - 1)),
        num_stages,
        num_layers,
        draw(st.booleans()),
        draw(st.sampled_from([0, 2, 3])),
    )


@settings(max_examples=200, deadline=None)
@given(instances())
def test_minimax_matches_brute_force(instance):
    times, memory, caps = instance
    expected = brute_force(times, memory, caps)
    if expected is None:
        with pytest.raises(Infeasible, match="stage"):
            minimax_partition(times, memory, caps)
        return
    got = minimax_partition(times, memory, caps)
    num_stages, num_layers = times.shape[0], times.shape[1] - 1
    assert got.bottleneck_s == expected[0]
    assert got.boundaries == expected[1]
    assert len(got.counts) == num_stages and sum(got.counts) == num_layers
    assert min(got.counts) >= 1
    spans = list(itertools.pairwise(got.boundaries))
    assert got.counts == tuple(b - a for a, b in spans)
    assert got.stage_times == tuple(times[p, a, b] for p, (a, b) in enumerate(spans))
    assert all(memory[p, a, b] <= caps[p] for p, (a, b) in enumerate(spans))
    assert got.reason.startswith(f"stage {got.bottleneck_stage} ")


def test_the_tie_break_is_not_the_plain_argmin_backtrack():
    # Stage 2 must start at layer 3 and costs 10 there: that is the optimum. Backtracking
    # through each state's own best split would then give stage 1 the split that is best
    # for [0, 3) (boundary 2, worst 1); any split within 10 is optimal, and the smallest
    # boundary is 1.
    times = np.full((3, 6, 6), 100.0)
    times[0, 0, 1] = times[0, 0, 2] = 1.0
    times[1, 1, 3], times[1, 2, 3] = 5.0, 1.0
    times[2, 3, 5] = 10.0
    got = minimax_partition(times, np.zeros_like(times), [1.0] * 3)
    assert got.bottleneck_s == 10.0
    assert got.boundaries == (0, 1, 3, 5)


def test_ties_go_to_the_lexicographically_smallest_boundaries():
    times = np.ones((3, 7, 7))
    memory = np.zeros((3, 7, 7))
    got = minimax_partition(times, memory, [1.0] * 3)
    assert got.boundaries == (0, 1, 2, 6)
    assert got.counts == (1, 1, 4)
    assert "tied with stages 1, 2" in got.reason


def test_a_stage_that_cannot_hold_any_layer_is_named_with_its_need():
    memory = np.full((2, 4, 4), 5.0 * 2**30)
    memory[0] = 1.0
    with pytest.raises(Infeasible, match=r"stage 1 cannot hold any layer.*needs 5 GiB, cap 4 GiB"):
        minimax_partition(np.ones((2, 4, 4)), memory, [1.0, 4.0 * 2**30])


def test_stages_that_fit_alone_but_not_together_show_the_closest_partition():
    # Memory grows with the segment length; each stage fits one layer, four need two.
    lengths = np.arange(5)[None, :] - np.arange(5)[:, None]
    memory = np.broadcast_to(lengths * 2.0**20, (2, 5, 5)).astype(float)
    with pytest.raises(Infeasible, match=r"closest, \[2, 2\].*stage 0 needs 2 MiB for layers 0-1"):
        minimax_partition(np.ones((2, 5, 5)), memory, [2.0**20, 2.0**20])


@pytest.mark.parametrize(
    ("shape", "caps", "message"),
    [
        ((2, 4, 4), [1.0], "1 memory caps for 2 stages"),
        ((3, 3, 3), [1.0] * 3, "at least as many layers"),
        ((2, 4, 5), [1.0] * 2, r"\[P, L\+1, L\+1\]"),
        ((2, 4, 4), [1.0, 0.0], "must be positive"),
    ],
)
def test_malformed_inputs_are_rejected(shape, caps, message):
    with pytest.raises(ValueError, match=message):
        minimax_partition(np.ones(shape), np.zeros(shape), caps)


def test_nan_in_a_segment_is_rejected():
    times = np.ones((1, 3, 3))
    times[0, 0, 2] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        minimax_partition(times, np.zeros((1, 3, 3)), [1.0])


ASCEND = DEVICES["ascend-910b"]
LLAMA = layer_costs(LLAMA2_13B, tp=4)


def _stages(num_stages: int, dp: int, micro_batch: int) -> list[StageSpec]:
    spec = StageSpec(
        dp=dp, micro_batch=micro_batch, mhz=ASCEND.base_mhz, memory_cap_bytes=ASCEND.memory_bytes
    )
    return [spec] * num_stages


def test_homogeneous_stages_split_the_blocks_evenly():
    got = plan_layers(LLAMA, _stages(4, dp=4, micro_batch=2), ASCEND, num_micro_batches=64)
    # The embedding is nearly free and the head costs about half a block here,
    # so the blocks themselves are spread within one of each other.
    blocks = [c - (p == 0) - (p == 3) for p, c in enumerate(got.counts)]
    assert max(blocks) - min(blocks) <= 1
    assert sum(got.counts) == LLAMA2_13B.num_layers


def test_a_slower_stage_gets_fewer_layers():
    stages = _stages(4, dp=4, micro_batch=2)
    base = plan_layers(LLAMA, stages, ASCEND, num_micro_batches=64)
    stages[1] = dataclasses.replace(stages[1], slowdown=2.0)
    slow = plan_layers(LLAMA, stages, ASCEND, num_micro_batches=64)
    assert slow.counts[1] < base.counts[1]
    assert all(slow.counts[p] >= base.counts[p] for p in (0, 2, 3))
    assert slow.bottleneck_s > base.bottleneck_s
    assert slow.reason.startswith("stage 1 ") and "slowdown 2x" in slow.reason


def test_a_stage_resized_after_a_failure_gets_fewer_layers():
    stages = _stages(4, dp=4, micro_batch=2)
    base = plan_layers(LLAMA, stages, ASCEND, num_micro_batches=64)
    # One of stage 2's four replicas fails: its 8-sample share is re-split over three.
    survivors = even_split(8, 3)
    stages[2] = dataclasses.replace(stages[2], dp=3, micro_batch=max(survivors))
    resized = plan_layers(LLAMA, stages, ASCEND, num_micro_batches=64)
    assert resized.counts[2] < base.counts[2]
    # Without repartitioning, stage 2 would run 1.5x the samples on its old layers.
    assert resized.bottleneck_s < 1.5 * base.bottleneck_s


def test_a_tight_memory_cap_moves_layers_off_a_stage():
    stages = _stages(4, dp=4, micro_batch=2)
    base = plan_layers(LLAMA, stages, ASCEND, num_micro_batches=64)
    cap = base.stage_memory[0] * 0.8
    stages[0] = dataclasses.replace(stages[0], memory_cap_bytes=cap)
    capped = plan_layers(LLAMA, stages, ASCEND, num_micro_batches=64)
    assert capped.counts[0] < base.counts[0]
    assert capped.stage_memory[0] <= cap
    assert capped.bottleneck_s >= base.bottleneck_s


def test_the_emulated_tiny_pipeline_moves_a_block_off_a_slow_stage():
    emulated = DEVICES["emulated"]
    layers = layer_costs(TINY, dtype_bytes=4)
    spec = StageSpec(dp=1, micro_batch=2, mhz=1400.0, memory_cap_bytes=emulated.memory_bytes)
    even = plan_layers(layers, [spec, spec], emulated)
    assert even.counts == (3, 3)
    slow = plan_layers(layers, [spec, dataclasses.replace(spec, slowdown=2.0)], emulated)
    assert slow.counts == (4, 2)
    assert "bottleneck" in slow.reason and "slowdown" in slow.reason


def _timed(fn, repeats=5) -> float:
    elapsed = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        elapsed.append(time.perf_counter() - start)
    return sorted(elapsed)[repeats // 2]


def test_planner_is_fast_for_96_layers_on_16_stages():
    rng = np.random.default_rng(1)
    num_stages, num_layers = 16, 96
    shape = (num_stages, num_layers + 1, num_layers + 1)
    lengths = np.maximum(np.arange(num_layers + 1)[None, :] - np.arange(num_layers + 1)[:, None], 0)
    times = lengths * rng.uniform(0.5, 2.0, (num_stages, 1, 1)) + rng.uniform(0, 0.1, shape)
    memory = lengths * rng.uniform(1.0, 2.0, (num_stages, 1, 1))
    caps = [12.0] * num_stages
    got = minimax_partition(times, memory, caps)
    assert isinstance(got, Partition) and sum(got.counts) == num_layers
    assert _timed(lambda: minimax_partition(times, memory, caps)) < 0.05
