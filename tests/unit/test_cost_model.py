import dataclasses
import math
import re
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elaswave.data.sampler import even_split
from elaswave.engine.cost import (
    DEVICES,
    LayerCost,
    LayerKind,
    StageSpec,
    compute_time,
    device,
    fan_out,
    in_flight,
    layer_costs,
    ministep_time,
    p2p_time,
    ring_allreduce_time,
    segment_tables,
    stage_memory,
    stage_p2p_time,
)
from elaswave.engine.plan import Plan, StagePlan
from elaswave.engine.schedule import max_in_flight, one_f_one_b
from elaswave.model.config import LLAMA2_7B, LLAMA2_34B, PRESETS, TINY, parameter_count
from elaswave.model.llama import StepContext, build_layer
from elaswave.model.rng import CounterRng

pytestmark = pytest.mark.timeout(120)

EMULATED = DEVICES["emulated"]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_layer_params_sum_to_the_model(name):
    model = PRESETS[name]
    costs = layer_costs(model)
    assert len(costs) == model.num_layers
    assert [c.index for c in costs] == list(range(model.num_layers))
    assert [c.kind for c in costs] == (
        [LayerKind.EMBEDDING] + [LayerKind.BLOCK] * model.num_blocks + [LayerKind.HEAD]
    )
    assert sum(c.params for c in costs) == parameter_count(model)


def test_layer_params_match_the_built_layers():
    for index, cost in enumerate(layer_costs(TINY)):
        layer = build_layer(TINY, index, seed=0)
        assert cost.params == sum(p.numel() for p in layer.parameters())


def test_tensor_parallel_shards_the_matmuls_and_keeps_the_norms():
    model = LLAMA2_34B
    one, four = layer_costs(model), layer_costs(model, tp=4)
    h = model.hidden_size
    for full, shard in zip(one, four, strict=True):
        norms = {LayerKind.EMBEDDING: 0, LayerKind.BLOCK: 2 * h, LayerKind.HEAD: h}[full.kind]
        assert shard.params - norms == (full.params - norms) // 4
        assert shard.output_bytes_per_sample == full.output_bytes_per_sample / 4
        if full.kind is not LayerKind.EMBEDDING:
            assert shard.fwd_flops_per_sample == full.fwd_flops_per_sample / 4
    with pytest.raises(ValueError, match="num_kv_heads = 8"):
        layer_costs(model, tp=16)


def test_backward_is_twice_forward_and_the_head_sends_nothing():
    for cost in layer_costs(LLAMA2_7B):
        assert cost.bwd_flops_per_sample == 2 * cost.fwd_flops_per_sample > 0
        assert (cost.output_bytes_per_sample == 0) == (cost.kind is LayerKind.HEAD)


def test_block_flops_from_shapes():
    # Llama 2 7B: 4 h^2 attention + 3 h f MLP weights, 2 FLOPs each per token, plus
    # 4 s^2 h for scores and values.
    m = LLAMA2_7B
    block = layer_costs(m)[1]
    weights = 4 * m.hidden_size**2 + 3 * m.hidden_size * m.ffn_hidden_size
    expected = 2 * weights * m.seq_len + 4 * m.seq_len**2 * m.hidden_size
    assert block.fwd_flops_per_sample == expected
    head = layer_costs(m)[-1]
    assert head.fwd_flops_per_sample == 2 * m.hidden_size * m.vocab_size * m.seq_len


def test_activation_estimate_matches_the_korthikanti_count_for_a_gpt_shaped_block():
    # With kv = h, dropout on and eager attention in 16-bit, the Korthikanti et al. count
    # is s h (34 + 5 a s / h); ours differs only in the MLP (SwiGLU keeps 4 ffn-wide
    # tensors where GPT's GeLU keeps 2 of width 4h), which is 4 ffn - 8 h elements.
    m = dataclasses.replace(LLAMA2_7B, dropout=0.1)
    s, h, f, a = m.seq_len, m.hidden_size, m.ffn_hidden_size, m.num_heads
    block = layer_costs(m, dtype_bytes=2, flash_attention=False)[1]
    korthikanti = s * h * (34 + 5 * a * s / h)
    # Korthikanti also keeps a 1-byte attention dropout mask and the dropped scores
    # (3 a s^2 bytes); this model has no attention dropout.
    adjusted = korthikanti - 3 * a * s * s + 2 * s * (4 * f - 8 * h)
    assert block.activation_bytes_per_sample == adjusted


def test_activation_estimate_is_close_to_what_the_runtime_block_saves():
    # The runtime's eager block keeps a few more tensors than the fused-kernel count
    # (float dropout masks, pre-rotary Q and K): the estimate must stay within 30 %.
    layer = build_layer(TINY, 1, seed=0)
    own = {t.untyped_storage().data_ptr() for t in [*layer.parameters(), *layer.buffers()]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    ctx = StepContext(step=0, sample_ids=(0, 1), rng=CounterRng(0))
    x = torch.randn(2, TINY.seq_len, TINY.hidden_size, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, ctx)
    measured = sum(saved.values()) / 2
    estimate = layer_costs(TINY, dtype_bytes=4)[1].activation_bytes_per_sample
    assert 0.7 < estimate / measured < 1.3, (estimate, measured)


def test_compute_time_scales_inversely_with_the_clock():
    dev = DEVICES["ascend-910b"]
    base = compute_time(1e15, dev, dev.base_mhz)
    assert base == pytest.approx(1e15 / (dev.peak_flops * dev.efficiency))
    assert compute_time(1e15, dev, dev.max_mhz) == pytest.approx(base * dev.base_mhz / dev.max_mhz)
    assert compute_time(2e15, dev, dev.max_mhz) == pytest.approx(
        2 * compute_time(1e15, dev, dev.max_mhz)
    )
    with pytest.raises(ValueError, match="outside"):
        compute_time(1.0, dev, dev.max_mhz + 1)


def test_emulated_device_hits_its_tiny_model_targets():
    block = layer_costs(TINY, dtype_bytes=4)[1]
    fwd = compute_time(2 * block.fwd_flops_per_sample, EMULATED, EMULATED.base_mhz)
    bwd = compute_time(2 * block.bwd_flops_per_sample, EMULATED, EMULATED.base_mhz)
    assert fwd == pytest.approx(0.010, rel=0.05)
    assert bwd == pytest.approx(0.020, rel=0.05)
    activations = 2 * TINY.seq_len * TINY.hidden_size * 4
    assert 2 * block.output_bytes_per_sample == activations
    assert p2p_time(activations, EMULATED) == pytest.approx(0.001, rel=0.05)
    assert EMULATED.memory_bytes == 1 << 30


def test_ministep_clamps_communication_hidden_by_compute():
    kwargs = {"fwd_compute_s": 1.0, "bwd_compute_s": 2.0}
    # Fully hidden: the stage costs its compute, never less.
    hidden = ministep_time(**kwargs, p2p_fwd_s=0.1, p2p_bwd_s=0.1, sigma_f=1.0, sigma_b=1.0)
    assert hidden == 3.0
    # No overlap: everything adds up.
    serial = ministep_time(**kwargs, p2p_fwd_s=0.5, p2p_bwd_s=0.25, sigma_f=0.0, sigma_b=0.0)
    assert serial == 3.75
    # Partly hidden: only the excess over sigma x compute shows.
    partial = ministep_time(**kwargs, p2p_fwd_s=0.5, p2p_bwd_s=1.5, sigma_f=0.25, sigma_b=0.5)
    assert partial == pytest.approx(3.0 + 0.25 + 0.5)
    with pytest.raises(ValueError, match="sigma_b"):
        ministep_time(**kwargs, p2p_fwd_s=0, p2p_bwd_s=0, sigma_f=0.5, sigma_b=1.5)


def _routes_per_sender(sender_dp: int, receiver_dp: int, total: int) -> int:
    a = StagePlan(0, 0, 1, tuple(range(sender_dp)), even_split(total, sender_dp))
    ranks = tuple(range(sender_dp, sender_dp + receiver_dp))
    b = StagePlan(1, 1, 2, ranks, even_split(total, receiver_dp))
    plan = Plan(generation=0, global_batch=total, num_micro_batches=1, stages=(a, b))
    routes = plan.routes(0)
    return max(sum(r.src == src for r in routes) for src in a.ranks)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 8), st.integers(1, 8), st.integers(1, 3))
def test_fan_out_matches_the_plan_routes(sender_dp, receiver_dp, multiple):
    total = sender_dp * receiver_dp * multiple
    assert fan_out(sender_dp, receiver_dp) == _routes_per_sender(sender_dp, receiver_dp, total)


def test_fan_in_and_fan_out_bytes_follow_the_busier_end():
    dev = EMULATED
    # dp 3 x 2 samples -> dp 2 x 3 samples: a receiver takes 3 samples, a sender talks to 2.
    t = stage_p2p_time(
        100.0, dev, sender_dp=3, sender_micro_batch=2, receiver_dp=2, receiver_micro_batch=3
    )
    assert t == pytest.approx(300.0 / dev.p2p_bytes_per_s + 2 * dev.latency_s)
    # dp 1 x 4 -> dp 4 x 1: the sender sends 4 samples in 4 messages.
    t = stage_p2p_time(
        100.0, dev, sender_dp=1, sender_micro_batch=4, receiver_dp=4, receiver_micro_batch=1
    )
    assert t == pytest.approx(400.0 / dev.p2p_bytes_per_s + 4 * dev.latency_s)
    nothing = stage_p2p_time(
        0.0, dev, sender_dp=1, sender_micro_batch=4, receiver_dp=4, receiver_micro_batch=1
    )
    assert nothing == 0.0


def test_ring_allreduce_time():
    dev = DEVICES["h100"]
    assert ring_allreduce_time(1e9, dev, dp=1) == 0.0
    assert ring_allreduce_time(1e9, dev, dp=4) == pytest.approx(
        1.5e9 / dev.collective_bytes_per_s + 6 * dev.latency_s
    )


@pytest.mark.parametrize("num_micro_batches", [None, 1, 2, 8])
def test_stage_memory_counts_the_1f1b_in_flight_micro_batches(num_micro_batches):
    layer = LayerCost(0, LayerKind.BLOCK, 1000, 1.0, 2.0, 50.0, 10.0)
    num_stages, micro_batch, dp = 4, 3, 2
    for stage in range(num_stages):
        got = stage_memory(
            [layer, dataclasses.replace(layer, index=1)],
            micro_batch=micro_batch,
            dp=dp,
            stage=stage,
            num_stages=num_stages,
            num_micro_batches=num_micro_batches,
        )
        schedule = one_f_one_b(
            num_stages=num_stages, stage=stage, num_micro_batches=num_micro_batches or 16
        )
        live = max_in_flight(schedule)
        assert live == in_flight(
            stage=stage, num_stages=num_stages, num_micro_batches=num_micro_batches
        )
        # params + grads at 4 bytes, a 12-byte optimizer shard over dp, activations.
        assert got == 2000 * (4 + 4 + 12 / dp) + live * micro_batch * 100.0


def _random_layers(rng: np.random.Generator, num_layers: int) -> list[LayerCost]:
    layers = []
    for index in range(num_layers):
        fwd = float(rng.uniform(1e6, 1e8))
        out = 0.0 if index == num_layers - 1 else float(rng.uniform(1e3, 1e6))
        layers.append(
            LayerCost(
                index=index,
                kind=LayerKind.BLOCK,
                params=int(rng.integers(1, 10**6)),
                fwd_flops_per_sample=fwd,
                bwd_flops_per_sample=2 * fwd,
                activation_bytes_per_sample=float(rng.uniform(1e3, 1e6)),
                output_bytes_per_sample=out,
            )
        )
    return layers


def _reference_tables(layers, stages, dev, sigma_f, sigma_b, num_micro_batches):
    num_layers, num_stages = len(layers), len(stages)
    times = np.full((num_stages, num_layers + 1, num_layers + 1), math.inf)
    memory = np.full_like(times, math.inf)
    for p, spec in enumerate(stages):
        for a in range(num_layers):
            for b in range(a + 1, num_layers + 1):
                seg = layers[a:b]
                fwd_flops = spec.micro_batch * sum(x.fwd_flops_per_sample for x in seg)
                bwd_flops = spec.micro_batch * sum(x.bwd_flops_per_sample for x in seg)
                cf = compute_time(fwd_flops, dev, spec.mhz) * spec.slowdown
                cb = compute_time(bwd_flops, dev, spec.mhz) * spec.slowdown
                pf = pb = 0.0
                if b < num_layers and p + 1 < num_stages:
                    nxt = stages[p + 1]
                    pf = stage_p2p_time(
                        layers[b - 1].output_bytes_per_sample,
                        dev,
                        sender_dp=spec.dp,
                        sender_micro_batch=spec.micro_batch,
                        receiver_dp=nxt.dp,
                        receiver_micro_batch=nxt.micro_batch,
                    )
                if a > 0 and p > 0:
                    prv = stages[p - 1]
                    pb = stage_p2p_time(
                        layers[a - 1].output_bytes_per_sample,
                        dev,
                        sender_dp=spec.dp,
                        sender_micro_batch=spec.micro_batch,
                        receiver_dp=prv.dp,
                        receiver_micro_batch=prv.micro_batch,
                    )
                times[p, a, b] = ministep_time(
                    fwd_compute_s=cf,
                    bwd_compute_s=cb,
                    p2p_fwd_s=pf,
                    p2p_bwd_s=pb,
                    sigma_f=sigma_f[p],
                    sigma_b=sigma_b[p],
                )
                memory[p, a, b] = stage_memory(
                    seg,
                    micro_batch=spec.micro_batch,
                    dp=spec.dp,
                    stage=p,
                    num_stages=num_stages,
                    num_micro_batches=num_micro_batches,
                )
    return times, memory


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    num_layers=st.integers(1, 7),
    num_stages=st.integers(1, 4),
    num_micro_batches=st.one_of(st.none(), st.integers(1, 6)),
)
def test_segment_tables_agree_with_a_loop_reference(
    seed, num_layers, num_stages, num_micro_batches
):
    rng = np.random.default_rng(seed)
    dev = DEVICES["ascend-910b"]
    layers = _random_layers(rng, num_layers)
    stages = [
        StageSpec(
            dp=int(rng.integers(1, 5)),
            micro_batch=int(rng.integers(1, 5)),
            mhz=float(rng.uniform(dev.min_mhz, dev.max_mhz)),
            slowdown=float(rng.uniform(1.0, 2.0)),
            memory_cap_bytes=dev.memory_bytes,
        )
        for _ in range(num_stages)
    ]
    sigma_f = rng.uniform(0, 1, num_stages)
    sigma_b = rng.uniform(0, 1, num_stages)
    times, memory = segment_tables(
        layers,
        stages,
        dev,
        sigma_f=list(sigma_f),
        sigma_b=list(sigma_b),
        num_micro_batches=num_micro_batches,
    )
    ref_t, ref_m = _reference_tables(layers, stages, dev, sigma_f, sigma_b, num_micro_batches)
    assert times.shape == memory.shape == (num_stages, num_layers + 1, num_layers + 1)
    np.testing.assert_allclose(times, ref_t, rtol=1e-12)
    np.testing.assert_allclose(memory, ref_m, rtol=1e-12)


def test_segment_tables_are_fast_for_96_layers_on_16_stages():
    rng = np.random.default_rng(0)
    layers = _random_layers(rng, 96)
    dev = DEVICES["h100"]
    stages = [
        StageSpec(dp=int(rng.integers(1, 9)), micro_batch=2, mhz=1590, memory_cap_bytes=8e10)
        for _ in range(16)
    ]
    segment_tables(layers, stages, dev)
    elapsed = []
    for _ in range(5):
        start = time.perf_counter()
        segment_tables(layers, stages, dev, sigma_f=0.5, sigma_b=0.5)
        elapsed.append(time.perf_counter() - start)
    assert sorted(elapsed)[2] < 0.05


def test_device_presets_and_lookup():
    assert device("h100") is DEVICES["h100"]
    assert DEVICES["ascend-910b"].base_mhz == 1400 and DEVICES["ascend-910b"].max_mhz == 1650
    with pytest.raises(ValueError, match="ascend-910b, h100, emulated"):
        device("tpu")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("name", ""),
        ("peak_flops", 0.0),
        ("peak_flops", math.inf),
        ("efficiency", 0.0),
        ("efficiency", 1.5),
        ("min_mhz", 0.0),
        ("min_mhz", 1500.0),
        ("max_mhz", 1000.0),
        ("memory_bytes", -1),
        ("p2p_bytes_per_s", 0.0),
        ("collective_bytes_per_s", -5.0),
        ("latency_s", -1e-6),
    ],
)
def test_bad_device_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=re.escape(f"device.{field} = ")):
        dataclasses.replace(DEVICES["ascend-910b"], **{field: value})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dp": 0}, "dp = 0"),
        ({"micro_batch": 0}, "micro_batch = 0"),
        ({"slowdown": 0.5}, "slowdown = 0.5"),
        ({"mhz": -1.0}, "mhz = -1.0"),
        ({"memory_cap_bytes": 0}, "memory_cap_bytes = 0"),
    ],
)
def test_bad_stage_values_name_the_field(kwargs, message):
    base = {"dp": 1, "micro_batch": 1, "mhz": 1400.0, "memory_cap_bytes": 1e9}
    with pytest.raises(ValueError, match=re.escape(message)):
        StageSpec(**(base | kwargs))


def test_segment_tables_reject_a_clock_outside_the_device_range():
    spec = StageSpec(dp=1, micro_batch=1, mhz=1700.0, memory_cap_bytes=1e9)
    with pytest.raises(ValueError, match=r"stage 0 clock 1700\.0 MHz"):
        segment_tables(layer_costs(TINY), [spec], EMULATED)
