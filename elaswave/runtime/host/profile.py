"""Measured layer costs: time every layer of the job's model and price it for the planners.

The planners price a layer by FLOPs (:func:`elaswave.engine.cost.layer_costs`, Llama
formulas), which says little about a Hugging Face model's real kernels or a CPU's. Before
a job starts, :func:`profile_layers` builds each layer in turn with the job's seed, runs
its forward and backward on one micro-batch (a warm-up, then the median of ``repeats``
timed runs), and records the bytes autograd saves during the forward (each storage once)
and the bytes of the output. :meth:`LayerProfile.costs` converts the seconds into the
cost model's :class:`~elaswave.engine.cost.LayerCost` for a device at its base clock,
``flops = seconds x device.flops_per_s(base_mhz)``, so that the planners, pricing on
that device, reproduce the measured seconds.

The job carries the converted costs (:attr:`~elaswave.runtime.job.config.JobConfig.profile`,
in job.json) so that the Core, every worker and replay plan with the same numbers; the
measurements themselves go to RUN_DIR/profile.json (:meth:`LayerProfile.to_dict`), which
``elaswave sim --profile`` prices on the simulated device.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import structlog
import torch

from elaswave.engine.cost import DeviceSpec, LayerCost, LayerKind, layer_costs
from elaswave.fabric.remap import FP32_BYTES
from elaswave.model.llama import StepContext
from elaswave.model.protocol import pipeline_model
from elaswave.model.rng import make_rng

if TYPE_CHECKING:
    from elaswave.runtime.job.config import JobConfig

log = structlog.get_logger(__name__)

SCHEMA_VERSION = 1
"""Of profile.json."""


@dataclass(frozen=True, kw_only=True)
class LayerMeasurement:
    """What one layer was measured to cost, per sample of ``seq_len`` tokens."""

    index: int
    """Global layer index."""
    kind: LayerKind
    """Embedding, block or head, as the cost model names it."""
    params: int
    """Parameters of the layer."""
    fwd_s_per_sample: float
    """Median forward seconds of a micro-batch, divided by its samples."""
    bwd_s_per_sample: float
    """Median backward seconds of a micro-batch, divided by its samples."""
    activation_bytes_per_sample: float
    """Bytes of the tensors autograd saved for the backward (each storage once)."""
    output_bytes_per_sample: float
    """Bytes of the output (0 for the head, which sends nothing on)."""

    def cost(self, device: DeviceSpec) -> LayerCost:
        """The cost model's view: seconds at ``device``'s base clock as FLOPs."""
        rate = device.flops_per_s(device.base_mhz)
        return LayerCost(
            index=self.index,
            kind=self.kind,
            params=self.params,
            fwd_flops_per_sample=self.fwd_s_per_sample * rate,
            bwd_flops_per_sample=self.bwd_s_per_sample * rate,
            activation_bytes_per_sample=self.activation_bytes_per_sample,
            output_bytes_per_sample=self.output_bytes_per_sample,
        )


@dataclass(frozen=True, kw_only=True)
class LayerProfile:
    """Every layer of a model, measured on one device."""

    layers: tuple[LayerMeasurement, ...]
    """One per layer, in index order."""
    total_s: float
    """Wall-clock seconds the profiling took (building the layers included)."""
    device: str
    """The torch device the layers ran on (``cpu``, ``cuda:0``)."""
    micro_batch: int
    """Samples per timed micro-batch."""
    repeats: int
    """Timed runs per layer (the median is kept)."""

    def costs(self, device: DeviceSpec) -> tuple[LayerCost, ...]:
        """The layers priced on ``device`` at its base clock."""
        return tuple(layer.cost(device) for layer in self.layers)

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> LayerProfile:
        """Read profile.json's content; ValueError naming what is wrong."""
        if not isinstance(raw, dict) or raw.get("schema_version") != SCHEMA_VERSION:
            version = raw.get("schema_version") if isinstance(raw, dict) else None
            raise ValueError(
                f"profile schema_version {version!r}: expected {SCHEMA_VERSION} "
                "(a profile.json that elaswave train --profile on wrote)"
            )
        try:
            layers = tuple(
                LayerMeasurement(**{**layer, "kind": LayerKind(layer["kind"])})
                for layer in raw["layers"]
            )
            profile = cls(
                layers=layers,
                total_s=float(raw["total_s"]),
                device=str(raw["device"]),
                micro_batch=int(raw["micro_batch"]),
                repeats=int(raw["repeats"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a layer profile: {type(exc).__name__}: {exc}") from None
        for position, layer in enumerate(layers):
            if layer.index != position:
                raise ValueError(f"profile layer at position {position} has index {layer.index}")
        return profile


def _median_s(run: Callable[[], object], *, repeats: int, sync: Callable[[], None]) -> float:
    run()  # warm-up: allocator, kernel selection, lazy initialisation
    sync()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _backward_s(
    forward: Callable[[], torch.Tensor],
    loss_of: Callable[[torch.Tensor], torch.Tensor],
    *,
    repeats: int,
    sync: Callable[[], None],
) -> float:
    """Median seconds of the backward alone (each run after its own untimed forward)."""

    def once() -> float:
        loss = loss_of(forward())
        sync()
        started = time.perf_counter()
        loss.backward()
        sync()
        return time.perf_counter() - started

    once()  # warm-up
    return statistics.median(once() for _ in range(repeats))


def _key(tensor: torch.Tensor) -> tuple[str, int]:
    return (str(tensor.device), tensor.untyped_storage().data_ptr())


def _saved_bytes(
    layer: torch.nn.Module, forward: Callable[[], torch.Tensor]
) -> tuple[torch.Tensor, int]:
    """Run ``forward``; return its output and the bytes of every storage autograd saved
    for the backward, each counted once (views of one tensor share a storage), less the
    layer's own parameters and buffers (the cost model counts those apart)."""
    own = {_key(t) for t in (*layer.parameters(), *layer.buffers())}
    storages: dict[tuple[str, int], int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = _key(tensor)
        if key not in own:
            storages[key] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = forward()
    return out, sum(storages.values())


def profile_layers(cfg: JobConfig, *, device: torch.device, repeats: int = 5) -> LayerProfile:
    """Measure every layer of ``cfg``'s model on ``device`` (see the module docstring).

    Layers are built one at a time with the job's seed and freed after, so the device
    needs room for one layer and one micro-batch of ``cfg.schedule.micro_batch`` samples.
    On a CPU the layers run on one thread, as every worker does.
    """
    if repeats < 1:
        raise ValueError(f"repeats = {repeats}: must be at least 1")
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)  # as every worker runs (elaswave.runtime.worker.process)
    try:
        return _profile(cfg, device=device, repeats=repeats)
    finally:
        torch.set_num_threads(threads)


def _profile(cfg: JobConfig, *, device: torch.device, repeats: int) -> LayerProfile:
    started = time.perf_counter()
    model = pipeline_model(cfg.model)
    formulas = layer_costs(cfg.model, dtype_bytes=FP32_BYTES)
    mb, shape = cfg.schedule.micro_batch, cfg.model
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(cfg.schedule.seed)
    tokens = torch.randint(0, shape.vocab_size, (mb, shape.seq_len), generator=gen)
    targets = torch.randint(0, shape.vocab_size, (mb, shape.seq_len), generator=gen).to(device)
    hidden = torch.randn(mb, shape.seq_len, shape.hidden_size, generator=gen).to(device)
    ctx = StepContext(
        step=0,
        sample_ids=tuple(range(mb)),
        rng=make_rng("counter", seed=0, rank=0),
        training=True,
    )
    measured = []
    for formula in formulas:
        index = formula.index
        layer = model.build_layer(index, seed=cfg.schedule.seed).to(device)
        layer.train()
        params = sum(p.numel() for p in layer.parameters())
        if params != formula.params:
            raise ValueError(
                f"layer {index} ({formula.kind}) has {params} parameters, the cost model "
                f"counts {formula.params}: the model's shape ({cfg.model.source or 'built-in'}) "
                "does not match its ModelConfig"
            )
        head = index == shape.num_layers - 1
        x = tokens.to(device) if index == 0 else hidden.detach().requires_grad_(True)

        def forward(layer: torch.nn.Module = layer, x: torch.Tensor = x) -> torch.Tensor:
            out: torch.Tensor = layer(x, ctx)
            return out

        def loss_of(out: torch.Tensor, *, head: bool = head) -> torch.Tensor:
            return model.per_sample_loss(out, targets).sum() if head else out.float().sum()

        fwd_s = _median_s(lambda: forward().detach(), repeats=repeats, sync=sync)
        bwd_s = _backward_s(forward, loss_of, repeats=repeats, sync=sync)
        out, saved = _saved_bytes(layer, forward)
        out_bytes = 0 if head else out.numel() * out.element_size()
        del out
        measured.append(
            LayerMeasurement(
                index=index,
                kind=formula.kind,
                params=params,
                fwd_s_per_sample=fwd_s / mb,
                bwd_s_per_sample=bwd_s / mb,
                activation_bytes_per_sample=saved / mb,
                output_bytes_per_sample=out_bytes / mb,
            )
        )
        del layer, x
        if device.type == "cuda":
            torch.cuda.empty_cache()
    total = time.perf_counter() - started
    profile = LayerProfile(
        layers=tuple(measured),
        total_s=total,
        device=str(device),
        micro_batch=mb,
        repeats=repeats,
    )
    log.info(
        "profile.done",
        layers=len(measured),
        seconds=round(total, 3),
        device=str(device),
        fwd_ms=[round(m.fwd_s_per_sample * mb * 1e3, 3) for m in measured],
        bwd_ms=[round(m.bwd_s_per_sample * mb * 1e3, 3) for m in measured],
    )
    assert all(math.isfinite(m.fwd_s_per_sample) for m in measured)
    return profile
