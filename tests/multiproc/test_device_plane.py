"""The device plane under NCCL's rules (``cpu-strict``), on real processes with a real
SIGKILL: a failure leaves survivors' batches parked; releasing the plane aborts the
groups that hold the dead rank or parked work, fast, and leaves the others usable; the
next generation rebuilds the aborted ones."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elaswave.comm.abort import AbortSignal, StepAborted
from elaswave.comm.communicator import Communicator
from elaswave.comm.spec import CommError, GroupSpec
from elaswave.comm.strict import StrictBackend
from elaswave.runtime.worker.early_release import EarlyRelease
from tests.multiproc.test_dynamic_comm import Job, _barrier

TIMEOUT = timedelta(seconds=20)
SPECS = [GroupSpec("fwd.s0", (0, 1, 2)), GroupSpec("dp.s0", (0, 1))]


def _plane(rank: int, store: dist.Store, generation: int, specs: list[GroupSpec]) -> Communicator:
    plane = Communicator(
        store, rank, StrictBackend(), timeout=TIMEOUT, generation=generation, prefix="dev/"
    )
    plane.build(s for s in specs if rank in s.ranks)
    return plane


def _survive_a_kill(rank: int, store: dist.Store) -> dict[str, object]:
    plane = _plane(rank, store, 0, SPECS)
    group, world = plane.group("fwd.s0"), 3
    got = torch.zeros(1)
    ring = group.batch(
        [(torch.full((1,), float(rank)), (rank + 1) % world)], [(got, (rank - 1) % world)], 0
    )
    group.wait_recv(ring)
    assert got.item() == float((rank - 1) % world)
    _barrier(store, "exchanged", world)
    if rank == 2:
        time.sleep(60)  # killed here by the test
    # Survivors post a receive from rank 2 that will never come, then it is killed.
    parked = group.batch([], [(torch.zeros(1), 2)], 1)
    store.set(f"parked/{rank}", "1")
    store.wait(["killed"], timedelta(seconds=60))  # as the Core would announce
    tainted_before = plane.tainted()
    released = plane.release([2])
    with pytest.raises(CommError, match="aborted"):
        group.wait_recv(parked)  # the abort ended it
    dp = plane.group("dp.s0")
    x = torch.full((2,), float(rank + 1))
    dp.all_reduce(x)  # an untouched group is still usable
    new, reused = plane.edit(
        [GroupSpec("fwd.s0", (0, 1)), SPECS[1]], generation=1, rebuild=lambda s: False
    )
    y = torch.ones(1)
    new.group("fwd.s0").all_reduce(y)
    return {
        "tainted_before": tainted_before,
        "aborted": released.aborted,
        "release_s": released.seconds,
        "sum": x.tolist(),
        "rebuilt": y.item(),
        "reused": reused,
        "count": len(new),
    }


def test_release_aborts_only_what_parks_and_the_next_generation_rebuilds_it() -> None:
    job = Job(_survive_a_kill, 3)
    try:
        deadline = time.monotonic() + 60
        while not all(job.store.check([f"parked/{r}"]) for r in (0, 1)):
            assert time.monotonic() < deadline, "survivors never parked their receives"
            time.sleep(0.05)
        pid = job.procs[2].pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        job.store.set("killed", "2")
        out = job.results(2, timeout_s=90)
    finally:
        job.close()
    for rank in (0, 1):
        r = out[rank]
        assert r["tainted_before"] == ["fwd.s0"]  # parked work taints under NCCL's rules
        assert r["aborted"] == ("fwd.s0",)  # dp.s0 (idle, no dead member) is kept
        assert isinstance(r["release_s"], float) and r["release_s"] < 1.0
        assert r["sum"] == [3.0, 3.0]
        assert r["rebuilt"] == 2.0
        assert (r["reused"], r["count"]) == (1, 2)


def _survivors(target: Callable[[int, dist.Store], dict[str, Any]]) -> dict[int, Any]:
    """What ranks 0 and 1 of a three-process job running ``target`` return (rank 2 is
    the one that fails)."""
    job = Job(target, 3)
    try:
        return job.results(2, timeout_s=60)
    finally:
        job.close()


def _hang_before_the_first_collective(rank: int, store: dist.Store) -> dict[str, float]:
    abort = AbortSignal()
    plane = Communicator(
        store, rank, StrictBackend(launch_timeout_s=20), timeout=TIMEOUT, abort=abort,
        prefix="dev/",
    )  # fmt: skip
    plane.build([GroupSpec("dp.s0", (0, 1, 2), collectives=True)])
    _barrier(store, "built", 3)
    if rank == 2:
        time.sleep(60)  # hung before its first collective on the group; killed by the test
    threading.Timer(1.0, abort.set, args=("rank 2 hung",)).start()  # as the Core announces
    started = time.monotonic()
    with pytest.raises(StepAborted):
        plane.group("dp.s0").reduce_scatter(torch.zeros(1), torch.ones(3))
    return {"stopped_s": time.monotonic() - started}


def test_a_member_hung_before_a_groups_first_collective_holds_no_launch() -> None:
    """Under NCCL a collective algorithm connects inside its first launch, which waits for
    every member on the issuing thread and which no abort reaches: a member hung before a
    new group's first collective held the others there past the Core's stop deadline (an
    H100's churn). Groups are connected for their collectives when built, so the
    survivors' first collective of a step is an ordinary wait that an abort ends."""
    out = _survivors(_hang_before_the_first_collective)
    for rank in (0, 1):
        assert out[rank]["stopped_s"] < 5.0, out


def _held_behind_a_dead_peer(rank: int, store: dist.Store) -> dict[str, object]:
    plane = Communicator(store, rank, StrictBackend(), timeout=TIMEOUT, prefix="dev/")
    plane.build([GroupSpec("dp.s0", (0, 1, 2), collectives=True)])
    _barrier(store, "built", 3)
    if rank == 2:
        os._exit(0)  # dies once its groups are connected
    dp = plane.group("dp.s0")
    work = dp.pg.allreduce([torch.ones(1)], dist.AllreduceOptions())  # never completes
    early = EarlyRelease(plane.process_groups)
    threading.Timer(1.0, early.failed, args=([2],)).start()  # as the bus hears the Core
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="aborted"):
        work.wait(timedelta(seconds=30))  # held where no abort signal reaches (a device sync)
    return {"held_s": time.monotonic() - started, "aborted": dp.aborted}


def test_a_failure_heard_aborts_what_it_stalls_while_the_training_thread_is_held() -> None:
    """Under NCCL a collective whose peer is gone spins on the device, and the training
    thread can wait behind it where no abort signal reaches (a device allocation or sync):
    it never got to release the plane, and the job ended (a joiner in an H100's churn).
    The thread that hears the failure aborts the stalled groups itself."""
    out = _survivors(_held_behind_a_dead_peer)
    for rank in (0, 1):
        assert out[rank]["aborted"] is True, out
        assert 0.9 <= float(out[rank]["held_s"]) < 5.0, out  # type: ignore[arg-type]
