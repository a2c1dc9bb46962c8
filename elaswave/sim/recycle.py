"""ReCycle's answer to a failure: re-route micro-batches to same-stage peers (pure).

ReCycle keeps every replica's pipeline and the global batch. The micro-batches a failed
rank would have run are re-routed to the surviving ranks of the same stage in the other
replicas; each peer's backward is decoupled into the input-gradient pass ``B`` (on the
pipeline's critical path) and the weight-gradient pass ``W``, and the re-routed
micro-batches' ``W`` are deferred into the peer's pipeline bubbles. This module prices
that with the engine's cost model and the simulator's 1F1B event simulation:

* **Load.** A stage with ``f`` failed of ``dp`` ranks re-routes ``f m`` micro-batches
  (``m`` per replica per step) over ``n = dp - f`` peers: ``e = ceil(f m / n)`` extra
  each. ``B`` and ``W`` are each half of the cost model's backward (which counts the
  input and weight gradients as one forward each).
* **Time.** A peer's forward and ``B`` of all ``m + e`` micro-batches and the ``W`` of
  its own ``m`` stay in the step, spread evenly over its 1F1B slots; of the ``e``
  re-routed ``W``, as many as fit into the stage's bubble budget (its idle time in that
  step) and into the memory the peer has left are deferred there, ``k``; the other
  ``e - k`` run in line. The deferred work
  then fills the bubble: the stage finishes no earlier than its last in-line pass and
  no earlier than its busy time plus the deferred work; its DP synchronisation follows.
* **Memory.** A peer holds its own 1F1B activations (:func:`stage_memory`), those of the
  failed replica's in-flight micro-batches it now runs (``ceil(f (p - s) / n)`` at stage
  ``s`` of ``p``), and for each deferred ``W`` what the weight gradients need: the
  inputs and output gradients of the stage's linear layers
  (:func:`weight_grad_bytes_per_sample`). Deferral stops where memory ends; when the
  re-routed micro-batches' activations alone pass the device's memory, ReCycle runs out
  of memory (:class:`OutOfMemory`).

ReCycle's own planner (a MILP over these choices, memory-constrained) is not reproduced;
deferring as much as fits in the bubble and in memory gives it its best step time. ZeRO shards of
the failed rank are assumed to be held elsewhere, as ReCycle assumes replicated state.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from elaswave.engine.cost import GIB, DeviceSpec, LayerCost, stage_memory
from elaswave.engine.plan import Plan
from elaswave.engine.steptime import StageTimes, simulate_step, stage_times
from elaswave.fabric.errors import Unrecoverable
from elaswave.model.config import ModelConfig


class OutOfMemory(Unrecoverable):
    """A policy's plan does not fit in device memory: the job would crash."""


@dataclass(frozen=True)
class PeerLoad:
    """What one surviving peer of a stage carries under ReCycle."""

    stage: int
    failed: int
    peers: int
    extra: int
    """Re-routed micro-batches per peer per step."""
    deferred: int
    """Of those, the weight-gradient passes deferred into the bubble."""
    memory_bytes: float
    """Peak bytes on the peer."""


@dataclass(frozen=True)
class RecycleStep:
    step_s: float
    loads: tuple[PeerLoad, ...]
    """Stages that lost ranks."""

    @property
    def reason(self) -> str:
        parts = [
            f"stage {p.stage}: {p.failed} failed, {p.peers} peers take {p.extra} extra "
            f"micro-batches each, {p.deferred} weight-gradient passes deferred into the bubble, "
            f"peak {p.memory_bytes / GIB:.1f} GiB"
            for p in self.loads
        ]
        return "re-routed to same-stage peers; " + "; ".join(parts)


def weight_grad_bytes_per_sample(
    model: ModelConfig, *, tp: int = 1, dtype_bytes: int = 2
) -> list[float]:
    """Bytes per sample that one layer's deferred weight-gradient pass keeps alive.

    A linear layer's weight gradient needs its input and its output gradient. Per token
    of a Llama block: inputs of QKV and of the gate/up projection (the two norm outputs,
    ``2 h``), of the output projection (``h``) and of the down projection (``f``); output
    gradients of QKV (``h + 2 kv``), the output projection (``h``), gate and up (``2 f``)
    and the down projection (``h``). The head keeps its input and the logits' gradient
    (``h + v``); the embedding its output gradient (``h``). Split ``tp`` ways, at
    ``dtype_bytes`` per element, like :func:`~elaswave.engine.cost.layer_costs`.
    """
    s, h, f, v = model.seq_len, model.hidden_size, model.ffn_hidden_size, model.vocab_size
    kv = model.num_kv_heads * model.head_dim
    per_token = dtype_bytes / tp
    block = s * (6 * h + 2 * kv + 3 * f) * per_token
    return [s * h * per_token] + [block] * model.num_blocks + [s * (h + v) * per_token]


def _with_load(st: StageTimes, m: int, extra: int, inline_w: int) -> StageTimes:
    """Per-micro-batch times of a peer running ``m + extra`` forwards and input-gradient
    passes and ``m + inline_w`` weight-gradient passes in ``m`` 1F1B slots."""
    half = st.bwd_s / 2
    return dataclasses.replace(
        st,
        fwd_s=st.fwd_s * (m + extra) / m,
        bwd_s=(half * (m + extra) + half * (m + inline_w)) / m,
    )


def recycle_step(
    plan: Plan,
    failed: Collection[int],
    *,
    model: ModelConfig,
    layers: Sequence[LayerCost],
    device: DeviceSpec,
    tp: int,
    slowdowns: Mapping[int, float] | None = None,
) -> RecycleStep:
    """ReCycle's step time on ``plan`` with ``failed`` ranks re-routed.

    Raises Unrecoverable when a stage has no surviving peer, and OutOfMemory when a
    peer's activations and deferred state pass ``device.memory_bytes``.
    """
    failed = set(failed)
    m = plan.num_micro_batches
    p = plan.pp
    base = stage_times(plan, layers, device, slowdowns=slowdowns)
    lost = [sum(r in failed for r in s.ranks) for s in plan.stages]
    extra = []
    for s, f in zip(plan.stages, lost, strict=True):
        if f == s.dp:
            raise Unrecoverable(f"stage {s.stage} lost all {s.dp} ranks: no peer to re-route to")
        extra.append(-(-f * m // (s.dp - f)))
    # What a peer of each stage holds before any deferral, and what one deferral adds.
    wgrad = weight_grad_bytes_per_sample(model, tp=tp)
    memory = []
    for s, f in zip(plan.stages, lost, strict=True):
        mb = max(s.sizes)
        stage_layers = [layers[i] for i in s.layers]
        own = stage_memory(
            stage_layers, micro_batch=mb, dp=s.dp, stage=s.stage, num_stages=p,
            num_micro_batches=m,
        )  # fmt: skip
        rerouted = -(-f * min(p - s.stage, m) // (s.dp - f))
        act = mb * rerouted * sum(c.activation_bytes_per_sample for c in stage_layers)
        per_w = mb * sum(wgrad[i] for i in s.layers)
        memory.append((own, act, per_w))
        if f and own + act > device.memory_bytes:
            raise OutOfMemory(
                f"ReCycle runs out of memory on stage {s.stage}: a peer holds "
                f"{(own + act) / GIB:.1f} GiB ({own / GIB:.1f} of its own, {act / GIB:.1f} for "
                f"{rerouted} re-routed micro-batches in flight) of "
                f"{device.memory_bytes / GIB:.0f} GiB before deferring any weight gradient"
            )
    # Pass 1: every re-routed W deferred; the idle time left is each stage's bubble budget.
    first = simulate_step([_with_load(t, m, e, 0) for t, e in zip(base, extra, strict=True)], m)
    window = max(first.compute_end_s)
    deferred = []
    for t, e, busy, (own, act, per_w) in zip(base, extra, first.busy_s, memory, strict=True):
        half = t.bwd_s / 2
        fit_time = math.floor(max(0.0, window - busy) / half) if half > 0 else e
        fit_memory = math.floor((device.memory_bytes - own - act) / per_w) if per_w > 0 else e
        deferred.append(max(0, min(e, fit_time, fit_memory)))
    # Pass 2: the rest in line; the deferred passes end the stage's compute.
    loaded = [_with_load(t, m, e, e - k) for t, e, k in zip(base, extra, deferred, strict=True)]
    second = simulate_step(loaded, m)
    step = max(
        max(end, busy + k * t.bwd_s / 2) + t.sync_s
        for end, busy, k, t in zip(second.compute_end_s, second.busy_s, deferred, base, strict=True)
    )
    loads = tuple(
        PeerLoad(s.stage, f, s.dp - f, e, k, own + act + k * per_w)
        for s, f, e, k, (own, act, per_w) in zip(
            plan.stages, lost, extra, deferred, memory, strict=True
        )
        if f
    )
    return RecycleStep(step, loads)
