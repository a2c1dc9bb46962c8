"""What a communication group is, without torch: the values the pure engine plans with.

The devices a job can run on, a group's spec (name and members), the ranges of
point-to-point tags each kind of traffic takes, and the error a failed operation
raises. :mod:`elaswave.comm.group` builds groups from them; the planners
(:mod:`elaswave.engine`), the Core's change protocol and the simulator use them without
loading ``torch.distributed``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


class Device(enum.StrEnum):
    CPU = "cpu"
    CPU_STRICT = "cpu-strict"
    """CPU processes whose training traffic keeps NCCL's rules (:mod:`elaswave.comm.strict`):
    what the GPU path needs, checked where no GPU is."""
    CUDA = "cuda"
    NPU = "npu"
    EMULATED = "emulated"
    """CPU processes over gloo that keep the time of a modelled accelerator."""


DEVICES = tuple(d.value for d in Device)


def parse_device(value: str) -> Device:
    try:
        return Device(value)
    except ValueError:
        raise ValueError(f"unknown device {value!r}; valid devices: {', '.join(DEVICES)}") from None


class CommError(RuntimeError):
    """A collective or point-to-point operation failed or timed out."""

    def __init__(self, group: str, op: str, cause: BaseException | str) -> None:
        super().__init__(f"{op} on group {group!r} failed: {cause}")
        self.group = group
        self.op = op


@dataclass(frozen=True)
class GroupSpec:
    """A group's name and its members, as global ranks in group order."""

    name: str
    ranks: tuple[int, ...]
    p2p: tuple[tuple[int, int], ...] = ()
    """The (sender, receiver) pairs of its point-to-point traffic, connected when the
    group is built (under NCCL the first batch on a communicator needs every member:
    :meth:`elaswave.comm.group.Group.connect`). Empty for collective-only groups."""
    collectives: bool = False
    """It runs collectives (a stage's data-parallel group, a TP group): connected for them
    when built, where a backend connects inside a first collective
    (:meth:`elaswave.comm.group.Group.warm`)."""

    def __post_init__(self) -> None:
        if len(set(self.ranks)) != len(self.ranks) or not self.ranks:
            raise ValueError(f"group {self.name!r}: ranks {self.ranks} must be distinct, non-empty")
        strangers = {r for pair in self.p2p for r in pair} - set(self.ranks)
        if strangers:
            raise ValueError(f"group {self.name!r}: p2p pairs name non-members {sorted(strangers)}")


class TagSpace(enum.IntEnum):
    """Where each kind of point-to-point traffic starts in a step's 14-bit tag index.

    A pooled link serves every purpose of its pair (pipeline route, snapshot, recovery
    transfers), so each purpose keeps to its own range of indexes.
    """

    SNAPSHOT = 0
    """A step's reduced gradient shard, owner to snapshot holder."""
    SNAPSHOT_STATE = 1
    """Recovery: a shard's whole committed state, owner to its new holder."""
    REMAP = 2
    """Recovery: live-remap transfer ``i`` uses ``REMAP + i`` (up to 4094 transfers)."""
    PIPELINE = 4096
    """Activations and gradients: ``PIPELINE + 2 * micro_batch + backward`` (up to
    ``(STREAM - PIPELINE) // 2`` = 5120 micro-batches)."""
    STREAM = 14336
    """Non-blocking migration: layer parameter stream ``i`` uses ``STREAM + i``."""
    PAYBACK = 15360
    """Non-blocking migration: shadow gradient payback ``i`` uses ``PAYBACK + i``."""


MAX_MICRO_BATCHES = (TagSpace.STREAM - TagSpace.PIPELINE) // 2
"""Micro-batches one step may have: each takes two pipeline tags (forward, backward)."""


def p2p_tag(generation: int, step: int, index: int) -> int:
    """A point-to-point tag unique per (plan generation, step, index) within a window.

    A receive abandoned by an aborted step can then never match a message of the step
    redone under the next plan generation.
    """
    if not 0 <= index < 1 << 14:
        raise ValueError(f"p2p tag index {index} out of range [0, 16384)")
    if TagSpace.REMAP + 4094 < index < TagSpace.PIPELINE:
        raise ValueError(f"p2p tag index {index} falls between tag spaces")
    return ((generation % 64) << 24) | ((step % 1024) << 14) | index


def members(specs: Sequence[GroupSpec], rank: int) -> list[GroupSpec]:
    return [s for s in specs if rank in s.ranks]
