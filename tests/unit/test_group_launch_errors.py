"""A backend's refusal at launch is a failure to recover from, as a failed wait is.

NCCL refuses a launch on a communicator whose proxy saw a peer's connection close
(``ncclRemoteError``, raised by torch as ``DistBackendError``, a RuntimeError); on the
GPU such a refusal, escaping as a plain error, ended a survivor instead of starting a
recovery. A batch whose posting fails half-way must still be closed: NCCL's group
belongs to the thread, and one left open broke the next communicator's connection."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elaswave.comm.communicator import Communicator
from elaswave.comm.group import Group
from elaswave.comm.spec import CommError, GroupSpec
from elaswave.comm.strict import (
    StrictBackend,
    StrictProcessGroup,
    StrictViolation,
    refuse_creation,
    refuse_open_batch,
)


class RefusingBackend:
    """A backend whose every launch is refused, as NCCL's after a remote error."""

    supports_coalescing = True

    def __init__(self) -> None:
        self.open = False
        self.closed = 0

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("ncclRemoteError: remote process exited")

    allreduce = _reduce_scatter_base = _allgather_base = send = recv = _refuse

    def _start_coalescing(self) -> None:
        self.open = True

    def _end_coalescing(self) -> None:
        self.open = False
        self.closed += 1
        raise RuntimeError("ncclRemoteError: remote process exited")


def _group(pg: Any) -> Group:
    return Group(GroupSpec("dp.s0", (0, 1)), pg, 0, timedelta(seconds=1))


@pytest.mark.parametrize(
    "launch",
    [
        lambda g: g.all_reduce(torch.ones(2)),
        lambda g: g.reduce_scatter(torch.ones(1), torch.ones(2)),
        lambda g: g.all_gather(torch.ones(2), torch.ones(1)),
        lambda g: g.reduce_scatter_async(torch.ones(1), torch.ones(2)),
        lambda g: g.all_gather_async(torch.ones(2), torch.ones(1)),
        lambda g: g.batch([(torch.ones(1), 1)], [], tag=3),
    ],
    ids=["all_reduce", "reduce_scatter", "all_gather", "rs_async", "ag_async", "batch"],
)
def test_a_refused_launch_is_a_comm_error(launch: Any) -> None:
    group = _group(RefusingBackend())
    with pytest.raises(CommError, match="remote process exited"):
        launch(group)


def test_a_refused_collective_leaves_the_group_tainted() -> None:
    group = _group(RefusingBackend())
    with pytest.raises(CommError):
        group.reduce_scatter_async(torch.ones(1), torch.ones(2))
    assert group.tainted


def test_a_batch_that_fails_half_way_is_closed() -> None:
    pg = RefusingBackend()
    with pytest.raises(CommError):
        _group(pg).batch([(torch.ones(1), 1)], [(torch.zeros(1), 1)], tag=3)
    assert not pg.open and pg.closed == 1


def _on_own_thread(fn: Any) -> None:
    """Run ``fn`` on a thread of its own (the strict device's per-thread state stays
    there), re-raising its error."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    if errors:
        raise errors[0]


def _solo(name: str) -> Any:
    gloo: Any = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=5))
    return StrictProcessGroup(gloo, 0, 1, name)


def test_a_strict_batch_left_open_refuses_the_threads_next_communicator() -> None:
    def body() -> None:
        strict = _solo("solo")
        strict._start_coalescing()
        with pytest.raises(StrictViolation, match="still open on this thread"):
            refuse_creation("creating communicator 'next'")
        strict._end_coalescing()
        refuse_creation("creating communicator 'next'")  # closed: allowed

    _on_own_thread(body)


def test_after_a_failed_batch_communicators_are_created_on_a_fresh_thread() -> None:
    """A batch that fails half-way leaves torch's count of the thread's NCCL groups one
    too high for good (on the GPU: "ncclGroupEnd: not in a group call" when the next
    plan's communicator connected): the strict device refuses creating a communicator
    on that thread, and the Communicator creates its groups on fresh threads."""

    def body() -> None:
        strict = _solo("failing")
        strict._failed = "remote process exited"  # what its stream records when a peer goes
        with pytest.raises(CommError):
            Group(GroupSpec("pair", (0, 1)), strict, 0, timedelta(seconds=1)).batch(
                [(torch.ones(1), 1)], [], tag=3
            )
        refuse_open_batch("a batch")  # the batch was closed
        with pytest.raises(StrictViolation, match="failed half-way"):
            StrictBackend().create(dist.HashStore(), 0, 1, timedelta(seconds=5), name="next")
        comm = Communicator(dist.HashStore(), 0, StrictBackend(), timeout=timedelta(seconds=5))
        comm.build([GroupSpec("next", (0,))])
        assert comm.names == ["next"]

    _on_own_thread(body)
