"""The ``cpu-strict`` backend keeps NCCL's rules: one test per rule, each showing that a
data plane breaking the rule is caught (wrong data, a refusal, or a hang ended only by
an abort). Two ranks run as two threads of this process over real gloo; the dead-peer
test kills a real process."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elaswave.comm.store import connect_store, serve_store
from elaswave.comm.strict import StrictProcessGroup, StrictViolation, StrictWork, mark_host

SHORT = timedelta(seconds=0.5)


def _pair(strict: bool = True) -> list[Any]:
    """Two connected members of one 2-rank group (rank 0, rank 1)."""
    store = dist.HashStore()
    pgs: list[Any] = [None, None]

    def make(rank: int) -> None:
        pg: Any = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=10))
        pgs[rank] = StrictProcessGroup(pg, rank, 2, f"pair{rank}", device=rank) if strict else pg

    _both(lambda: make(0), lambda: make(1))
    return pgs


def _both(rank0: Callable[[], Any], rank1: Callable[[], Any]) -> list[Any]:
    """Run each rank's part on its own thread; returns results, re-raises the first error."""
    out: list[Any] = [None, None]
    errors: list[BaseException] = []

    def run(rank: int, fn: Callable[[], Any]) -> None:
        try:
            out[rank] = fn()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r, f)) for r, f in enumerate((rank0, rank1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    return out


def _tag_swapped_exchange(pgs: list[Any]) -> torch.Tensor:
    """Rank 0 sends A (tag 5) then B (tag 7); rank 1 receives tag 7 first. Returns what
    rank 1's tag-7 receive got: B where tags match messages, A where they are ignored."""

    def sender() -> None:
        a, b = pgs[0].send([torch.tensor([1.0])], 1, 5), pgs[0].send([torch.tensor([2.0])], 1, 7)
        a.wait(timedelta(seconds=10))
        b.wait(timedelta(seconds=10))

    def receiver() -> torch.Tensor:
        first, second = torch.zeros(1), torch.zeros(1)
        w7 = pgs[1].recv([first], 0, 7)
        w5 = pgs[1].recv([second], 0, 5)
        w7.wait(timedelta(seconds=10))
        w5.wait(timedelta(seconds=10))
        return first

    return _both(sender, receiver)[1]


def test_tags_are_ignored_messages_match_in_order() -> None:
    assert _tag_swapped_exchange(_pair(strict=False)).item() == 2.0  # gloo: by tag
    assert _tag_swapped_exchange(_pair(strict=True)).item() == 1.0  # NCCL: first in, first out


def test_ungrouped_exchange_is_refused_a_batch_is_not() -> None:
    pgs = _pair()

    def ungrouped(rank: int) -> None:
        pgs[rank].send([torch.ones(1)], 1 - rank, 0)
        pgs[rank].recv([torch.zeros(1)], 1 - rank, 0)

    with pytest.raises(StrictViolation, match="ungrouped send"):
        _both(lambda: ungrouped(0), lambda: ungrouped(1))

    pgs = _pair()

    def batched(rank: int) -> float:
        got = torch.zeros(1)
        pgs[rank]._start_coalescing()
        pgs[rank].send([torch.full((1,), float(rank + 10))], 1 - rank, 0)
        pgs[rank].recv([got], 1 - rank, 0)
        pgs[rank]._end_coalescing().wait(timedelta(seconds=10))
        return got.item()

    assert _both(lambda: batched(0), lambda: batched(1)) == [11.0, 10.0]


def test_a_parked_wait_stalls_later_operations_until_abort() -> None:
    pgs = _pair()
    works: list[StrictWork] = []

    def parked() -> str:
        works.append(pgs[0].recv([torch.zeros(1)], 1, 0))  # rank 1 never sends
        later = pgs[0].allreduce([torch.ones(1)], dist.AllreduceOptions())
        with pytest.raises(RuntimeError, match="hangs"):
            later.wait(SHORT)  # rank 1 joins the all-reduce, but it is queued behind
        pgs[0].abort()
        with pytest.raises(RuntimeError, match="aborted"):
            later.wait(SHORT)
        with pytest.raises(RuntimeError, match="aborted"):
            works[0].wait(SHORT)
        with pytest.raises(RuntimeError, match="aborted communicator"):
            pgs[0].allreduce([torch.ones(1)], dist.AllreduceOptions())
        return "ok"

    def peer() -> None:
        work = pgs[1].allreduce([torch.ones(1)], dist.AllreduceOptions())
        with pytest.raises(RuntimeError, match="hangs"):
            work.wait(SHORT * 2)
        pgs[1].abort()

    assert _both(parked, peer)[0] == "ok"


def test_a_host_buffer_is_refused() -> None:
    pgs = _pair()
    snapshot = mark_host(torch.zeros(4))
    with pytest.raises(StrictViolation, match="host-plane buffer"):
        pgs[0].send([snapshot[2:]], 1, 0)  # a view shares the mark
    pgs[0].send([torch.zeros(4)], 1, 0)  # an unmarked tensor is taken


def test_a_second_issuing_thread_is_refused() -> None:
    pgs = _pair()
    pgs[0].send([torch.zeros(1)], 1, 0)  # this thread now issues for rank 0
    errors: list[BaseException] = []

    def other() -> None:
        try:
            pgs[0].send([torch.zeros(1)], 1, 0)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=other, name="keeper")
    t.start()
    t.join()
    assert len(errors) == 1 and isinstance(errors[0], StrictViolation)
    assert "'keeper'" in str(errors[0])


def _die_after_connecting(port: int, strict: bool) -> None:
    """Join the group and its first collective (which connects it), then die."""
    store = connect_store("127.0.0.1", port)
    gloo: Any = dist.ProcessGroupGloo(dist.PrefixStore("dead", store), 1, 2, timedelta(seconds=10))
    pg: Any = StrictProcessGroup(gloo, 1, 2, "dead") if strict else gloo
    pg.allreduce([torch.zeros(1)], dist.AllreduceOptions()).wait(timedelta(seconds=10))
    os._exit(0)


@pytest.mark.parametrize("strict", [False, True])
def test_a_dead_peer_hangs_until_abort(strict: bool) -> None:
    store = serve_store()
    child = mp.get_context("spawn").Process(target=_die_after_connecting, args=(store.port, strict))
    child.start()
    gloo: Any = dist.ProcessGroupGloo(dist.PrefixStore("dead", store), 0, 2, timedelta(seconds=10))
    pg: Any = StrictProcessGroup(gloo, 0, 2, "dead") if strict else gloo
    pg.allreduce([torch.zeros(1)], dist.AllreduceOptions()).wait(timedelta(seconds=10))
    child.join(30)
    work = pg.allreduce([torch.ones(1)], dist.AllreduceOptions())
    with pytest.raises(RuntimeError) as caught:
        work.wait(timedelta(seconds=2))
    if not strict:
        assert "hangs" not in str(caught.value)  # gloo: the dead peer ends the wait
        return
    assert "hangs" in str(caught.value)  # NCCL: it hangs
    deadline = time.monotonic() + 10  # and, once it saw the peer go, refuses new work
    while pg._failed is None and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(RuntimeError, match="refuses new work"):
        pg.allreduce([torch.ones(1)], dist.AllreduceOptions())
    pg.abort()
    with pytest.raises(RuntimeError, match="aborted"):
        work.wait(SHORT)


def _groups(count: int) -> list[list[Any]]:
    """``count`` two-rank communicators, each member [rank 0's, rank 1's], with rank 0's
    all on one device and rank 1's on another (as two processes' would be)."""
    store = dist.HashStore()
    made: list[list[Any]] = [[None, None] for _ in range(count)]

    def make(rank: int) -> None:
        for i in range(count):
            pg: Any = dist.ProcessGroupGloo(
                dist.PrefixStore(f"g{i}", store), rank, 2, timedelta(seconds=10)
            )
            made[i][rank] = StrictProcessGroup(
                pg, rank, 2, f"g{i}.{rank}", timeout=timedelta(seconds=1), device=rank
            )

    _both(lambda: make(0), lambda: make(1))
    return made


def _batch(pg: Any, sends: list[torch.Tensor], recvs: list[torch.Tensor]) -> StrictWork:
    pg._start_coalescing()
    for tensor in sends:
        pg.send([tensor], 1 - pg.rank(), 0)
    for tensor in recvs:
        pg.recv([tensor], 1 - pg.rank(), 0)
    return pg._end_coalescing()


def test_first_batches_on_different_communicators_deadlock() -> None:
    """The first batch on a communicator connects its ranks and waits for every member:
    rank 0 posting a receive on one communicator first and rank 1 on another time out
    (a pipeline that posts receives ahead on its backward and forward groups); both
    members connecting the same communicator first go on."""
    (a, b) = _groups(2)

    def first(pg: Any) -> str:
        with pytest.raises(RuntimeError, match="every member must issue its first batch"):
            _batch(pg, [], [torch.zeros(1)])
        return "timed out"

    assert _both(lambda: first(a[0]), lambda: first(b[1])) == ["timed out", "timed out"]
    (c,) = _groups(1)
    sent, got = torch.full((1,), 3.0), torch.zeros(1)
    done = _both(lambda: _batch(c[0], [sent], []), lambda: _batch(c[1], [], [got]))
    done[1].wait(timedelta(seconds=10))
    assert got.item() == 3.0


def test_nothing_is_issued_while_a_receive_waits() -> None:
    """A receive posted on one communicator that still waits refuses an operation on
    another communicator of the same device (under NCCL its spinning kernel can hold up
    that device's later work, which the awaited message may depend on); other devices'
    communicators, and the same one, are not held up; once the receive completes,
    nothing is refused. Each rank issues from a thread of its own."""
    (fwd, bwd) = _groups(2)
    ranks = [ThreadPoolExecutor(1), ThreadPoolExecutor(1)]

    def on(rank: int, fn: Callable[[], Any]) -> Any:
        return ranks[rank].submit(fn).result(timeout=30)

    def connect(pgs: list[Any]) -> None:
        first = [
            ranks[r].submit(_batch, pgs[r], [torch.zeros(1)], [torch.zeros(1)]) for r in (0, 1)
        ]
        for done in first:
            done.result(timeout=30).wait(timedelta(seconds=10))

    connect(fwd)
    connect(bwd)
    waiting = on(0, lambda: _batch(bwd[0], [], [torch.zeros(1)]))  # rank 1 has not sent yet
    with pytest.raises(StrictViolation, match=r"while a receive posted on 'g1\.0' waits"):
        on(0, lambda: _batch(fwd[0], [torch.ones(1)], []))
    queued = on(0, lambda: _batch(bwd[0], [], [torch.zeros(1)]))  # the same one: queued
    for _ in range(2):  # another device is not held up by rank 0's receive
        on(1, lambda: _batch(bwd[1], [torch.ones(1)], [])).wait(timedelta(seconds=10))
    waiting.wait(timedelta(seconds=10))
    queued.wait(timedelta(seconds=10))
    sent = on(0, lambda: _batch(fwd[0], [torch.ones(1)], []))  # nothing waits now
    on(1, lambda: _batch(fwd[1], [], [torch.zeros(1)])).wait(timedelta(seconds=10))
    sent.wait(timedelta(seconds=10))
    for pool in ranks:
        pool.shutdown()


def test_a_first_collective_waits_in_its_launch_for_every_member() -> None:
    """NCCL connects a collective algorithm inside its first launch, from the host, and
    the issuing thread waits there for every member: a member that never issues one
    holds the others in the launch itself (RuntimeError at the communicator's timeout),
    work queued on the stream does not delay the connection, and once connected a
    collective launches at once."""
    (alone,) = _groups(1)
    with pytest.raises(RuntimeError, match="every member must issue its first collective"):
        alone[0].allreduce([torch.ones(1)], dist.AllreduceOptions())
    (g,) = _groups(1)
    parked = g[0].recv([torch.zeros(1)], 1, 0)  # queued ahead on rank 0's stream

    works: list[StrictWork] = []
    peer = threading.Thread(  # rank 1
        target=lambda: works.append(g[1].allreduce([torch.ones(1)], dist.AllreduceOptions()))
    )
    peer.start()
    works.append(g[0].allreduce([torch.ones(1)], dist.AllreduceOptions()))  # returns: connected
    peer.join(10)
    assert len(works) == 2 and not parked.is_completed()
    for pg in g:
        pg.abort()
    (h,) = _groups(1)
    _both(*(lambda r=r: h[r].allreduce([torch.ones(1)], dist.AllreduceOptions()) for r in (0, 1)))
    started = time.monotonic()
    again = [h[r].allreduce([torch.ones(1)], dist.AllreduceOptions()) for r in (0, 1)]
    assert time.monotonic() - started < 0.5  # connected once: launches return at once
    for work in again:
        work.wait(timedelta(seconds=10))
