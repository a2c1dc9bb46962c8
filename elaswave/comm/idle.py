"""Work done in a process's waits for communication.

The parameter fabric has work off the step's critical path: a snapshot keeper's AdamW
update of its owner's shard, an owner's copy of its committed shard for the next
out-of-place update. On a thread of its own, that work takes its CPU time from the
training thread wherever a host has about one core per training process (the scheduler
shares the core, and a woken thread preempts training at once). Under ``SCHED_IDLE`` it
would not, but on a host busy with other processes it stalled training: a fail-stop's
next step took 2.2x its simulated time (``tests/e2e/test_sim_validation.py`` with two
CPU-bound processes beside it); a starved Python thread can hold the GIL, or a lock the
training thread needs, for as long as it is starved.

So the work is cut into pieces (generators yielding between pieces of 0.1 to 0.2 ms)
and done by the threads that wait for communication, which would otherwise sleep: the
tail of a step's reduce-scatter, an all-gather, a pipeline bubble
(:func:`elaswave.comm.abort.await_future` calls :meth:`IdleWork.help` once a wait has
lasted a millisecond). A piece started there delays the wait's return by at most one
piece. Whatever no wait has done
is done where it is needed (:meth:`IdleWork.finish`), on the thread that needs it.

A host with cores to spare beside its training threads (a GPU host) has no reason to
put that work on the training thread: there :meth:`IdleWork.start_helper` also runs it
on a thread of its own, as soon as it is queued.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
from collections.abc import Generator
from typing import Generic, TypeVar

import structlog

log = structlog.get_logger(__name__)

T = TypeVar("T")


class IdleTask(Generic[T]):
    """A submitted piece of work: its pieces, then its result or error."""

    def __init__(self, pieces: Generator[None, None, T], name: str) -> None:
        self.name = name
        self._pieces: Generator[None, None, T] | None = pieces
        self.done = False
        self.result: T | None = None
        self.error: BaseException | None = None

    def __repr__(self) -> str:
        return f"IdleTask({self.name!r}, done={self.done})"


class IdleWork:
    """Tasks run a piece at a time, oldest first, by whichever thread helps.

    One piece runs at a time in the process (``_running``), so a task's generator is
    never entered by two threads at once, and a thread that needs a task finished waits
    for at most the piece another thread is running.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = threading.Lock()
        self._tasks: collections.deque[IdleTask[object]] = collections.deque()
        self._queued = threading.Condition(self._lock)
        self._helper: threading.Thread | None = None
        self.pieces_run = 0
        """Pieces run so far (by :meth:`help` and :meth:`finish`)."""
        if hasattr(os, "register_at_fork"):  # a forked child does not do its parent's work
            os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._running = threading.Lock()
        self._tasks = collections.deque()
        self._queued = threading.Condition(self._lock)
        self._helper = None

    def start_helper(self, name: str = "ew-idle") -> None:
        """Also run the work on a daemon thread of its own, as soon as it is queued (for
        a host with a core to spare for it); idempotent."""
        with self._lock:
            if self._helper is None:
                self._helper = threading.Thread(target=self._help_always, name=name, daemon=True)
                self._helper.start()

    @property
    def has_helper(self) -> bool:
        return self._helper is not None

    def _help_always(self) -> None:
        while True:
            with self._lock:
                while not self._tasks:
                    self._queued.wait()
                task = self._tasks[0]
            with self._running:  # after the piece another thread may be running
                if not task.done:
                    self._piece(task)
            del task  # nothing held between pieces

    def submit(self, pieces: Generator[None, None, T], name: str = "") -> IdleTask[T]:
        """Queue a task: ``pieces`` yields between its pieces and returns its result."""
        task: IdleTask[T] = IdleTask(pieces, name)
        with self._lock:
            self._tasks.append(task)  # type: ignore[arg-type]
            self._queued.notify()
        return task

    def pending(self) -> int:
        with self._lock:
            return len(self._tasks)

    def help(self, stop: threading.Event, max_pieces: int | None = None) -> int:
        """Run pieces of the queued tasks until ``stop`` is set, none is left or
        ``max_pieces`` have run; returns how many. Returns at once if another thread is
        running a piece."""
        ran = 0
        while not stop.is_set() and (max_pieces is None or ran < max_pieces):
            if not self._running.acquire(blocking=False):
                return ran
            try:
                with self._lock:
                    if not self._tasks:
                        return ran
                    task = self._tasks[0]
                self._piece(task)
                ran += 1
            finally:
                self._running.release()
        return ran

    def finish(self, task: IdleTask[T]) -> T:
        """Run ``task``'s remaining pieces on this thread (after the piece another thread
        may be running) and return its result; re-raise its error."""
        with self._running:
            while not task.done:
                self._piece(task)
        if task.error is not None:
            raise task.error
        return task.result  # type: ignore[return-value]

    def drop(self, task: IdleTask[T]) -> None:
        """Forget ``task`` (not run any further); a piece of it running now completes."""
        with self._running:
            if not task.done:
                pieces = task._pieces
                self._end(task)
                if pieces is not None:
                    pieces.close()

    def _piece(self, task: IdleTask[T]) -> None:
        """Run one piece of ``task`` (``_running`` held)."""
        assert task._pieces is not None
        try:
            next(task._pieces)
        except StopIteration as end:
            task.result = end.value
            self._end(task)
        except BaseException as exc:  # the taker gets it; an interrupt goes on up
            task.error = exc
            self._end(task)
            if not isinstance(exc, Exception):
                raise
            log.warning("idle_task.failed", task=task.name, error=repr(exc))
        finally:
            self.pieces_run += 1

    def _end(self, task: IdleTask[T]) -> None:
        task.done = True
        task._pieces = None
        with self._lock, contextlib.suppress(ValueError):
            self._tasks.remove(task)  # type: ignore[arg-type]


IDLE = IdleWork()
"""This process's idle work."""
