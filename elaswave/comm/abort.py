"""Abortable waits on torch.distributed work.

A gloo wait that times out closes its pair and breaks the group, and ``pg.abort()`` does
not unblock a wait in flight, so neither can stop a step when a peer fails. Instead, each
blocking wait runs on a waiter thread while the training thread polls both the wait and
an :class:`AbortSignal` that the bus sets when the Core announces a failure. An abandoned
wait stays parked on its thread; P2P tags carry the plan generation and step, so a stale
receive can never match a message of the redone step.
"""

from __future__ import annotations

import concurrent.futures
import threading
from datetime import timedelta

import torch.distributed as dist

_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="ew-wait")
_POLL_S = 0.002


class StepAborted(Exception):
    """The current step was abandoned because the job's membership changed."""


class AbortSignal:
    """Set from any thread (the bus callback); checked by the training thread."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason = ""
        self.generation = 0
        """The plan generation whose failures this signal reports."""

    def set(self, reason: str) -> None:
        self.reason = reason
        self._event.set()

    def clear(self) -> None:
        self.reason = ""
        self._event.clear()

    def is_set(self) -> bool:
        return self._event.is_set()

    def check(self) -> None:
        if self._event.is_set():
            raise StepAborted(self.reason)

    def wait(self, timeout_s: float) -> bool:
        return self._event.wait(timeout_s)


def wait_abortable(work: dist.Work, timeout: timedelta, signal: AbortSignal) -> bool:
    """``work.wait(timeout)``, abandoned with :class:`StepAborted` if ``signal`` is set.

    Returns what ``wait`` returned; re-raises its RuntimeError.
    """
    signal.check()
    future = _POOL.submit(work.wait, timeout)
    while True:
        done, _ = concurrent.futures.wait([future], timeout=_POLL_S)
        if done:
            return future.result()
        if signal.is_set():
            raise StepAborted(signal.reason)
