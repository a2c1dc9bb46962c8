"""A collective group's warm-up (run when it is built, where a backend connects inside a
first collective): each kind once per size, sized in all, whatever the group's size."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from elaswave.comm.backend import WARM_SIZES
from elaswave.comm.group import Group
from elaswave.comm.spec import GroupSpec


class _Done:
    def wait(self, timeout: timedelta | None = None) -> bool:
        return True


class _Recorder:
    """A backend that records what it is asked to run."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> _Done:
        self.calls.append(("all_reduce", tensors[0].numel()))
        return _Done()

    def _reduce_scatter_base(self, out: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> _Done:
        self.calls.append(("reduce_scatter", inp.numel()))
        return _Done()

    def _allgather_base(self, out: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> _Done:
        self.calls.append(("all_gather", out.numel()))
        return _Done()


def test_each_kind_runs_once_per_size_and_a_large_group_costs_no_more() -> None:
    for members in (2, 64, 1000):
        pg = _Recorder()
        spec = GroupSpec("dp.s0", tuple(range(members)), collectives=True)
        group = Group(spec, pg, 0, timedelta(seconds=5))  # type: ignore[arg-type]
        group.warm(WARM_SIZES)
        small, large = members, (WARM_SIZES[1] // members) * members
        assert pg.calls == [
            ("all_reduce", small), ("reduce_scatter", small), ("all_gather", small),
            ("all_reduce", large), ("reduce_scatter", large), ("all_gather", large),
        ]  # fmt: skip
        assert large <= WARM_SIZES[1]
