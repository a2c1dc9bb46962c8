"""Executing a live-remap plan: move optimizer-state element ranges rank to rank.

Every survivor of the affected DP group calls :func:`execute_remap` with the same plan.
Each transfer carries the three fp32 state tensors (master, exp_avg, exp_avg_sq) of an
element range; local device ranges are copied, others sent over a pairwise link, all
sends posted before any receive so that no ordering can deadlock.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from elaswave.comm.group import Group, TagSpace, p2p_tag
from elaswave.comm.links import PairGroup
from elaswave.fabric.layout import InterleavedLayout
from elaswave.fabric.remap import RemapPlan, Source
from elaswave.fabric.zero import ShardState


def remap_link_name(a: int, b: int) -> str:
    lo, hi = sorted((a, b))
    return f"remap.{lo}-{hi}"


def _offsets(layout: InterleavedLayout) -> dict[int, tuple[int, int]]:
    """layer -> (offset in a rank's shard vector, shard size)."""
    return {layer: (lo, hi - lo) for layer, lo, hi in layout.shard_slices()}


def execute_remap(
    plan: RemapPlan,
    *,
    rank: int,
    old_layout: InterleavedLayout,
    new_layout: InterleavedLayout,
    device_state: ShardState | None,
    host_states: Mapping[int, ShardState],
    link: Callable[[int, int], Group | PairGroup],
    generation: int,
    step: int,
) -> ShardState | None:
    """Run the transfers that involve ``rank``; return its new shard (None if not a target).

    ``device_state`` is this rank's own committed shard (if it was a member);
    ``host_states`` maps an old owner rank to the snapshot this rank holds for it.
    """
    old_off, new_off = _offsets(old_layout), _offsets(new_layout)
    out = None
    if rank in plan.new_ranks:
        size = new_layout.shard_numel
        out = [torch.zeros(size) for _ in range(3)]
    sends, recvs = [], []
    for index, t in enumerate(plan.transfers):
        if t.src != rank and t.dst != rank:
            continue
        o_base, o_size = old_off[t.layer]
        n_base, n_size = new_off[t.layer]
        o_lo = o_base + t.lo - (t.lo // o_size) * o_size
        n_lo = n_base + t.lo - (t.lo // n_size) * n_size
        if t.src == rank:
            owner = plan.old_ranks[t.lo // o_size]
            state = device_state if t.kind is Source.DEVICE else host_states[owner]
            assert state is not None, f"rank {rank} has no state for transfer {t}"
            piece = torch.stack(
                [x[o_lo : o_lo + t.numel] for x in (state.master, state.exp_avg, state.exp_avg_sq)]
            )
            if t.dst == rank:
                for dst, src in zip(out, piece, strict=True):
                    dst[n_lo : n_lo + t.numel] = src
                continue
            group = link(t.src, t.dst)
            piece = piece.contiguous()
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
        buf = torch.empty(3, t.numel)
        link(t.src, t.dst).recv(buf, t.src, p2p_tag(generation, step, TagSpace.REMAP + index))
        for dst, src in zip(out, buf, strict=True):
            dst[n_lo : n_lo + t.numel] = src
    for group, work, _ in sends:
        group.wait_send(work)
    if out is None:
        return None
    return ShardState(out[0], out[1], out[2], torch.zeros(0))
