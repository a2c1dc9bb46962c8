"""Background work off the training thread.

The parameter fabric's own work (a snapshot keeper's AdamW update of its owner's shard,
an owner's copy of its committed shard for the next out-of-place update) is off the
step's critical path. :class:`BackgroundWorker` runs it on one thread, in order, so that
it overlaps the step where the host has a core to spare.

It runs at the training thread's priority. Under ``SCHED_IDLE`` the same work cost
less at steady state on the 2-core host, but on a host busy with other processes the
starved work stalled training: a fail-stop's next step on the emulated device took 2.2x
its simulated time instead of 1.27x (``tests/e2e/test_sim_validation.py`` with two
CPU-bound processes beside it, 3 of 3 runs; 0 of 2 at normal priority).
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import threading
from collections.abc import Callable
from typing import TypeVar

from elaswave.comm.abort import settle

T = TypeVar("T")


class BackgroundWorker:
    """One daemon thread running submitted callables in order; started on first use
    (and again in a forked child, which the parent's thread does not survive)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[
            tuple[Callable[[], object], concurrent.futures.Future[object]]
        ] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        if hasattr(os, "register_at_fork"):  # a forked child starts its own thread
            os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._queue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread = None

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._queue.put((fn, future))  # type: ignore[arg-type]
        return future

    def _run(self) -> None:
        while True:
            fn, future = self._queue.get()
            if future.set_running_or_notify_cancel():
                settle(future, fn)
            del fn, future  # nothing held between items


BACKGROUND = BackgroundWorker("ew-background")
"""This process's background worker."""
