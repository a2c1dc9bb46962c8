"""Which of a host's devices each of its workers takes: its local rank.

As under torchrun, every worker a host starts is told its ``LOCAL_RANK`` (which of the
host's devices is its own) and ``LOCAL_WORLD_SIZE`` (how many the host has for the
job). An elastic job starts workers after the first ones: a replacement for a lost one,
a joiner on a host that came back. Its process rank says nothing of which device is
free (rank 8 on an 8-device host has no device 8), so each host hands out local ranks
itself: a worker takes the lowest one no running worker of the host holds, and gives it
back when it exits. A tensor-parallel group's members, started on one host, take
distinct devices of that host.

A worker started by hand, without ``LOCAL_RANK``, takes the device of its process rank
(:func:`local_rank_of`): the first plan's ranks on one host.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

LOCAL_RANK_ENV = "LOCAL_RANK"
"""The worker's device on its host (torchrun's name)."""
LOCAL_WORLD_SIZE_ENV = "LOCAL_WORLD_SIZE"
"""How many devices its host has for the job (torchrun's name)."""


class LocalRanks:
    """A host's ``size`` devices and the workers (by process rank) holding them."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"a host's devices = {size}: must be at least 1")
        self.size = size
        self._held: dict[int, int] = {}
        """process rank -> local rank, for the workers running."""

    def take(self, rank: int) -> int:
        """Worker ``rank``'s local rank: the lowest none of the running workers holds
        (``size`` or more when every device is held: the worker's backend refuses a
        device the host does not have, naming both)."""
        if rank in self._held:
            return self._held[rank]
        held = set(self._held.values())
        local = next(i for i in range(len(held) + 1) if i not in held)
        self._held[rank] = local
        return local

    def release(self, rank: int) -> None:
        """Worker ``rank`` has exited: its device is free."""
        self._held.pop(rank, None)

    def env(self, rank: int) -> dict[str, str]:
        """The environment that tells worker ``rank`` its device (taking it)."""
        return {LOCAL_RANK_ENV: str(self.take(rank)), LOCAL_WORLD_SIZE_ENV: str(self.size)}

    @property
    def held(self) -> Mapping[int, int]:
        """process rank -> local rank of the workers running."""
        return dict(self._held)


def local_rank_of(process: int, environ: Mapping[str, str] = os.environ) -> int:
    """This worker's local rank: what its host told it, else its process rank."""
    text = environ.get(LOCAL_RANK_ENV)
    if text is None:
        return process
    try:
        local = int(text)
    except ValueError:
        local = -1
    if local < 0:
        raise ValueError(f"{LOCAL_RANK_ENV}={text!r}: must be a non-negative integer")
    return local
