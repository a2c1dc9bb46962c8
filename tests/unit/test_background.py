"""The fabric's background worker: submitted work runs in order, off the caller's
thread, and hands back results and errors."""

from __future__ import annotations

import os
import threading

import pytest

from elaswave.fabric.background import BackgroundWorker


def test_background_work_runs_in_order_off_the_callers_thread_and_returns_errors():
    worker = BackgroundWorker("test-background")
    seen: list[int] = []

    def job(i: int) -> tuple[int, int, str]:
        seen.append(i)
        return i, threading.get_ident(), threading.current_thread().name

    futures = [worker.submit(lambda i=i: job(i)) for i in range(5)]
    results = [f.result(timeout=10) for f in futures]
    assert seen == list(range(5))
    assert {name for _, _, name in results} == {"test-background"}
    assert threading.get_ident() not in {ident for _, ident, _ in results}

    def boom() -> None:
        raise ValueError("bad shard")

    with pytest.raises(ValueError, match="bad shard"):
        worker.submit(boom).result(timeout=10)
    assert worker.submit(lambda: 7).result(timeout=10) == 7  # and it goes on


def test_a_forked_child_runs_its_own_background_work():
    worker = BackgroundWorker("test-fork")
    assert worker.submit(lambda: 1).result(timeout=10) == 1  # the parent's thread runs
    pid = os.fork()
    if pid == 0:  # the child: the parent's thread is not here
        try:
            ok = worker.submit(lambda: 2).result(timeout=10) == 2
        except BaseException:
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
