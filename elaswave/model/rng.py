"""Counter-based dropout randomness.

A dropout mask is a pure function of (seed, step, global sample id, layer index, site):
whichever rank, stage, micro-batch or batch position runs a sample, it draws the same
mask. This is what makes a run's numbers independent of the parallel layout, so that
micro-batch resizing and layer migration change nothing beyond float reduction order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from elaswave.model.config import RNG_KINDS

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """One round of SplitMix64: a bijective 64-bit mixer with good avalanche."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def stream_key(*counters: int) -> int:
    """Mix counters into one 64-bit key; order matters, collisions are 2^-64 events."""
    key = 0
    for c in counters:
        key = splitmix64(key ^ (c & _MASK64))
    return key


class DropoutRng(Protocol):
    """Source of dropout keep-masks for one micro-batch at one dropout site."""

    def keep_mask(
        self,
        *,
        step: int,
        sample_ids: Sequence[int],
        layer: int,
        site: int,
        sample_shape: tuple[int, ...],
        p: float,
        device: torch.device,
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class CounterRng:
    """Per-sample streams keyed by (seed, step, sample id, layer, site)."""

    seed: int

    def keep_mask(
        self,
        *,
        step: int,
        sample_ids: Sequence[int],
        layer: int,
        site: int,
        sample_shape: tuple[int, ...],
        p: float,
        device: torch.device,
    ) -> torch.Tensor:
        gen = torch.Generator(device="cpu")
        masks = []
        for sample in sample_ids:
            gen.manual_seed(stream_key(self.seed, step, sample, layer, site))
            masks.append(torch.rand(sample_shape, generator=gen) >= p)
        return torch.stack(masks).to(device)


class StatefulRng:
    """The baseline without RNG resharding: one generator per rank, consumed in execution
    order (as Megatron's RNG tracker does). Masks then depend on which rank runs which
    samples in which order, so a layout change alters them. Its state at the start of
    recent steps is kept so that a rolled-back step replays the same draws.
    """

    def __init__(self, seed: int, rank: int) -> None:
        self._gen = torch.Generator(device="cpu")
        self._gen.manual_seed(stream_key(seed, 0x57A7E, rank) & ((1 << 63) - 1))
        self._starts: dict[int, torch.Tensor] = {}

    def begin_step(self, step: int) -> None:
        self._starts[step] = self._gen.get_state()
        for old in sorted(self._starts)[:-3]:
            del self._starts[old]

    def rewind(self, step: int) -> None:
        """Back to the state at the start of ``step`` (after a rollback)."""
        if step in self._starts:
            self._gen.set_state(self._starts[step])

    def keep_mask(
        self,
        *,
        step: int,
        sample_ids: Sequence[int],
        layer: int,
        site: int,
        sample_shape: tuple[int, ...],
        p: float,
        device: torch.device,
    ) -> torch.Tensor:
        shape = (len(sample_ids), *sample_shape)
        return (torch.rand(shape, generator=self._gen) >= p).to(device)


def make_rng(kind: str, *, seed: int, rank: int) -> CounterRng | StatefulRng:
    if kind == "counter":
        return CounterRng(seed)
    if kind == "stateful":
        return StatefulRng(seed, rank)
    raise ValueError(f"rng = {kind!r}: valid values are {', '.join(RNG_KINDS)}")
