"""Graph planner (paper §4.2, Alg. 1): contiguous layers per stage by minimax DP.

Given the mini-step time ``T[p, a, b]`` and the per-rank memory ``M[p, a, b]`` of stage
``p`` running layers ``[a, b)`` (see :func:`elaswave.engine.cost.segment_tables`), find
the partition of the ``L`` layers into ``P`` non-empty contiguous stages that fits every
stage's memory cap and minimises the slowest stage's mini-step time. Pure: a function of
the tables, returning a :class:`Partition` with a human-readable reason.

Ties are broken deterministically: of all feasible partitions whose slowest stage is
optimal, the planner returns the one whose boundaries are lexicographically smallest
(earlier stages take as few layers as the optimum allows). Every process that runs the
planner on the same inputs therefore gets the same plan.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from elaswave.engine.cost import DeviceSpec, LayerCost, StageSpec, segment_tables
from elaswave.fabric.remap import FP32_BYTES, STATE_TENSORS

__all__ = ["Infeasible", "Partition", "minimax_partition", "plan_layers"]

FloatArray = npt.NDArray[np.float64]


class Infeasible(ValueError):
    """No partition of the layers over the stages fits every stage's memory cap."""


@dataclass(frozen=True)
class Partition:
    """Contiguous layers per stage and what they cost."""

    counts: tuple[int, ...]
    """Layers per stage, each at least 1, summing to the number of layers."""
    boundaries: tuple[int, ...]
    """Stage ``p`` runs layers ``[boundaries[p], boundaries[p + 1])``; ``P + 1`` entries."""
    bottleneck_s: float
    """The slowest stage's mini-step time, seconds: the optimum of the minimax."""
    stage_times: tuple[float, ...]
    """Each stage's mini-step time, seconds."""
    stage_memory: tuple[float, ...]
    """Each stage's per-rank memory, bytes."""
    reason: str
    """Which stage is the bottleneck and why no other partition does better."""

    @property
    def bottleneck_stage(self) -> int:
        """The first stage whose mini-step time is the bottleneck."""
        return self.stage_times.index(self.bottleneck_s)


def _fmt_s(seconds: float) -> str:
    return f"{seconds * 1e3:.4g} ms" if seconds < 1.0 else f"{seconds:.4g} s"


def _fmt_bytes(num_bytes: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= size:
            return f"{num_bytes / size:.4g} {unit}"
    return f"{num_bytes:.4g} B"


def _layers(start: int, stop: int) -> str:
    return f"layer {start}" if stop - start == 1 else f"layers {start}-{stop - 1}"


def _check_tables(times: FloatArray, memory: FloatArray, caps: Sequence[float]) -> None:
    if times.ndim != 3 or times.shape[1] != times.shape[2] or times.shape != memory.shape:
        raise ValueError(
            f"times {times.shape} and memory {memory.shape} must both be [P, L+1, L+1] tables"
        )
    num_stages, num_layers = times.shape[0], times.shape[1] - 1
    if len(caps) != num_stages:
        raise ValueError(f"{len(caps)} memory caps for {num_stages} stages")
    if not all(cap > 0 for cap in caps):
        raise ValueError(f"memory caps {list(caps)}: every cap must be positive")
    if num_stages < 1 or num_layers < num_stages:
        raise ValueError(
            f"{num_stages} stages need at least as many layers, the tables have {num_layers}"
        )
    upper = np.triu(np.ones((num_layers + 1, num_layers + 1), dtype=bool), k=1)
    if np.isnan(times[:, upper]).any() or np.isnan(memory[:, upper]).any():
        raise ValueError("times or memory hold NaN for a segment")


def _minimax(table: FloatArray) -> float:
    """Optimal max over stages of ``table`` over all P-way partitions (inf if none)."""
    num_stages, num_layers = table.shape[0], table.shape[1] - 1
    best = table[0, 0, :]  # best[l]: stages 0..p over layers [0, l)
    for stage in range(1, num_stages):
        best = np.maximum(best[:, None], table[stage]).min(axis=0)
    return float(best[num_layers])


def _smallest_boundaries(table: FloatArray, bound: float) -> tuple[int, ...]:
    """Lexicographically smallest boundaries whose every segment is at most ``bound``."""
    num_stages, num_layers = table.shape[0], table.shape[1] - 1
    fits = table <= bound
    # rest[p, a]: layers [a, L) can be split over stages p..P-1 within the bound.
    rest = np.zeros((num_stages, num_layers + 1), dtype=bool)
    rest[-1] = fits[-1, :, num_layers]
    for stage in range(num_stages - 2, -1, -1):
        rest[stage] = (fits[stage] & rest[stage + 1][None, :]).any(axis=1)
    assert rest[0, 0], "the bound must be attainable"
    boundaries, start = [0], 0
    for stage in range(num_stages - 1):
        start = int(np.argmax(fits[stage, start] & rest[stage + 1]))
        boundaries.append(start)
    boundaries.append(num_layers)
    return tuple(boundaries)


def _solve(table: FloatArray) -> tuple[float, tuple[int, ...]] | None:
    optimum = _minimax(table)
    if not math.isfinite(optimum):
        return None
    return optimum, _smallest_boundaries(table, optimum)


def minimax_partition(
    times: npt.ArrayLike, memory: npt.ArrayLike, caps: Sequence[float]
) -> Partition:
    """The memory-feasible partition with the smallest slowest-stage mini-step time.

    ``times`` and ``memory`` are ``[P, L+1, L+1]`` tables: entry ``[p, a, b]`` prices
    stage ``p`` running layers ``[a, b)``; entries with ``a >= b`` are ignored. Segments
    whose memory exceeds ``caps[p]`` (bytes) or whose time is infinite are excluded
    first; then ``f_p[l] = min_k max(f_{p-1}[k], T[p, k, l])`` is computed one stage at
    a time as a vectorised ``[L+1, L+1]`` operation. Of the optimal partitions, the one
    with lexicographically smallest boundaries is returned, found by a backward
    reachability pass under the optimal bound and a greedy forward pass. ``O(P L^2)``.

    Raises :class:`Infeasible` naming the stages that cannot fit and the memory they
    would need.
    """
    t_table = np.asarray(times, dtype=np.float64)
    m_table = np.asarray(memory, dtype=np.float64)
    _check_tables(t_table, m_table, caps)
    num_layers = t_table.shape[1] - 1
    cap = np.asarray(caps, dtype=np.float64)
    upper = np.triu(np.ones((num_layers + 1, num_layers + 1), dtype=bool), k=1)
    usable = upper[None] & (m_table <= cap[:, None, None]) & np.isfinite(t_table)
    solved = _solve(np.where(usable, t_table, np.inf))
    if solved is None:
        raise Infeasible(_infeasible_reason(t_table, m_table, cap, upper))
    optimum, boundaries = solved
    spans = list(itertools.pairwise(boundaries))
    stage_times = tuple(float(t_table[p, a, b]) for p, (a, b) in enumerate(spans))
    stage_memory = tuple(float(m_table[p, a, b]) for p, (a, b) in enumerate(spans))
    assert max(stage_times) == optimum
    return Partition(
        counts=tuple(b - a for a, b in spans),
        boundaries=boundaries,
        bottleneck_s=optimum,
        stage_times=stage_times,
        stage_memory=stage_memory,
        reason=_bottleneck_reason(t_table, m_table, cap, boundaries, stage_times),
    )


def _bottleneck_reason(
    times: FloatArray,
    memory: FloatArray,
    caps: FloatArray,
    boundaries: tuple[int, ...],
    stage_times: tuple[float, ...],
) -> str:
    num_stages = len(stage_times)
    optimum = max(stage_times)
    stage = stage_times.index(optimum)
    start, stop = boundaries[stage], boundaries[stage + 1]
    head = (
        f"stage {stage} ({_layers(start, stop)}) is the bottleneck at {_fmt_s(optimum)} "
        "per mini-step"
    )
    ties = [p for p, t in enumerate(stage_times) if t == optimum and p != stage]
    if ties:
        head += f", tied with stage{'s' if len(ties) > 1 else ''} {', '.join(map(str, ties))}"
    if num_stages == 1:
        return f"{head}: it is the only stage"
    others = [t for t in stage_times if t != optimum]
    if others:
        head += f" (other stages {_fmt_s(min(others))} to {_fmt_s(max(others))})"
    if stop - start == 1:
        return f"{head}; it runs a single layer, which no partition can split"
    moves = []
    for peer, layer in ((stage - 1, start), (stage + 1, stop - 1)):
        if not 0 <= peer < num_stages:
            continue
        # The peer's segment after taking the layer.
        lo, hi = (boundaries[peer], start + 1) if peer < stage else (stop - 1, boundaries[peer + 1])
        need, cap = float(memory[peer, lo, hi]), float(caps[peer])
        if not math.isfinite(float(times[peer, lo, hi])):
            what = "leave it a segment the tables give no finite time"
        elif need > cap:
            what = f"exceed its memory cap ({_fmt_bytes(need)} > {_fmt_bytes(cap)})"
        else:
            what = f"take it to {_fmt_s(float(times[peer, lo, hi]))}"
        moves.append(f"giving layer {layer} to stage {peer} would {what}")
    return f"{head}; {' and '.join(moves)}"


def _infeasible_reason(
    times: FloatArray, memory: FloatArray, caps: FloatArray, upper: npt.NDArray[np.bool_]
) -> str:
    num_stages, num_layers = times.shape[0], times.shape[1] - 1
    priced = upper[None] & np.isfinite(times)
    stuck = []
    for stage in range(num_stages):
        # Segments stage p can hold in some partition: every stage keeps >= 1 layer, the
        # first starts at layer 0 and the last ends at layer L.
        first = np.arange(num_layers + 1)
        lo, hi = stage, num_layers - (num_stages - 1 - stage)
        starts = (first >= lo) & (first < hi) & ((first == 0) | (stage > 0))
        stops = (first > lo) & (first <= hi) & ((first == num_layers) | (stage < num_stages - 1))
        allowed = priced[stage] & starts[:, None] & stops[None, :]
        window = np.where(allowed, memory[stage], np.inf)
        smallest = float(window.min())
        if math.isinf(smallest):
            stuck.append(f"stage {stage} has no segment with a finite time")
        elif smallest > caps[stage]:
            a, b = (int(i) for i in np.unravel_index(int(np.argmin(window)), window.shape))
            stuck.append(
                f"stage {stage} cannot hold any layer: its smallest choice "
                f"({_layers(a, b)}) needs {_fmt_bytes(smallest)}, "
                f"cap {_fmt_bytes(float(caps[stage]))}"
            )
    if stuck:
        return "no partition fits the memory caps: " + "; ".join(stuck)
    # Every stage fits something alone, not all at once: show the partition that comes
    # closest (smallest worst ratio of need to cap) and where it overflows.
    ratio = np.where(priced, memory / caps[:, None, None], np.inf)
    solved = _solve(ratio)
    if solved is None:
        return f"no partition of {num_layers} layers over {num_stages} stages has finite times"
    _, boundaries = solved
    over = []
    for stage, (a, b) in enumerate(itertools.pairwise(boundaries)):
        need = float(memory[stage, a, b])
        if need > caps[stage]:
            over.append(
                f"stage {stage} needs {_fmt_bytes(need)} for {_layers(a, b)}, "
                f"cap {_fmt_bytes(float(caps[stage]))}"
            )
    counts = [b - a for a, b in itertools.pairwise(boundaries)]
    return (
        f"no partition of {num_layers} layers over {num_stages} stages fits the memory caps; "
        f"the closest, {counts} layers per stage, still overflows: " + "; ".join(over)
    )


def plan_layers(
    model_layers: Sequence[LayerCost],
    stages: Sequence[StageSpec],
    device: DeviceSpec,
    *,
    sigma_f: float | Sequence[float] = 0.0,
    sigma_b: float | Sequence[float] = 0.0,
    num_micro_batches: int | None = None,
    param_bytes: float = FP32_BYTES,
    optimizer_bytes: float = STATE_TENSORS * FP32_BYTES,
) -> Partition:
    """Price every segment with :func:`~elaswave.engine.cost.segment_tables` and solve.

    Memory caps are the stages' ``memory_cap_bytes``; the keyword arguments go to the
    table builder. The reason names the bottleneck stage's width, micro-batch, clock and
    slowdown.
    """
    times, memory = segment_tables(
        model_layers,
        stages,
        device,
        sigma_f=sigma_f,
        sigma_b=sigma_b,
        num_micro_batches=num_micro_batches,
        param_bytes=param_bytes,
        optimizer_bytes=optimizer_bytes,
    )
    partition = minimax_partition(times, memory, [s.memory_cap_bytes for s in stages])
    spec = stages[partition.bottleneck_stage]
    detail = (
        f" (stage {partition.bottleneck_stage}: dp {spec.dp}, micro-batch {spec.micro_batch}, "
        f"{spec.mhz:g} MHz on {device.name}, slowdown {spec.slowdown:g}x)"
    )
    return dataclasses.replace(partition, reason=partition.reason + detail)
