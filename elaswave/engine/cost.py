"""Cost and memory model of a pipeline stage (paper §4.2, eq. 1).

Everything the graph planner needs to price a stage: per-layer FLOPs, parameters and
activation sizes from the model's shapes (:func:`layer_costs`), device speeds
(:class:`DeviceSpec`), the mini-step time of eq. 1 (:func:`ministep_time`) and the
per-rank memory under ZeRO-1 and 1F1B (:func:`stage_memory`). :func:`segment_tables`
evaluates both for every contiguous layer segment on every stage at once, as the
``t_p([a..b])`` and ``Mem[a..b]`` tables of Alg. 1.

Units: seconds, bytes, FLOPs, MHz. Per-sample figures are for one sample of
``model.seq_len`` tokens on one tensor-parallel rank. All functions are pure, and the
tables use only elementwise IEEE arithmetic and sequential prefix sums, so every process
that evaluates them on the same inputs gets the same bits.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from elaswave.fabric.remap import FP32_BYTES, STATE_TENSORS
from elaswave.model.config import ModelConfig

__all__ = [
    "DEVICES",
    "DeviceSpec",
    "LayerCost",
    "LayerKind",
    "StageSpec",
    "compute_time",
    "device",
    "fan_out",
    "in_flight",
    "layer_costs",
    "ministep_time",
    "p2p_time",
    "ring_allreduce_time",
    "segment_tables",
    "stage_memory",
    "stage_p2p_time",
]

FloatArray = npt.NDArray[np.float64]

GIB = 1 << 30


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """Speeds and sizes of one accelerator, as the cost model sees it."""

    name: str
    """Preset name, used in logs and reasons."""
    peak_flops: float
    """Dense peak FLOP/s at ``base_mhz`` in the training precision."""
    efficiency: float
    """Fraction of ``peak_flops`` that transformer layers achieve, in (0, 1]."""
    base_mhz: float
    """Clock at which ``peak_flops`` holds; compute speed scales linearly with the clock."""
    min_mhz: float
    """Lowest clock the DVFS planner may set (a policy floor, not necessarily the hardware's)."""
    max_mhz: float
    """Highest clock the DVFS planner may set."""
    memory_bytes: int
    """Device memory, bytes."""
    p2p_bytes_per_s: float
    """Stage-to-stage point-to-point bandwidth of one rank, bytes/s."""
    collective_bytes_per_s: float
    """Per-rank bus bandwidth of DP collectives (reduce-scatter, all-gather), bytes/s."""
    latency_s: float
    """Fixed cost of one message, seconds."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError(f"device.name = {self.name!r}: give the device a name")
        for field in ("peak_flops", "p2p_bytes_per_s", "collective_bytes_per_s", "memory_bytes"):
            value = getattr(self, field)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"device.{field} = {value!r}: must be a positive finite number")
        if not 0.0 < self.efficiency <= 1.0:
            raise ValueError(f"device.efficiency = {self.efficiency!r}: must be in (0, 1]")
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0.0):
            raise ValueError(f"device.latency_s = {self.latency_s!r}: must be finite and >= 0")
        if not 0.0 < self.min_mhz <= self.base_mhz:
            raise ValueError(
                f"device.min_mhz = {self.min_mhz!r}: must be positive and at most "
                f"base_mhz = {self.base_mhz!r}"
            )
        if not (math.isfinite(self.max_mhz) and self.max_mhz >= self.base_mhz):
            raise ValueError(
                f"device.max_mhz = {self.max_mhz!r}: must be finite and at least "
                f"base_mhz = {self.base_mhz!r}"
            )

    def flops_per_s(self, mhz: float) -> float:
        """Achieved FLOP/s at clock ``mhz`` (MHz)."""
        return self.peak_flops * self.efficiency * mhz / self.base_mhz


# Emulated device: slow enough that the tiny default model (hidden 64, ffn 160, seq 32,
# fp32) shows pipeline dynamics on a 2-core CPU. One transformer block forward on a
# 2-sample micro-batch is 2 x 3,276,800 = 6,553,600 FLOPs; at 1.31072e9 x 0.5 =
# 6.5536e8 FLOP/s that is 10 ms (backward 20 ms). One micro-batch of activations,
# 2 x 32 x 64 x 4 = 16,384 bytes, takes 16,384 / 1.82e7 s + 0.1 ms latency = 1.0 ms.
# These figures are made up to emulate a pipeline, not measured on any hardware.
DEVICES: dict[str, DeviceSpec] = {
    "ascend-910b": DeviceSpec(
        name="ascend-910b",
        peak_flops=3.2e14,  # fp16 dense, approximate
        efficiency=0.45,
        base_mhz=1400.0,  # the paper's testbed: initial 1,400 MHz, maximum 1,650 MHz
        min_mhz=1000.0,
        max_mhz=1650.0,
        memory_bytes=32 * GIB,  # the paper's testbed: 32 GB per NPU
        p2p_bytes_per_s=25e9,  # 200 Gb/s RoCE
        collective_bytes_per_s=25e9,
        latency_s=2e-5,
    ),
    "h100": DeviceSpec(
        name="h100",
        peak_flops=989e12,  # bf16 dense, SXM
        efficiency=0.45,
        base_mhz=1590.0,
        min_mhz=1000.0,
        max_mhz=1980.0,
        memory_bytes=80 * GIB,
        p2p_bytes_per_s=50e9,  # 400 Gb/s InfiniBand between nodes
        collective_bytes_per_s=50e9,
        latency_s=1e-5,
    ),
    "emulated": DeviceSpec(
        name="emulated",
        peak_flops=1.31072e9,  # emulated, see above
        efficiency=0.5,
        base_mhz=1400.0,
        min_mhz=1000.0,
        max_mhz=1650.0,
        memory_bytes=1 * GIB,
        p2p_bytes_per_s=1.82e7,
        collective_bytes_per_s=1.82e7,
        latency_s=1e-4,
    ),
}


def device(name: str) -> DeviceSpec:
    """The preset called ``name``."""
    try:
        return DEVICES[name]
    except KeyError:
        raise ValueError(f"unknown device {name!r}; valid devices: {', '.join(DEVICES)}") from None


class LayerKind(enum.StrEnum):
    """What a pipeline-placeable layer is (see :mod:`elaswave.model.llama`)."""

    EMBEDDING = "embedding"
    BLOCK = "block"
    HEAD = "head"


@dataclass(frozen=True)
class LayerCost:
    """What one pipeline-placeable layer costs on one tensor-parallel rank."""

    index: int
    """Global layer index: 0 is the embedding, the last is the head."""
    kind: LayerKind
    """Embedding, transformer block or final norm + LM head."""
    params: int
    """Parameters held by one TP rank."""
    fwd_flops_per_sample: float
    """Forward FLOPs for one sample of ``seq_len`` tokens."""
    bwd_flops_per_sample: float
    """Backward FLOPs for one sample (input and weight gradients: twice the forward)."""
    activation_bytes_per_sample: float
    """Bytes one sample's forward keeps until its backward."""
    output_bytes_per_sample: float
    """Bytes one sample sends to the next stage (hidden states); 0 for the head."""


def layer_costs(
    model: ModelConfig, *, tp: int = 1, dtype_bytes: int = 2, flash_attention: bool = True
) -> list[LayerCost]:
    """Per-layer costs of ``model`` on one of ``tp`` tensor-parallel ranks.

    FLOPs count a multiply-add as 2: a linear layer with ``n`` weights costs ``2 n s``
    per sample of ``s`` tokens; attention scores and values add ``4 s^2 h`` per block
    (no saving from the causal mask is assumed); the head costs ``2 h v s``; the
    embedding lookup is counted as ``s h`` so that it is small but not free.

    Activation bytes follow Korthikanti et al., "Reducing Activation Recomputation in
    Large Transformer Models" (2022, §4.1), who count ``s h (34 + 5 a s / h)`` bytes per
    GPT block in 16-bit: 16 stored tensors of ``s h`` elements, two 1-byte dropout
    masks, and the ``a s^2`` attention scores. Adapted to this Llama block at
    ``dtype_bytes`` per element, the stored tensors are the two norm inputs and outputs
    (4 ``h``), Q and the attention output (2 ``h``), K and V (2 ``kv`` with grouped
    query attention) and the SwiGLU gate, activated gate, up and product (4 ``ffn``);
    the dropout masks (1 byte, only when ``model.dropout > 0``) follow the attention and
    MLP outputs. With ``flash_attention`` the scores are not stored, only an fp32
    log-sum-exp per head and token; otherwise the ``a s^2`` softmax output is. The head
    keeps its norm input and output and fp32 logits for the cross-entropy (``4 s v``);
    the embedding keeps int64 token ids. With ``tp > 1`` Megatron sequence parallelism
    is assumed, so every stored tensor except the token ids is split ``tp`` ways, and so
    is the hidden state sent to the next stage.
    """
    if tp < 1 or model.num_heads % tp or model.num_kv_heads % tp:
        raise ValueError(
            f"tp = {tp}: must be a positive divisor of num_heads = {model.num_heads} and "
            f"num_kv_heads = {model.num_kv_heads}"
        )
    if dtype_bytes < 1:
        raise ValueError(f"dtype_bytes = {dtype_bytes}: must be at least 1")
    s, h, f, v = model.seq_len, model.hidden_size, model.ffn_hidden_size, model.vocab_size
    a = model.num_heads
    q, kv = a * model.head_dim, model.num_kv_heads * model.head_dim
    masks = model.dropout > 0.0
    hidden_out = s * h * dtype_bytes / tp

    embed = LayerCost(
        index=0,
        kind=LayerKind.EMBEDDING,
        params=v * h // tp,
        fwd_flops_per_sample=float(s * h),
        bwd_flops_per_sample=float(2 * s * h),
        activation_bytes_per_sample=8.0 * s + (s * h / tp if masks else 0.0),
        output_bytes_per_sample=hidden_out,
    )

    bias = (q + 2 * kv) if model.qkv_bias and not model.block_params else 0
    scores = float(FP32_BYTES * a * s) if flash_attention else float(dtype_bytes * a * s * s)
    block_act = (
        dtype_bytes * s * (4 * h + 2 * q + 2 * kv + 4 * f) + (2 * s * h if masks else 0) + scores
    ) / tp

    def block(index: int) -> LayerCost:
        # priced from the parameters a token passes through (a mixture of experts: top_k)
        whole = model.block_whole_of(index - 1)  # kept whole on every TP member: norms
        matmul = model.block_active(index - 1) - whole - bias
        fwd = (2.0 * matmul * s + 4.0 * s * s * q) / tp
        return LayerCost(
            index=index,
            kind=LayerKind.BLOCK,
            params=whole + (model.block_params_of(index - 1) - whole) // tp,
            fwd_flops_per_sample=fwd,
            bwd_flops_per_sample=2.0 * fwd,
            activation_bytes_per_sample=block_act,
            output_bytes_per_sample=hidden_out,
        )

    blocks = [block(index) for index in range(1, model.num_blocks + 1)]

    head_fwd = 2.0 * h * v * s / tp
    head = LayerCost(
        index=model.num_layers - 1,
        kind=LayerKind.HEAD,
        params=(model.head_params - h * v if model.head_params else h) + h * v // tp,
        fwd_flops_per_sample=head_fwd,
        bwd_flops_per_sample=2.0 * head_fwd,
        activation_bytes_per_sample=(2.0 * dtype_bytes * s * h + FP32_BYTES * s * v) / tp,
        output_bytes_per_sample=0.0,
    )
    return [embed, *blocks, head]


def _check_mhz(device: DeviceSpec, mhz: float) -> None:
    if not device.min_mhz <= mhz <= device.max_mhz:
        raise ValueError(
            f"clock {mhz!r} MHz is outside {device.name}'s range "
            f"[{device.min_mhz:g}, {device.max_mhz:g}] MHz"
        )


def compute_time(flops: float, device: DeviceSpec, mhz: float) -> float:
    """Seconds to run ``flops`` at clock ``mhz``: flops / (peak x efficiency x mhz / base)."""
    _check_mhz(device, mhz)
    return flops / device.flops_per_s(mhz)


def p2p_time(num_bytes: float, device: DeviceSpec, *, messages: int = 1) -> float:
    """Seconds for one rank to send ``num_bytes`` as ``messages`` point-to-point messages."""
    if num_bytes < 0 or messages < 0:
        raise ValueError(f"num_bytes = {num_bytes}, messages = {messages}: must be >= 0")
    return num_bytes / device.p2p_bytes_per_s + messages * device.latency_s


def ring_allreduce_time(num_bytes: float, device: DeviceSpec, *, dp: int) -> float:
    """Seconds for a ring all-reduce of ``num_bytes`` over ``dp`` ranks.

    ZeRO-1's reduce-scatter plus all-gather moves the same volume: ``2 (dp-1)/dp`` of
    the buffer through each rank's link, in ``2 (dp-1)`` latency-bound steps.
    """
    if dp < 1:
        raise ValueError(f"dp = {dp}: must be at least 1")
    steps = 2 * (dp - 1)
    return steps / dp * num_bytes / device.collective_bytes_per_s + steps * device.latency_s


@functools.lru_cache(maxsize=4096)  # O(sender_dp), asked for every table at 10^5 devices
def fan_out(sender_dp: int, receiver_dp: int) -> int:
    """Most receivers one sender talks to between stages of ``sender_dp`` and ``receiver_dp``.

    Each stage splits every global micro-batch into contiguous, even slices (the plan's
    routes); sender ``s`` owns ``[s/S, (s+1)/S)`` of it and overlaps receivers
    ``floor(s R / S)`` up to ``ceil((s+1) R / S) - 1``. Exact when the micro-batch
    divides evenly by both widths.
    """
    if sender_dp < 1 or receiver_dp < 1:
        raise ValueError(f"dp widths {sender_dp}, {receiver_dp}: must be at least 1")
    return max(
        -(-(s + 1) * receiver_dp // sender_dp) - s * receiver_dp // sender_dp
        for s in range(sender_dp)
    )


def stage_p2p_time(
    bytes_per_sample: float,
    device: DeviceSpec,
    *,
    sender_dp: int,
    sender_micro_batch: int,
    receiver_dp: int,
    receiver_micro_batch: int,
) -> float:
    """Seconds for one rank to send a micro-batch's tensors to the adjacent stage.

    With fan-in or fan-out between stages of different DP widths the transfer is bounded
    by the busier end: what one sender sends or what one receiver receives, whichever is
    more (``max`` of the per-replica micro-batches times ``bytes_per_sample``), plus one
    latency per message the sender sends (:func:`fan_out`). Nothing to send costs 0.
    """
    if bytes_per_sample == 0:
        return 0.0
    num_bytes = bytes_per_sample * max(sender_micro_batch, receiver_micro_batch)
    return p2p_time(num_bytes, device, messages=fan_out(sender_dp, receiver_dp))


def _exposed(compute: npt.ArrayLike, p2p: npt.ArrayLike, sigma: npt.ArrayLike) -> FloatArray:
    # The part of a transfer that compute does not hide; the same expression serves the
    # scalar and the vectorised paths so that both round alike.
    return np.maximum(0.0, np.subtract(p2p, np.multiply(sigma, compute)))


def ministep_time(
    *,
    fwd_compute_s: float,
    bwd_compute_s: float,
    p2p_fwd_s: float,
    p2p_bwd_s: float,
    sigma_f: float,
    sigma_b: float,
) -> float:
    """Mini-step seconds of one stage for one micro-batch (paper eq. 1).

    ``C_f + C_b + max(0, P2P_f - sigma_f C_f) + max(0, P2P_b - sigma_b C_b)``, where
    ``P2P_f`` sends activations to the next stage and ``P2P_b`` sends gradients to the
    previous one, and ``sigma`` is the fraction of compute that hides communication.
    The paper writes the brackets without the clamp; a transfer fully hidden by compute
    costs nothing, and it cannot make the stage faster than its compute, so the exposed
    part is clamped at 0.
    """
    for name, sigma in (("sigma_f", sigma_f), ("sigma_b", sigma_b)):
        if not 0.0 <= sigma <= 1.0:
            raise ValueError(f"{name} = {sigma!r}: must be in [0, 1]")
    exposed_f = _exposed(fwd_compute_s, p2p_fwd_s, sigma_f)
    exposed_b = _exposed(bwd_compute_s, p2p_bwd_s, sigma_b)
    return float(fwd_compute_s + bwd_compute_s + exposed_f + exposed_b)


def in_flight(*, stage: int, num_stages: int, num_micro_batches: int | None = None) -> int:
    """Micro-batches whose activations stage ``stage`` holds at once under 1F1B."""
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} out of range for {num_stages} stages")
    if num_micro_batches is not None and num_micro_batches < 1:
        raise ValueError(f"num_micro_batches = {num_micro_batches}: must be at least 1")
    live = num_stages - stage
    return live if num_micro_batches is None else min(live, num_micro_batches)


def stage_memory(
    layers: Sequence[LayerCost],
    *,
    micro_batch: int,
    dp: int,
    stage: int,
    num_stages: int,
    num_micro_batches: int | None = None,
    param_bytes: float = FP32_BYTES,
    optimizer_bytes: float = STATE_TENSORS * FP32_BYTES,
    live: int | None = None,
) -> float:
    """Bytes on one rank of a stage that holds ``layers`` (a contiguous slice).

    Parameters and their gradients at ``param_bytes`` each (4: the runtime trains in
    fp32), the rank's ZeRO-1 optimizer shard at ``optimizer_bytes / dp`` per parameter
    (12: fp32 master weights and two Adam moments), and the activations of the
    micro-batches in flight under 1F1B: ``num_stages - stage`` of them (fewer when the
    step has fewer micro-batches), each of ``micro_batch`` samples. Communication
    buffers, the allocator's slack and the framework's own footprint are not counted;
    leave room for them in the cap. ``live``: the micro-batches whose activations the
    stage's schedule holds at most (default 1F1B's, :func:`in_flight`).
    """
    if micro_batch < 1 or dp < 1:
        raise ValueError(f"micro_batch = {micro_batch}, dp = {dp}: both must be at least 1")
    params = sum(layer.params for layer in layers)
    activations = sum(layer.activation_bytes_per_sample for layer in layers)
    if live is None:
        live = in_flight(stage=stage, num_stages=num_stages, num_micro_batches=num_micro_batches)
    return (2.0 * param_bytes + optimizer_bytes / dp) * params + live * micro_batch * activations


SNAPSHOT_GRAD_BUFFERS = 2
"""Gradient buffers a snapshot keeper holds besides the shard state, in steady state
(:class:`~elaswave.fabric.snapshot.SnapshotKeeper`: one received, one spare)."""


def snapshot_host_bytes(
    params: int, *, dp: int, copies: int = 1, grad_buffers: int = SNAPSHOT_GRAD_BUFFERS
) -> float:
    """Host bytes one rank holds for snapshots when it keeps ``copies`` of them, each of
    a shard of a stage with ``params`` parameters over ``dp`` replicas (the placement
    spreads copies evenly: each rank holds about ``copies``): the shard's fp32 master
    weights and two moments, and the keeper's ``grad_buffers`` gradient buffers, each a
    frame of the shard and its trailer (:data:`elaswave.fabric.snapshot.END`)."""
    if dp < 1 or copies < 1:
        raise ValueError(f"dp = {dp}, copies = {copies}: both must be at least 1")
    shard = params / dp
    return copies * FP32_BYTES * (STATE_TENSORS * shard + grad_buffers * (shard + 1))


@dataclass(frozen=True, kw_only=True)
class StageSpec:
    """One pipeline stage as the planner sees it."""

    dp: int
    """DP replicas in the stage."""
    micro_batch: int
    """Largest per-replica micro-batch in the stage (samples); resizing can make them uneven."""
    mhz: float
    """Clock of the stage's slowest replica (MHz)."""
    slowdown: float = 1.0
    """Fail-slow factor of the slowest replica: its compute takes this many times longer."""
    memory_cap_bytes: float
    """Memory one rank of the stage may use for parameters, optimizer state and activations."""
    samples: float | None = None
    """Samples per micro-batch the stage's compute is priced at (None: ``micro_batch``).
    Below ``micro_batch`` only when the replicas' shares rotate, so that each takes the
    largest in turn (the planner tries prices between the mean and the largest share)."""

    def __post_init__(self) -> None:
        if self.dp < 1 or self.micro_batch < 1:
            raise ValueError(
                f"stage dp = {self.dp}, micro_batch = {self.micro_batch}: both must be >= 1"
            )
        if self.samples is not None and not 0 < self.samples <= self.micro_batch:
            raise ValueError(
                f"stage samples = {self.samples!r}: must be in (0, micro_batch = "
                f"{self.micro_batch}]"
            )
        if not (math.isfinite(self.mhz) and self.mhz > 0):
            raise ValueError(f"stage mhz = {self.mhz!r}: must be a positive clock in MHz")
        if not (math.isfinite(self.slowdown) and self.slowdown >= 1.0):
            raise ValueError(f"stage slowdown = {self.slowdown!r}: must be finite and >= 1.0")
        if not self.memory_cap_bytes > 0:
            raise ValueError(f"stage memory_cap_bytes = {self.memory_cap_bytes!r}: must be > 0")


def _per_stage(value: float | Sequence[float], num_stages: int, name: str) -> FloatArray:
    out = np.broadcast_to(np.asarray(value, dtype=np.float64), (num_stages,))
    if not ((out >= 0.0) & (out <= 1.0)).all():
        raise ValueError(f"{name} = {value!r}: every value must be in [0, 1]")
    return out


def _prefix(values: Sequence[float]) -> FloatArray:
    return np.concatenate(([0.0], np.cumsum(np.asarray(values, dtype=np.float64))))


def _segments(prefix: FloatArray) -> FloatArray:
    # [a, b] = sum of layers [a, b) (negative or zero below the diagonal; masked later).
    return prefix[None, :] - prefix[:, None]


def segment_tables(
    layers: Sequence[LayerCost],
    stages: Sequence[StageSpec],
    device: DeviceSpec,
    *,
    sigma_f: float | Sequence[float] = 0.0,
    sigma_b: float | Sequence[float] = 0.0,
    num_micro_batches: int | None = None,
    param_bytes: float = FP32_BYTES,
    optimizer_bytes: float = STATE_TENSORS * FP32_BYTES,
) -> tuple[FloatArray, FloatArray]:
    """Mini-step seconds ``T`` and per-rank memory bytes ``M`` of every segment on every stage.

    ``T[p, a, b]`` is :func:`ministep_time` of stage ``p`` running layers ``[a, b)`` and
    ``M[p, a, b]`` its :func:`stage_memory`, for ``0 <= a < b <= L``; entries with
    ``a >= b`` are ``+inf``. Compute is the stage's samples (:attr:`StageSpec.samples`,
    by default its micro-batch) times the segment's FLOPs
    at the stage's clock, times its slowdown. The stage sends activations of layer
    ``b - 1`` to stage ``p + 1`` (nothing when ``b = L``) and gradients of layer
    ``a - 1``'s output to stage ``p - 1`` (nothing when ``a = 0``), priced by
    :func:`stage_p2p_time` against that neighbour's width and micro-batch. ``sigma_f``
    and ``sigma_b`` (one value or one per stage) default to 0: no overlap, the
    conservative choice until they are profiled.
    """
    _check_segments(layers, stages, device)
    num_layers, num_stages = len(layers), len(stages)
    sf = _per_stage(sigma_f, num_stages, "sigma_f")[:, None, None]
    sb = _per_stage(sigma_b, num_stages, "sigma_b")[:, None, None]
    times, scratch = _time_table(layers, stages, device, sf, sb)
    memory = _memory_table(
        layers,
        stages,
        num_micro_batches=num_micro_batches,
        param_bytes=param_bytes,
        optimizer_bytes=optimizer_bytes,
        scratch=scratch,
    )
    empty = np.tril(np.ones((num_layers + 1, num_layers + 1), dtype=bool))
    np.copyto(times, np.inf, where=empty)
    np.copyto(memory, np.inf, where=empty)
    return times, memory


def _check_segments(
    layers: Sequence[LayerCost], stages: Sequence[StageSpec], device: DeviceSpec
) -> None:
    if len(stages) < 1:
        raise ValueError("no stages to plan")
    for position, layer in enumerate(layers):
        if layer.index != position:
            raise ValueError(f"layer at position {position} has index {layer.index}")
    for stage, spec in enumerate(stages):
        if not device.min_mhz <= spec.mhz <= device.max_mhz:
            raise ValueError(
                f"stage {stage} clock {spec.mhz!r} MHz is outside {device.name}'s range "
                f"[{device.min_mhz:g}, {device.max_mhz:g}] MHz"
            )


def _boundary_sends(
    layers: Sequence[LayerCost], stages: Sequence[StageSpec], device: DeviceSpec
) -> tuple[FloatArray, FloatArray]:
    """Seconds stage ``p`` sends activations to ``p + 1`` when its segment ends at ``b``
    (``[p, b]``), and gradients to ``p - 1`` when it starts at ``a`` (``[p, a]``)."""
    num_layers, num_stages = len(layers), len(stages)
    # Bytes per sample crossing a boundary at position k: the output of layer k - 1.
    out = np.zeros(num_layers + 1)
    out[1:num_layers] = [layer.output_bytes_per_sample for layer in layers[:-1]]
    send_next = np.zeros((num_stages, num_layers + 1))  # indexed by b
    send_prev = np.zeros((num_stages, num_layers + 1))  # indexed by a
    for stage in range(num_stages):
        for peer, table in ((stage + 1, send_next), (stage - 1, send_prev)):
            if not 0 <= peer < num_stages:
                continue
            samples = max(stages[stage].micro_batch, stages[peer].micro_batch)
            latency = fan_out(stages[stage].dp, stages[peer].dp) * device.latency_s
            table[stage] = np.where(out > 0, out * samples / device.p2p_bytes_per_s + latency, 0.0)
    return send_next, send_prev


def _time_table(
    layers: Sequence[LayerCost],
    stages: Sequence[StageSpec],
    device: DeviceSpec,
    sf: FloatArray,
    sb: FloatArray,
) -> tuple[FloatArray, FloatArray]:
    """Mini-step seconds of every segment on every stage (below the diagonal too), and
    a scratch array of the same shape."""
    work = np.array([s.micro_batch if s.samples is None else s.samples for s in stages])
    rate = np.array([device.flops_per_s(s.mhz) / s.slowdown for s in stages])
    fwd = _segments(_prefix([layer.fwd_flops_per_sample for layer in layers]))
    bwd = _segments(_prefix([layer.bwd_flops_per_sample for layer in layers]))
    cf = (work / rate)[:, None, None] * fwd[None]
    cb = (work / rate)[:, None, None] * bwd[None]
    send_next, send_prev = _boundary_sends(layers, stages, device)
    # Eq. 1 as in ministep_time, with in-place steps (same operations, same rounding):
    # the tables are P (L+1)^2 and temporaries dominate the cost.
    times = cf + cb
    exposed = np.multiply(sf, cf)
    np.subtract(send_next[:, None, :], exposed, out=exposed)
    times += np.maximum(exposed, 0.0, out=exposed)
    np.multiply(sb, cb, out=exposed)
    np.subtract(send_prev[:, :, None], exposed, out=exposed)
    times += np.maximum(exposed, 0.0, out=exposed)
    return times, exposed


def _memory_table(
    layers: Sequence[LayerCost],
    stages: Sequence[StageSpec],
    *,
    num_micro_batches: int | None,
    param_bytes: float,
    optimizer_bytes: float,
    scratch: FloatArray,
) -> FloatArray:
    """Per-rank bytes of every segment on every stage (below the diagonal too);
    ``scratch`` (of the table's shape) is overwritten."""
    num_stages = len(stages)
    dp = np.array([s.dp for s in stages], dtype=np.float64)
    mb = np.array([s.micro_batch for s in stages], dtype=np.float64)
    params = _segments(_prefix([float(layer.params) for layer in layers]))
    acts = _segments(_prefix([layer.activation_bytes_per_sample for layer in layers]))
    live = np.array(
        [
            in_flight(stage=p, num_stages=num_stages, num_micro_batches=num_micro_batches)
            for p in range(num_stages)
        ],
        dtype=np.float64,
    )
    per_param = (2.0 * param_bytes + optimizer_bytes / dp)[:, None, None]
    memory = per_param * params[None]
    memory += np.multiply((live * mb)[:, None, None], acts[None], out=scratch)
    return memory
