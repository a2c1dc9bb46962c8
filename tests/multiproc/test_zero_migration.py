"""One layer's optimizer state migrated between two real stages of gloo processes.

2 x D workers (stage A = ranks 0..D-1, stage B = ranks D..2D-1) execute the contiguous
and the interleaved plan, forward (A's last layer becomes B's first) and backward (B's
first layer becomes A's last), over pooled pair links whose sends count their bytes.
The parent checks every rank's new frame against a brute-force oracle and the counted
bytes against the plan. Workers are forked from a forkserver, report through a queue and
leave with ``os._exit`` (a process group must not be destroyed under a parked wait).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from benchmarks.contiguous import (
    STATE_BYTES_PER_ELEMENT,
    ContiguousLayout,
    MigrationPlan,
    ZeroScheme,
    plan_contiguous_migration,
    plan_interleaved_stage_migration,
)
from benchmarks.migration_exec import CountingLink, execute_migration
from elaswave.comm.backend import GlooBackend
from elaswave.comm.links import LinkPool, PairGroup, pair
from elaswave.comm.spec import GroupSpec
from elaswave.comm.store import connect_store, serve_store
from elaswave.fabric.layout import InterleavedLayout
from elaswave.fabric.remap import shard_bounds
from elaswave.logs import configure

pytestmark = pytest.mark.timeout(120)

CTX = mp.get_context("forkserver")
CTX.set_forkserver_preload(["torch", "torch.distributed", "elaswave.comm.links"])

TIMEOUT = timedelta(seconds=20)
STAGE_A = [(0, 13), (1, 7), (2, 11)]
"""(layer, elements) of the first stage: 11 is no multiple of 2 or 3 (padding, uneven cuts)."""
STAGE_B = [(3, 9), (4, 5)]
CASES = [
    (scheme, forward)
    for scheme in (ZeroScheme.CONTIGUOUS, ZeroScheme.INTERLEAVED)
    for forward in (True, False)
]
"""(layout, direction): forward moves layer 2 from A to B, backward layer 3 from B to A."""


def rows(layer: int, lo: int, hi: int) -> np.ndarray:
    """Elements [lo, hi) of ``layer``'s state, [hi - lo, 3] fp32, unique and exact."""
    index = np.arange(lo, hi, dtype=np.float32)[:, None]
    return layer * 1000 + index * 4 + np.arange(3, dtype=np.float32)[None, :]


def stage_array(layer_numels: list[tuple[int, int]]) -> np.ndarray:
    return np.concatenate(
        [rows(layer, 0, n) for layer, n in layer_numels] or [np.zeros((0, 3), np.float32)]
    )


def blocks(layer_numels: list[tuple[int, int]], dp: int) -> list[np.ndarray]:
    """Contiguous blocks by plain slicing of the stage array: ``S = ceil(total / dp)``."""
    array = stage_array(layer_numels)
    size = -(-len(array) // dp)
    return [array[j * size : (j + 1) * size] for j in range(dp)]


def shard_vectors(layer_numels: list[tuple[int, int]], dp: int) -> list[np.ndarray]:
    """Every replica's interleaved shard vector: shard j of each layer, zero-padded to
    ``ceil(numel / dp)`` rows, layers in stage order."""
    out = []
    for j in range(dp):
        parts = [np.zeros((0, 3), np.float32)]
        for layer, numel in layer_numels:
            lo, hi = shard_bounds(numel, dp, j)
            shard = np.zeros((-(-numel // dp), 3), np.float32)
            shard[: hi - lo] = rows(layer, lo, hi)
            parts.append(shard)
        out.append(np.concatenate(parts))
    return out


def case_plan(dp: int, scheme: ZeroScheme, forward: bool) -> tuple[MigrationPlan, dict, dict]:
    """The plan, every rank's old frame and every rank's expected new frame."""
    ranks_a, ranks_b = list(range(dp)), list(range(dp, 2 * dp))
    if forward:
        src, dst, src_ranks, dst_ranks, layer = STAGE_A, STAGE_B, ranks_a, ranks_b, 2
    else:
        src, dst, src_ranks, dst_ranks, layer = STAGE_B, STAGE_A, ranks_b, ranks_a, 3
    numel = dict(src)[layer]
    src_new = [p for p in src if p[0] != layer]
    dst_new = [(layer, numel), *dst] if forward else [*dst, (layer, numel)]
    if scheme is ZeroScheme.CONTIGUOUS:
        plan = plan_contiguous_migration(
            ContiguousLayout.build(src, dp),
            ContiguousLayout.build(dst, dp),
            layer,
            src_ranks,
            dst_ranks,
        )
        frames = blocks
    else:
        plan = plan_interleaved_stage_migration(
            InterleavedLayout.build(src, dp),
            InterleavedLayout.build(dst, dp),
            layer,
            src_ranks,
            dst_ranks,
        )
        frames = shard_vectors
    old = dict(zip(src_ranks, frames(src, dp), strict=True))
    old |= dict(zip(dst_ranks, frames(dst, dp), strict=True))
    new = dict(zip(src_ranks, frames(src_new, dp), strict=True))
    new |= dict(zip(dst_ranks, frames(dst_new, dp), strict=True))
    return plan, old, new


def test_oracle_frames_agree_with_the_library_layouts() -> None:
    """The test's brute-force frames are what the library's layouts say they are."""
    for dp in (2, 3):
        layout = InterleavedLayout.build(STAGE_A, dp)
        flats = [torch.from_numpy(rows(layer, 0, numel)) for layer, numel in STAGE_A]
        for j, vector in enumerate(shard_vectors(STAGE_A, dp)):
            for col in range(3):
                want = layout.shard_of([f[:, col].contiguous() for f in flats], j)
                assert torch.equal(torch.from_numpy(vector[:, col].copy()), want)
        contiguous = ContiguousLayout.build(STAGE_A, dp)
        for (lo, hi), block in zip(contiguous.blocks(), blocks(STAGE_A, dp), strict=True):
            assert np.array_equal(block, stage_array(STAGE_A)[lo:hi])


def _migrate(rank: int, store: dist.Store, dp: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    plans = [case_plan(dp, scheme, forward) for scheme, forward in CASES]
    pairs = {p for plan, _, _ in plans for p in plan.pairs() if rank in p}
    pool = LinkPool(store, rank, GlooBackend(), timeout=TIMEOUT)
    pool.connect(pairs, generation=0)
    links = {
        p: CountingLink(
            PairGroup(GroupSpec(f"migrate.{p[0]}-{p[1]}", p), rank, pool, timeout=TIMEOUT)
        )
        for p in pairs
    }
    out: dict[str, Any] = {}
    for index, ((scheme, forward), (plan, old, _)) in enumerate(zip(CASES, plans, strict=True)):
        for link in links.values():
            link.reset()
        new = execute_migration(
            plan,
            rank=rank,
            old=torch.from_numpy(old[rank].copy()),
            link=lambda a, b: links[pair(a, b)],
            generation=index,
            step=0,
        )
        sent = {(rank, peer): n for link in links.values() for peer, n in link.sent_bytes.items()}
        out[f"{scheme}/{forward}"] = {"frame": new.numpy(), "sent": sent}
    return out


def _barrier(store: dist.Store, key: str, count: int) -> None:
    if store.add(key, 1) == count:
        store.set(f"{key}/all", "1")
    store.wait([f"{key}/all"], TIMEOUT)


def _entry(rank: int, port: int, world: int, dp: int, queue: Any) -> None:
    configure()
    try:
        store = connect_store("127.0.0.1", port)
        _barrier(store, "up", world)
        result = _migrate(rank, store, dp)
        _barrier(store, "done", world)  # nobody leaves while a peer may still talk to it
        queue.put((rank, "ok", result))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        queue.close()
        queue.join_thread()
        os._exit(0)


def _run(dp: int) -> dict[int, dict[str, Any]]:
    world = 2 * dp
    store = serve_store()
    queue = CTX.Queue()
    procs = [
        CTX.Process(target=_entry, args=(r, store.port, world, dp, queue)) for r in range(world)
    ]
    try:
        for proc in procs:
            proc.start()
        out, deadline = {}, time.monotonic() + 90
        while len(out) < world:
            rank, status, value = queue.get(timeout=max(0.1, deadline - time.monotonic()))
            assert status == "ok", f"rank {rank} failed:\n{value}"
            out[rank] = value
        return out
    finally:
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


@pytest.mark.parametrize("dp", [2, 3])
def test_migration_over_real_links_is_exact_and_sends_the_planned_bytes(dp: int) -> None:
    results = _run(dp)
    for scheme, forward in CASES:
        plan, _, want = case_plan(dp, scheme, forward)
        key = f"{scheme}/{forward}"
        for rank in range(2 * dp):
            got = results[rank][key]["frame"]
            assert got.dtype == np.float32 and np.array_equal(got, want[rank]), (key, rank)
        counted: dict[tuple[int, int], int] = {}
        for rank in range(2 * dp):
            counted |= results[rank][key]["sent"]
        planned = {p: n * STATE_BYTES_PER_ELEMENT for p, n in plan.pair_numel().items()}
        assert counted == planned, key
        assert sum(counted.values()) == plan.bytes(), key
        if scheme is ZeroScheme.INTERLEAVED:
            assert sum(counted.values()) == STATE_BYTES_PER_ELEMENT * plan.numel
        else:
            assert sum(counted.values()) > STATE_BYTES_PER_ELEMENT * plan.numel  # resharding
