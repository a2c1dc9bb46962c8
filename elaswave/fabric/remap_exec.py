"""Executing a live-remap plan: move optimizer-state element ranges rank to rank.

Every survivor of the affected DP group calls :func:`execute_remap` with the same plan.
Each transfer carries the three fp32 state tensors (master, exp_avg, exp_avg_sq) of an
element range; local device ranges are copied, others sent over a pairwise link, all
sends posted before any receive so that no ordering can deadlock.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from elaswave.comm.group import P2PLink
from elaswave.comm.spec import TagSpace, p2p_tag
from elaswave.fabric.adamw import ShardState
from elaswave.fabric.hostplane import as_host, host_empty
from elaswave.fabric.layout import InterleavedLayout
from elaswave.fabric.remap import RemapPlan, Source


def remap_link_name(a: int, b: int) -> str:
    lo, hi = sorted((a, b))
    return f"remap.{lo}-{hi}"


def _offsets(layout: InterleavedLayout) -> dict[int, tuple[int, int]]:
    """layer -> (offset in a rank's shard vector, shard size)."""
    return {layer: (lo, hi - lo) for layer, lo, hi in layout.shard_slices()}


def vector_offset(layout: InterleavedLayout, layer: int, lo: int) -> int:
    """Where element ``lo`` of ``layer``'s flat state sits in its owner's shard vector."""
    base, size = _offsets(layout)[layer]
    return base + lo - (lo // size) * size


@dataclass(frozen=True)
class RemapResult:
    state: ShardState
    """This rank's new shard over the new layout (decay mask left empty)."""
    bytes_sent: int
    """Bytes this rank handed to point-to-point sends (a counter, not the plan)."""


def execute_remap(
    plan: RemapPlan,
    *,
    rank: int,
    old_layout: InterleavedLayout,
    new_layout: InterleavedLayout,
    device_state: ShardState | None,
    host_states: Mapping[int, ShardState],
    host_layouts: Mapping[int, InterleavedLayout] | None = None,
    link: Callable[[int, int], P2PLink],
    generation: int,
    step: int,
    device: torch.device,
) -> RemapResult:
    """Run the transfers that involve ``rank``; return its new shard over ``new_layout``.

    ``old_layout`` and ``device_state`` are this rank's committed layout and shard
    (``device_state`` None if it owned nothing); ``host_states`` maps an old owner rank
    to the snapshot this rank holds for it, and ``host_layouts`` that owner's committed
    layout (its stage may be another one; default ``old_layout``). The new shard is
    made on ``device``; what crosses ranks travels in host-plane buffers.
    """
    host_layouts = host_layouts or {}
    out = [torch.zeros(new_layout.shard_numel, device=device) for _ in range(3)]
    sends, recvs, bytes_sent = [], [], 0
    for index, t in enumerate(plan.transfers):
        if t.src != rank and t.dst != rank:
            continue
        n_lo = vector_offset(new_layout, t.layer, t.lo) if t.dst == rank else -1
        if t.src == rank:
            if t.kind is Source.DEVICE:
                state, layout = device_state, old_layout
            else:
                state, layout = host_states[t.owner], host_layouts.get(t.owner, old_layout)
            o_lo = vector_offset(layout, t.layer, t.lo)
            assert state is not None, f"rank {rank} has no state for transfer {t}"
            piece = torch.stack(
                [x[o_lo : o_lo + t.numel] for x in (state.master, state.exp_avg, state.exp_avg_sq)]
            )
            if t.dst == rank:
                for dst, src in zip(out, piece, strict=True):
                    dst[n_lo : n_lo + t.numel] = src
                continue
            group = link(t.src, t.dst)
            piece = as_host(piece)  # a stack of its own: marked, or copied off the device
            bytes_sent += piece.numel() * piece.element_size()
            sends.append(
                (
                    group,
                    group.isend(piece, t.dst, p2p_tag(generation, step, TagSpace.REMAP + index)),
                    piece,
                )
            )
        else:
            recvs.append((index, t, n_lo))
    for index, t, n_lo in recvs:
        buf = host_empty((3, t.numel))
        link(t.src, t.dst).recv(buf, t.src, p2p_tag(generation, step, TagSpace.REMAP + index))
        for dst, src in zip(out, buf, strict=True):
            dst[n_lo : n_lo + t.numel] = src
    for group, work, _ in sends:
        group.wait_send(work)
    return RemapResult(
        ShardState(out[0], out[1], out[2], torch.zeros(0, device=device)), bytes_sent
    )
