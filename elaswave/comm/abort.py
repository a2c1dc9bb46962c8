"""Abortable waits on torch.distributed work.

A gloo wait that times out closes its pair and breaks the group, and ``pg.abort()`` does
not unblock a wait in flight, so neither can stop a step when a peer fails. Instead, each
blocking wait runs on a waiter thread while the calling thread sleeps until either the
wait completes or an :class:`AbortSignal` (set by the bus when the Core announces a
failure) fires. Nothing polls: the wait's completion and the signal both wake the caller,
so a thread blocked in a wait costs no CPU (on 2 shared cores, polling every few
milliseconds from every waiting thread was a measurable tax on training) beyond the idle
work it does first. An abandoned wait stays parked on its thread; P2P tags carry the
plan generation and step, so a stale receive can never match a message of the redone
step.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Protocol, TypeVar

import torch.distributed as dist

from elaswave.comm.idle import IDLE

T = TypeVar("T")


class StepAborted(Exception):
    """The current step was abandoned because the job's membership changed."""


class Abort(Protocol):
    """What a wait watches to be abandoned: an :class:`AbortSignal`, or the part of one
    that fires from some moment on (:class:`AbortSince`)."""

    @property
    def reason(self) -> str: ...
    def is_set(self) -> bool: ...
    def check(self) -> None:
        """Raise StepAborted if set."""
        ...

    def watch(self, wake: threading.Event) -> contextlib.AbstractContextManager[None]:
        """Set ``wake`` when it fires (at once if it has) while inside."""
        ...


class AbortSignal:
    """Set from any thread (the bus callback); checked and watched by waiting threads."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._watchers: set[threading.Event] = set()
        self.reason = ""
        self.generation = 0
        """The plan generation whose failures this signal reports."""
        self.sets = 0
        """How many times it was set (:class:`AbortSince` tells later ones apart)."""
        self.ranks: frozenset[int] = frozenset()
        """The failed ranks the latest set names (none: a pause, or not said)."""

    def set(self, reason: str, ranks: Iterable[int] = ()) -> None:
        with self._lock:
            self.reason = reason
            self.ranks = frozenset(ranks)
            self.sets += 1
            self._event.set()
            watchers = list(self._watchers)
        for wake in watchers:
            wake.set()

    def clear(self) -> None:
        with self._lock:
            self.reason = ""
            self._event.clear()

    def is_set(self) -> bool:
        return self._event.is_set()

    def check(self) -> None:
        if self._event.is_set():
            raise StepAborted(self.reason)

    def wait(self, timeout_s: float) -> bool:
        return self._event.wait(timeout_s)

    @contextlib.contextmanager
    def watch(self, wake: threading.Event) -> Iterator[None]:
        """Set ``wake`` when the signal fires (at once if it already has) while inside."""
        with self._lock:
            self._watchers.add(wake)
            if self._event.is_set():
                wake.set()
        try:
            yield
        finally:
            with self._lock:
                self._watchers.discard(wake)


class AbortSince:
    """The failures an :class:`AbortSignal` reports from now on. A recovery builds its
    groups while the failure it answers is still set; their connection waits end for a
    failure announced after that, not for the one they answer. ``concerning``: only a
    later failure that names one of these ranks (or names none) counts: a TP group
    rebuilt while its unit reports is not abandoned because the Core widened the same
    change's failure set with another unit (two kills in one step seen apart)."""

    def __init__(self, signal: AbortSignal, concerning: Iterable[int] | None = None) -> None:
        self._signal, self._base = signal, signal.sets
        self._concerning = None if concerning is None else frozenset(concerning)

    @property
    def reason(self) -> str:
        return self._signal.reason

    def is_set(self) -> bool:
        signal = self._signal
        if not (signal.sets > self._base and signal.is_set()):
            return False
        named = signal.ranks
        return self._concerning is None or not named or bool(named & self._concerning)

    def check(self) -> None:
        if self.is_set():
            raise StepAborted(self._signal.reason)

    @contextlib.contextmanager
    def watch(self, wake: threading.Event) -> Iterator[None]:
        signal = self._signal
        with signal._lock:
            signal._watchers.add(wake)
            if self.is_set():
                wake.set()
        try:
            yield
        finally:
            with signal._lock:
                signal._watchers.discard(wake)


class Waiters:
    """Daemon threads for blocking waits; one that is given up on parks for good.

    A thread pool from ``concurrent.futures`` would not do: its threads are joined at
    interpreter exit (a parked wait would then hang the exit), and a bounded pool runs
    out once enough waits are parked.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._items: list[tuple[Callable[[], object], concurrent.futures.Future]] = []
        self._ready = threading.Condition(self._lock)
        self._idle = 0

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            self._items.append((fn, future))
            if self._idle > len(self._items) - 1:
                self._ready.notify()
                return future
        threading.Thread(target=self._run, name=self._name, daemon=True).start()
        return future

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._items:
                    self._idle += 1
                    self._ready.wait()
                    self._idle -= 1
                fn, future = self._items.pop(0)
            settle(future, fn)
            del fn, future  # an idle thread must not keep the last group alive


def settle(future: concurrent.futures.Future[T], fn: Callable[[], T]) -> None:
    """Run ``fn`` and give ``future`` its result, or the exception it raised."""
    try:
        result = fn()
    except BaseException as exc:
        future.set_exception(exc)
    else:
        future.set_result(result)


WAITERS = Waiters("ew-wait")


HELP_AFTER_S = 0.001
"""A wait does idle work once it has lasted this long: one that ends sooner is a
hand-off on the step's critical path (a pipeline's steady state), which a piece of
work would delay; one that lasts is a collective's tail or a pipeline bubble."""


def await_future(
    future: concurrent.futures.Future[T], timeout_s: float, signal: Abort | None
) -> tuple[bool, T | None]:
    """Sleep until ``future`` completes, ``timeout_s`` passes or ``signal`` fires;
    past :data:`HELP_AFTER_S`, do the process's idle work first
    (:mod:`elaswave.comm.idle`).

    Returns ``(True, result)`` when it completed (re-raising its exception), ``(False,
    None)`` on timeout; raises :class:`StepAborted` when the signal fired first.
    """
    deadline = time.monotonic() + timeout_s
    wake = threading.Event()
    future.add_done_callback(lambda _: wake.set())

    def over() -> bool:
        return future.done() or (signal is not None and signal.is_set())

    with signal.watch(wake) if signal is not None else contextlib.nullcontext():
        if not wake.wait(min(timeout_s, HELP_AFTER_S)):
            IDLE.help(wake)  # the process's idle work, in what would be sleep
        while not over() and (left := deadline - time.monotonic()) > 0:
            wake.clear()  # woken by a set that does not concern this wait: wait on
            if not over():
                wake.wait(left)
    if future.done():
        return True, future.result()
    if signal is not None and signal.is_set():
        raise StepAborted(signal.reason)
    return False, None


def wait_abortable(work: dist.Work, timeout: timedelta, signal: Abort) -> bool:
    """``work.wait(timeout)``, abandoned with :class:`StepAborted` if ``signal`` is set.

    Returns what ``wait`` returned; re-raises its RuntimeError.
    """
    signal.check()
    future: concurrent.futures.Future[bool | None] = WAITERS.submit(lambda: work.wait(timeout))
    # gloo's own timeout ends the wait; the margin only guards against a stuck waiter.
    done, ok = await_future(future, timeout.total_seconds() + 5.0, signal)
    return bool(ok) if done else False


def on_fresh_thread(make: Callable[[], T], *, name: str, abort: Abort | None = None) -> T:
    """``make()`` run on a thread of its own (its result, or its error raised here).

    NCCL's group state belongs to a thread, and so does torch's count of the groups a
    thread has open, which a batch that failed half-way leaves one too high for good: a
    communicator created on the thread that issued it is refused ("ncclGroupEnd: not in
    a group call"). The training thread issues batches, so communicators are created
    (and connected: :meth:`elaswave.comm.communicator.Communicator.build`) on fresh
    threads; the caller still waits, as for any other creation.

    A creation waits at the store for every member; with ``abort``, a failure announced
    meanwhile ends the caller's wait (StepAborted) instead of the store's timeout: the
    creation is left to end on its own thread, its result dropped."""
    out: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(make())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.05)
        if abort is not None and thread.is_alive():
            abort.check()
    if errors:
        raise errors[0]
    return out[0]
