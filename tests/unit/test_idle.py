"""Idle work (comm.idle): tasks run a piece at a time by the threads that wait for
communication, and are finished by the thread that needs them."""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from collections.abc import Generator

import pytest

from elaswave.comm import abort
from elaswave.comm.abort import AbortSignal, StepAborted, await_future
from elaswave.comm.idle import IdleWork

pytestmark = pytest.mark.timeout(30)


def _pieces(log: list[str], name: str, n: int) -> Generator[None, None, str]:
    for i in range(n):
        if i:
            yield
        log.append(f"{name}{i}")
    return name.upper()


def test_pieces_run_oldest_task_first_until_stopped_and_the_rest_is_finished_by_its_taker():
    idle = IdleWork()
    log: list[str] = []
    a = idle.submit(_pieces(log, "a", 2))
    b = idle.submit(_pieces(log, "b", 3))
    never = threading.Event()
    assert idle.help(never, max_pieces=3) == 3
    assert log == ["a0", "a1", "b0"]
    assert a.done and a.result == "A" and not b.done
    assert idle.finish(b) == "B"  # its two remaining pieces, on this thread
    assert log == ["a0", "a1", "b0", "b1", "b2"]
    assert idle.pending() == 0
    stop = threading.Event()
    stop.set()
    c = idle.submit(_pieces(log, "c", 1))
    assert idle.help(stop) == 0 and not c.done  # a wait already over runs nothing


def test_an_error_is_raised_to_the_taker_and_the_next_task_goes_on():
    idle = IdleWork()

    def boom() -> Generator[None, None, None]:
        yield
        raise ValueError("bad shard")

    bad = idle.submit(boom(), "boom")
    log: list[str] = []
    good = idle.submit(_pieces(log, "g", 1))
    assert idle.help(threading.Event()) == 3
    assert bad.done and good.done and log == ["g0"]
    with pytest.raises(ValueError, match="bad shard"):
        idle.finish(bad)


def test_a_dropped_task_is_closed_and_never_run_again():
    idle = IdleWork()
    closed = threading.Event()

    def pieces() -> Generator[None, None, None]:
        try:
            while True:
                yield
        finally:
            closed.set()

    task = idle.submit(pieces())
    idle.help(threading.Event(), max_pieces=2)
    idle.drop(task)
    assert closed.is_set() and task.done and idle.pending() == 0
    assert idle.help(threading.Event()) == 0


def test_a_thread_that_needs_a_task_waits_only_for_the_piece_another_thread_runs():
    idle = IdleWork()
    inside, release = threading.Event(), threading.Event()
    ran_by: list[str] = []

    def pieces() -> Generator[None, None, int]:
        ran_by.append(threading.current_thread().name)
        inside.set()
        release.wait(10)
        for _ in range(3):
            yield
            ran_by.append(threading.current_thread().name)
        return 5

    task = idle.submit(pieces())
    helper = threading.Thread(target=idle.help, args=(threading.Event(),), name="helper")
    helper.start()
    assert inside.wait(10)
    assert idle.help(threading.Event()) == 0  # another thread runs a piece: no waiting
    threading.Timer(0.05, release.set).start()
    assert idle.finish(task) == 5
    helper.join(10)
    assert ran_by[0] == "helper" and len(ran_by) == 4


def test_a_wait_for_communication_does_the_idle_work_then_sleeps(
    monkeypatch: pytest.MonkeyPatch,
):
    """await_future runs queued pieces while its future is pending (past a first
    millisecond), stops between two pieces once it completes (or the abort signal
    fires), and sleeps when none is left."""
    idle = IdleWork()
    monkeypatch.setattr(abort, "IDLE", idle)
    future: concurrent.futures.Future[int] = concurrent.futures.Future()
    count = [0]

    def pieces() -> Generator[None, None, None]:
        while True:
            count[0] += 1
            if count[0] == 4:
                future.set_result(9)  # the collective completes during the 4th piece
            yield

    idle.submit(pieces())
    done: concurrent.futures.Future[int] = concurrent.futures.Future()
    done.set_result(1)
    assert await_future(done, 5.0, None) == (True, 1)
    assert count[0] == 0  # a wait that is over at once (a hand-off) does no work
    assert await_future(future, 5.0, AbortSignal()) == (True, 9)
    assert count[0] == 4  # no piece after the completion
    signal = AbortSignal()
    threading.Timer(0.05, signal.set, args=("rank 1 failed",)).start()
    pending: concurrent.futures.Future[int] = concurrent.futures.Future()
    with pytest.raises(StepAborted):
        await_future(pending, 5.0, signal)  # pieces until the abort, then it raises
    assert count[0] > 4
    idle.drop(idle._tasks[0])
    started = time.monotonic()
    assert await_future(pending, 0.1, None) == (False, None)  # nothing left: it sleeps
    assert time.monotonic() - started >= 0.09


def test_a_forked_child_drops_its_parents_idle_work():
    idle = IdleWork()
    log: list[str] = []
    idle.submit(_pieces(log, "p", 2))
    pid = os.fork()
    if pid == 0:
        os._exit(0 if idle.pending() == 0 and idle.help(threading.Event()) == 0 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert idle.pending() == 1


def test_a_helper_thread_runs_the_work_as_soon_as_it_is_queued():
    """Where a host has cores to spare, the work need not wait for a wait."""
    idle = IdleWork()
    idle.start_helper("test-idle")
    idle.start_helper("test-idle")  # idempotent
    names: list[str] = []

    def pieces() -> Generator[None, None, int]:
        names.append(threading.current_thread().name)
        yield
        names.append(threading.current_thread().name)
        return 3

    task = idle.submit(pieces())
    deadline = time.monotonic() + 10
    while not task.done and time.monotonic() < deadline:
        time.sleep(0.001)
    assert task.done and names == ["test-idle", "test-idle"]
    assert idle.finish(task) == 3 and idle.pending() == 0


@pytest.mark.parametrize(("cores", "processes", "helper"), [(2, 2, False), (16, 8, True)])
def test_a_worker_adds_a_helper_thread_only_on_a_host_with_a_core_to_spare(
    monkeypatch: pytest.MonkeyPatch, cores: int, processes: int, helper: bool
):
    from elaswave.runtime.worker import process as worker

    idle = IdleWork()
    monkeypatch.setattr(worker, "IDLE", idle)
    monkeypatch.setattr(worker.os, "sched_getaffinity", lambda _pid: set(range(cores)))
    worker._place_idle_work(processes)
    assert idle.has_helper is helper
