"""Executing a layer-migration plan (:mod:`benchmarks.contiguous`) over p2p links.

Every rank of both stages calls :func:`execute_migration` with the same plan and its own
local frame: a tensor whose first dimension is the frame's elements and whose trailing
dimensions hold the per-element state (``[numel, 3]`` fp32 for master, exp_avg and
exp_avg_sq side by side, so that any element range is one contiguous message). Sends
are all posted before any receive, receives land directly in the new frame, and each
rank waits for its own sends last, so no ordering between ranks can deadlock.

:class:`CountingLink` wraps a link and counts the bytes actually handed to its sends;
the migration benchmark and its test report those counters, not the plan.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from benchmarks.contiguous import MigrationPlan
from elaswave.comm.group import P2PLink
from elaswave.comm.spec import TagSpace, p2p_tag

MAX_TRANSFERS = 4094
"""Transfers one plan may hold: transfer i uses tag index ``TagSpace.REMAP + i``."""


class CountingLink:
    """A point-to-point group that counts the bytes its sends carry, per receiving rank."""

    def __init__(self, inner: P2PLink) -> None:
        self.inner = inner
        self.sent_bytes: dict[int, int] = {}
        """Receiving global rank -> bytes handed to ``isend`` since the last reset."""

    def reset(self) -> None:
        self.sent_bytes.clear()

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> dist.Work:
        work = self.inner.isend(tensor, peer, tag)
        self.sent_bytes[peer] = (
            self.sent_bytes.get(peer, 0) + tensor.numel() * tensor.element_size()
        )
        return work

    def wait_send(self, work: dist.Work) -> None:
        self.inner.wait_send(work)

    def recv(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        self.inner.recv(tensor, peer, tag)


LinkLookup = Callable[[int, int], P2PLink]
"""(this rank, peer rank) -> the link that carries their traffic."""


def execute_migration(
    plan: MigrationPlan,
    *,
    rank: int,
    old: torch.Tensor,
    link: LinkLookup,
    generation: int,
    step: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run ``rank``'s part of ``plan``; return its new local frame.

    ``old``: the rank's frame before the migration, ``[plan.old_numel[rank], *row]`` and
    contiguous. The result is ``[plan.new_numel[rank], *row]`` of ``old``'s dtype; elements
    the plan does not write (interleaved padding) are zero. ``generation`` and ``step``
    make the tags unique (:func:`elaswave.comm.group.p2p_tag`): use a fresh pair for every
    migration that may overlap another on the same links. ``out``, when given, is the new
    frame to write into instead of a freshly zeroed one (same shape and dtype as the
    result; rows the plan does not write are left as they are).
    """
    if rank not in plan.old_numel:
        raise ValueError(f"rank {rank} is in neither stage of the plan {list(plan.ranks)}")
    if old.shape[0] != plan.old_numel[rank] or not old.is_contiguous():
        raise ValueError(
            f"rank {rank}: frame of shape {tuple(old.shape)} (contiguous: "
            f"{old.is_contiguous()}), the plan expects {plan.old_numel[rank]} contiguous rows"
        )
    if len(plan.transfers) > MAX_TRANSFERS:
        raise ValueError(f"{len(plan.transfers)} transfers exceed the {MAX_TRANSFERS} tags")
    shape = (plan.new_numel[rank], *old.shape[1:])
    if out is None:
        new = torch.zeros(shape, dtype=old.dtype)
    elif tuple(out.shape) != shape or out.dtype != old.dtype or not out.is_contiguous():
        raise ValueError(
            f"rank {rank}: out is {tuple(out.shape)} {out.dtype}, the plan needs a contiguous "
            f"{shape} {old.dtype}"
        )
    else:
        new = out
    sends = []
    for index, t in enumerate(plan.transfers):
        if t.src == rank:
            group = link(rank, t.dst)
            piece = old[t.src_offset : t.src_offset + t.numel]
            tag = p2p_tag(generation, step, TagSpace.REMAP + index)
            sends.append((group, group.isend(piece, t.dst, tag)))
    for copy in plan.local_copies:
        if copy.rank == rank:
            new[copy.dst_offset : copy.dst_offset + copy.numel] = old[
                copy.src_offset : copy.src_offset + copy.numel
            ]
    for index, t in enumerate(plan.transfers):
        if t.dst == rank:
            tag = p2p_tag(generation, step, TagSpace.REMAP + index)
            link(rank, t.src).recv(new[t.dst_offset : t.dst_offset + t.numel], t.src, tag)
    for group, work in sends:
        group.wait_send(work)
    return new
