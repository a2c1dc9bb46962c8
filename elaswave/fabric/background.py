"""Background work that yields to training compute.

The parameter fabric's own work (a snapshot keeper's AdamW update of its owner's shard,
an owner's copy of its committed shard for the next out-of-place update) is off the
step's critical path, but on a host with as many cores as training processes a thread
at the training thread's priority takes its CPU time from the step: the scheduler
shares the core between them, and a thread woken by an arriving gradient preempts the
training thread at once. Under ``SCHED_IDLE`` the same work runs in the time the step
leaves idle (pipeline bubbles, waits in collectives), never preempts training, and
otherwise gets a small share of a busy core, so it can fall behind but never starves
(docs/steady_state.md has the measured effect).

:func:`lower_priority` lowers the calling thread; :class:`BackgroundWorker` runs
submitted callables on one such thread, in order.
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import threading
from collections.abc import Callable
from typing import TypeVar

import structlog

from elaswave.comm.abort import settle

log = structlog.get_logger(__name__)

T = TypeVar("T")

LOWEST = 19
"""The nice value background threads run at where ``SCHED_IDLE`` is not available."""


def lower_priority() -> bool:
    """Run the calling thread under ``SCHED_IDLE`` (Linux: the policy is the thread's
    own), else at nice 19. Returns whether it could lower it at all."""
    if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            return True
        except OSError as exc:
            log.debug("background.idle_refused", error=str(exc))
    if not hasattr(os, "setpriority") or not hasattr(threading, "get_native_id"):
        return False
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST)
    except OSError as exc:
        log.debug("background.priority_kept", error=str(exc))
        return False
    return True


class BackgroundWorker:
    """One daemon thread at the lowest priority running submitted callables in order.

    Started on first use. A caller that needs a result waits on its future; while it
    waits, its core is free and the worker runs at once.
    """

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
        lower_priority()
        while True:
            fn, future = self._queue.get()
            if future.set_running_or_notify_cancel():
                settle(future, fn)
            del fn, future  # nothing held between items


BACKGROUND = BackgroundWorker("ew-background")
"""This process's background worker."""
