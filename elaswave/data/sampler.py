"""Global batch -> (replica, micro-batch, slice) slots.

Step ``t`` trains global samples ``[t*B, (t+1)*B)``. They form ``M`` global micro-batches
of ``B/M`` consecutive ids, and each pipeline stage splits every global micro-batch among
its DP replicas by contiguous slices whose sizes may differ (micro-batch resizing after a
failure gives some replicas more). A sample therefore keeps its id, and with it its data
and its dropout masks, whichever replica runs it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Slot:
    """The samples one replica runs in one micro-batch of one step."""

    replica: int
    micro_batch: int
    start: int
    """First global sample id."""
    stop: int
    """One past the last global sample id."""

    @property
    def sample_ids(self) -> range:
        return range(self.start, self.stop)

    @property
    def size(self) -> int:
        return self.stop - self.start


def even_split(total: int, parts: int) -> tuple[int, ...]:
    """Split ``total`` into ``parts`` sizes differing by at most one, larger first."""
    if parts < 1:
        raise ValueError(f"cannot split into {parts} parts")
    base, extra = divmod(total, parts)
    return tuple(base + (1 if p < extra else 0) for p in range(parts))


def spread_split(total: int, parts: int) -> tuple[int, ...]:
    """Split ``total`` into ``parts`` sizes differing by at most one, the larger spread
    evenly (the first is a larger one): part ``i`` is ``ceil((i+1) total / parts) -
    ceil(i total / parts)``, so any ``w`` consecutive parts, read cyclically, sum to
    ``floor`` or ``ceil`` of ``w total / parts``."""
    if parts < 1:
        raise ValueError(f"cannot split into {parts} parts")
    ceil = [-(-i * total // parts) for i in range(parts + 1)]
    return tuple(b - a for a, b in itertools.pairwise(ceil))


@dataclass(frozen=True)
class GlobalBatchSampler:
    global_batch: int
    num_micro_batches: int

    def __post_init__(self) -> None:
        if self.num_micro_batches < 1 or self.global_batch % self.num_micro_batches:
            raise ValueError(
                f"global batch {self.global_batch} does not split into "
                f"{self.num_micro_batches} equal micro-batches"
            )

    @property
    def micro_batch_samples(self) -> int:
        """Samples in one global micro-batch (summed over a stage's replicas)."""
        return self.global_batch // self.num_micro_batches

    def step_ids(self, step: int) -> range:
        return range(step * self.global_batch, (step + 1) * self.global_batch)

    def slots(self, step: int, replica_sizes: Sequence[int]) -> list[list[Slot]]:
        """Slots of every replica (outer) and micro-batch (inner) for ``replica_sizes``.

        ``replica_sizes[r]`` is replica r's share of each global micro-batch; the sizes must
        sum to :attr:`micro_batch_samples`. Zero sizes are allowed (an empty slot).
        """
        if sum(replica_sizes) != self.micro_batch_samples or min(replica_sizes) < 0:
            raise ValueError(
                f"replica sizes {list(replica_sizes)} must be non-negative and sum to "
                f"{self.micro_batch_samples}"
            )
        out: list[list[Slot]] = [[] for _ in replica_sizes]
        for mb in range(self.num_micro_batches):
            start = step * self.global_batch + mb * self.micro_batch_samples
            for replica, size in enumerate(replica_sizes):
                out[replica].append(Slot(replica, mb, start, start + size))
                start += size
        return out
