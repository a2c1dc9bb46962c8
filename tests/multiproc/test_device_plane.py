"""The device plane under NCCL's rules (``cpu-strict``), on real processes with a real
SIGKILL: a failure leaves survivors' batches parked; releasing the plane aborts the
groups that hold the dead rank or parked work, fast, and leaves the others usable; the
next generation rebuilds the aborted ones."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from elaswave.comm.communicator import Communicator
from elaswave.comm.spec import CommError, GroupSpec
from elaswave.comm.strict import StrictBackend
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
