"""Ring groups and the dynamic communicator on real gloo processes, with a real SIGKILL.

Workers are forked from a forkserver that has imported torch, report through a queue and
leave with ``os._exit`` (a process group must not be destroyed under a parked wait).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from benchmarks.rebuild import RebuildingCommunicator, RebuildStrategy
from elaswave.comm.backend import GlooBackend
from elaswave.comm.communicator import Communicator
from elaswave.comm.dynamic import DynamicCommunicator, shrink_specs
from elaswave.comm.group import Group
from elaswave.comm.links import PairGroup
from elaswave.comm.ring import RingGroup
from elaswave.comm.spec import CommError, GroupSpec
from elaswave.comm.store import connect_store, serve_store
from elaswave.logs import configure

CTX = mp.get_context("forkserver")
CTX.set_forkserver_preload(["torch", "torch.distributed", "benchmarks.rebuild"])

TIMEOUT = timedelta(seconds=3)
"""Bounded waits in the workers: a dead peer must surface as CommError within it."""


def _barrier(store: dist.Store, key: str, count: int, timeout_s: float = 30.0) -> None:
    if store.add(key, 1) == count:
        store.set(f"{key}/all", "1")
    store.wait([f"{key}/all"], timedelta(seconds=timeout_s))


def _entry(target: Callable[..., Any], rank: int, port: int, queue: Any, args: tuple) -> None:
    configure()
    try:
        store = connect_store("127.0.0.1", port)
        queue.put((rank, "ok", target(rank, store, *args)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        queue.close()
        queue.join_thread()
        os._exit(0)


class Job:
    """``world`` worker processes running ``target(rank, store, *args)``; store in the parent."""

    def __init__(self, target: Callable[..., Any], world: int, *args: Any) -> None:
        self.store = serve_store()
        self.queue = CTX.Queue()
        self.procs = [
            CTX.Process(target=_entry, args=(target, r, self.store.port, self.queue, args))
            for r in range(world)
        ]
        for proc in self.procs:
            proc.start()

    def results(self, count: int, timeout_s: float) -> dict[int, Any]:
        out, deadline = {}, time.monotonic() + timeout_s
        while len(out) < count:
            rank, status, value = self.queue.get(timeout=max(0.1, deadline - time.monotonic()))
            assert status == "ok", f"rank {rank} failed:\n{value}"
            out[rank] = value
        return out

    def close(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)


# --------------------------------------------------------------------------- (a) numerics


def _compare_with_gloo(rank: int, store: dist.Store) -> dict[str, float]:
    backend = GlooBackend()
    _barrier(store, "up", 4)
    order = (2, 0, 3, 1)
    specs = [
        GroupSpec("dp.s0", order),  # a ring of 4, in a member order that is not sorted
        GroupSpec("dp.pair.a", (1, 0)),  # two rings of 2
        GroupSpec("dp.pair.b", (3, 2)),
        GroupSpec("dp.solo", (rank,)),
    ]
    gloo = Communicator(store, rank, backend, timeout=TIMEOUT)
    gloo.build([GroupSpec(f"gloo.{s.name}", s.ranks) for s in specs if rank in s.ranks])
    dyn = DynamicCommunicator(store, rank, backend, timeout=TIMEOUT)
    dyn.build([s for s in specs if rank in s.ranks])
    gen = torch.Generator().manual_seed(1234 + rank)
    worst = 0.0
    for name in ("dp.s0", "dp.pair.a" if rank < 2 else "dp.pair.b", "dp.solo"):
        ring, ref = dyn[name], gloo[f"gloo.{name}"]
        assert isinstance(ring, RingGroup)
        assert isinstance(ref, Group)
        assert (ring.size, ring.index) == (ref.size, ref.index)
        size = ring.size
        for numel in (5, 1000):
            x = torch.randn(size * numel, generator=gen)
            got, want = torch.empty(numel), torch.empty(numel)
            ring.reduce_scatter(got, x.clone())
            ref.reduce_scatter(want, x.clone())
            torch.testing.assert_close(got, want)
            worst = max(worst, (got - want).abs().max().item())
            y = torch.randn(numel, generator=gen)
            got, want = torch.empty(size * numel), torch.empty(size * numel)
            ring.all_gather(got, y)
            ref.all_gather(want, y)
            assert torch.equal(got, want)
        for shape in ((7,), (2,), (1,), (33, 65)):
            x = torch.randn(shape, generator=gen)
            got, want = x.clone(), x.clone()
            ring.all_reduce(got)
            ref.all_reduce(want)
            torch.testing.assert_close(got, want)
            worst = max(worst, (got - want).abs().max().item())
        # a non-contiguous tensor, and integers (exact)
        base = torch.randn(6, 10, generator=gen)
        got, want = base.clone().t(), base.clone().t()
        ring.all_reduce(got)
        ref.all_reduce(want)
        torch.testing.assert_close(got, want)
        ints = torch.arange(12, dtype=torch.int64) * (rank + 1)
        got, want = ints.clone(), ints.clone()
        ring.all_reduce(got)
        ref.all_reduce(want)
        assert torch.equal(got, want)
        out = torch.empty(size * 3, dtype=torch.int64)
        ring.all_gather(out.view(size, 3), torch.full((3,), rank))
        assert out.view(size, 3)[:, 0].tolist() == list(ring.spec.ranks)
        # Started collectives, several in flight, waited in reverse: the same results
        # as the blocking ones; a reduce-scatter's input is left as it was.
        for group in (ring, ref):
            inputs = [torch.randn(size * n, generator=gen) for n in (4, 1, 300)]
            kept = [x.clone() for x in inputs]
            outs = [torch.empty(x.numel() // size) for x in inputs]
            shards = [torch.randn(n, generator=gen) for n in (2, 50)]
            gathered = [torch.empty(size * y.numel()) for y in shards]
            works = [group.reduce_scatter_async(o, x) for o, x in zip(outs, inputs, strict=True)]
            works += [group.all_gather_async(g, y) for g, y in zip(gathered, shards, strict=True)]
            assert group.tainted or size == 1  # until every started collective is waited
            for work in reversed(works):
                work.wait()
            assert not group.tainted
            for x, k, o in zip(inputs, kept, outs, strict=True):
                assert torch.equal(x, k)
                want = torch.empty_like(o)
                group.reduce_scatter(want, k.clone())
                assert torch.equal(o, want)
            for g, y in zip(gathered, shards, strict=True):
                want = torch.empty_like(g)
                group.all_gather(want, y)
                assert torch.equal(g, want)
        ring.barrier()
    return {"worst_abs_diff": worst}


@pytest.mark.timeout(60)
def test_ring_collectives_equal_gloo() -> None:
    job = Job(_compare_with_gloo, 4)
    try:
        results = job.results(4, timeout_s=45)
    finally:
        job.close()
    assert max(r["worst_abs_diff"] for r in results.values()) < 1e-5


# --------------------------------------------------------------------------- (b) SIGKILL

# 6 ranks: a ring of 4 (stage 0), a ring of 2 (stage 1), two pipeline links.
SPECS = [
    GroupSpec("dp.s0", (0, 1, 2, 3)),
    GroupSpec("dp.s1", (4, 5)),
    GroupSpec("link.0-4", (0, 4)),
    GroupSpec("link.1-5", (1, 5)),
]
VICTIM = 1


def _survive_kill(rank: int, store: dist.Store, strategy: str) -> dict[str, Any]:
    _barrier(store, "up", 6)
    dyn = RebuildingCommunicator(store, rank, GlooBackend(), timeout=TIMEOUT)
    dyn.build([s for s in SPECS if rank in s.ranks])
    if rank < 4:
        ones = torch.ones(8)
        dyn["dp.s0"].all_reduce(ones)
        assert ones.tolist() == [4.0] * 8
    before = {name: dyn[name] for name in dyn.names}
    _barrier(store, "built", 6)
    if rank == VICTIM:
        store.set("victim/pid", str(os.getpid()))
        time.sleep(60)  # killed while the others wait on it
    detected: dict[str, Any] = {}
    store.add("waiting", 1)
    try:
        if rank in (0, 2, 3):
            dyn["dp.s0"].all_reduce(torch.ones(8))
        elif rank == 5:
            group = dyn["link.1-5"]
            assert isinstance(group, PairGroup)
            group.recv(torch.empty(4), VICTIM, 7)
    except CommError as exc:
        detected = {"at": time.time(), "error": str(exc)}
    assert dyn.comm.tainted() == (["dp.s0"] if rank in (0, 2, 3) else []), dyn.comm.tainted()
    if rank != 4:
        assert detected, f"rank {rank}: the collective did not fail"
        detected["after_kill_s"] = detected["at"] - float(store.get("killed_at"))

    _barrier(store, "recovering", 5)
    stats = dyn.apply_by(RebuildStrategy(strategy), shrink_specs(SPECS, {VICTIM}), removed={VICTIM})

    # The next collectives over the survivors are correct.
    if rank in (0, 2, 3):
        ring = dyn["dp.s0"]
        assert ring.spec.ranks == (0, 2, 3)
        x = torch.arange(9, dtype=torch.float32) * (rank + 1)
        ring.all_reduce(x)
        assert x.tolist() == (torch.arange(9) * 8).tolist()  # (0+1) + (2+1) + (3+1)
        out = torch.empty(3)
        ring.reduce_scatter(out, torch.full((9,), float(rank)))
        assert out.tolist() == [5.0] * 3
    if rank in (4, 5):
        ones = torch.ones(3)
        dyn["dp.s1"].all_reduce(ones)
        assert ones.tolist() == [2.0] * 3
    if rank in (0, 4):
        link = dyn["link.0-4"]
        assert isinstance(link, Group | PairGroup)
        peer = 4 - rank
        buf = torch.empty(2)
        work = link.isend(torch.full((2,), float(rank)), peer, 11)
        link.recv(buf, peer, 11)
        link.wait_send(work)
        assert buf.tolist() == [float(peer)] * 2
    assert dyn.get("link.1-5") is None
    assert dyn.comm.tainted() == []
    same = sorted(name for name in dyn.names if dyn[name] is before.get(name))
    return {
        "stats": stats.to_dict(),
        "detected": detected,
        "same_objects": same,
        "types": {name: type(dyn[name]).__name__ for name in dyn.names},
    }


def _kill_and_recover(strategy: RebuildStrategy) -> dict[int, dict[str, Any]]:
    job = Job(_survive_kill, 6, str(strategy))
    try:
        store = job.store
        store.wait(["victim/pid"], timedelta(seconds=30))
        deadline = time.monotonic() + 30
        while store.add("waiting", 0) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # let the others block in their collectives
        pid = int(store.get("victim/pid"))
        assert pid == job.procs[VICTIM].pid
        os.kill(pid, signal.SIGKILL)
        store.set("killed_at", repr(time.time()))
        job.procs[VICTIM].join(5)
        assert job.procs[VICTIM].exitcode == -signal.SIGKILL
        return job.results(5, timeout_s=30)
    finally:
        job.close()


def _check_detection(results: dict[int, dict[str, Any]]) -> None:
    bound = TIMEOUT.total_seconds()
    for rank in (0, 2, 3, 5):
        detected = results[rank]["detected"]
        assert detected["after_kill_s"] < bound + 2.0, (rank, detected)
    # The dead rank's neighbours see it at once, not at the timeout.
    for rank in (0, 2, 5):
        assert results[rank]["detected"]["after_kill_s"] < bound - 1.0, results[rank]


@pytest.mark.timeout(60)
def test_sigkill_then_edit_creates_one_link_and_reuses_the_rest() -> None:
    results = _kill_and_recover(RebuildStrategy.EDIT)
    _check_detection(results)
    stats = {rank: r["stats"] for rank, r in results.items()}
    assert {rank: s["links_created"] for rank, s in stats.items()} == {0: 1, 2: 1, 3: 0, 4: 0, 5: 0}
    assert results[0]["types"] == {"dp.s0": "RingGroup", "link.0-4": "PairGroup"}
    assert results[0]["same_objects"] == ["link.0-4"]
    assert results[3]["same_objects"] == []
    assert results[4]["same_objects"] == ["dp.s1", "link.0-4"]
    assert results[5]["same_objects"] == ["dp.s1"]
    # link.1-5 was a view over the pooled link (1, 5): the link goes with rank 1.
    assert stats[5]["groups_dropped"] == 1 and stats[5]["links_retired"] == 1
    assert stats[2]["links_retired"] == 1 and stats[2]["links_reused"] == 1


@pytest.mark.timeout(60)
def test_sigkill_then_partial_rebuilds_the_affected_group() -> None:
    results = _kill_and_recover(RebuildStrategy.PARTIAL)
    _check_detection(results)
    assert results[0]["types"] == {"dp.s0": "Group", "link.0-4": "PairGroup"}
    assert results[4]["same_objects"] == ["dp.s1", "link.0-4"]
    created = {rank: r["stats"]["links_created"] for rank, r in results.items()}
    assert created == {0: 2, 2: 2, 3: 2, 4: 0, 5: 0}


@pytest.mark.timeout(60)
def test_sigkill_then_full_rebuilds_everything() -> None:
    results = _kill_and_recover(RebuildStrategy.FULL)
    _check_detection(results)
    assert all(r["same_objects"] == [] for r in results.values())
    assert results[4]["types"] == {"dp.s1": "Group", "link.0-4": "Group"}
    # The global group over the 5 survivors (4 connections each), then every group.
    created = {rank: r["stats"]["links_created"] for rank, r in results.items()}
    assert created == {0: 4 + 3, 2: 4 + 2, 3: 4 + 2, 4: 4 + 2, 5: 4 + 1}


# ------------------------------------------------------- (c) abandoned point-to-point


def _abandon_and_talk(rank: int, store: dist.Store) -> dict[str, float]:
    """A receive and a send posted and dropped unwaited (as an abandoned step leaves
    them), on a pooled link and on a gloo group; the groups then carry both of those
    messages and later ones."""
    _barrier(store, "up", 2)
    backend = GlooBackend()
    dyn = DynamicCommunicator(store, rank, backend, timeout=TIMEOUT)
    dyn.build([GroupSpec("link.0-1", (0, 1))])
    gloo = Communicator(store, rank, backend, timeout=TIMEOUT)
    gloo.build([GroupSpec("pg.0-1", (0, 1))])
    got: dict[str, float] = {}
    for group in (dyn["link.0-1"], gloo["pg.0-1"]):
        assert isinstance(group, PairGroup | Group)
        peer = 1 - rank
        if rank == 0:  # posts a receive and drops it; its sender then sends
            group.irecv(torch.empty(1000), peer, 1)
        _barrier(store, f"{group.name}/recv-posted", 2)
        if rank == 1:
            group.wait_send(group.isend(torch.full((1000,), 1.0), peer, 1))
            group.isend(torch.full((1000,), 2.0), peer, 2)  # dropped unwaited
        _barrier(store, f"{group.name}/send-posted", 2)
        if rank == 0:
            buf = torch.empty(1000)
            group.recv(buf, peer, 2)  # the dropped send is still delivered
            got[f"{group.name}/dropped-send"] = buf[0].item()
        out, buf = torch.full((4,), 10.0 + rank), torch.empty(4)
        work = group.isend(out, peer, 3)
        group.recv(buf, peer, 3)  # and the link still carries later messages
        group.wait_send(work)
        got[f"{group.name}/later"] = buf[0].item()
    _barrier(store, "done", 2)
    return got


@pytest.mark.timeout(60)
def test_a_send_or_receive_dropped_unwaited_does_not_stall_its_link() -> None:
    """gloo keeps a posted operation's buffer only through its Work: a Work freed before
    it completed used to stall its pair for good (chaos seed 33, case 85)."""
    job = Job(_abandon_and_talk, 2)
    try:
        results = job.results(2, timeout_s=45)
    finally:
        job.close()
    for name in ("link.0-1", "pg.0-1"):
        assert results[0][f"{name}/dropped-send"] == 2.0
        assert results[0][f"{name}/later"] == 11.0
        assert results[1][f"{name}/later"] == 10.0
