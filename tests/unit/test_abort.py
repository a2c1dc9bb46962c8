"""Event-driven abortable waits: completion, timeout and the abort signal each wake the
caller at once, with no polling."""

from __future__ import annotations

import threading
import time

import pytest

from elaswave.comm.abort import WAITERS, AbortSignal, AbortSince, StepAborted, await_future

pytestmark = pytest.mark.timeout(30)


def test_completion_returns_the_result() -> None:
    assert await_future(WAITERS.submit(lambda: 7), 5.0, AbortSignal()) == (True, 7)


def test_a_failed_wait_reraises() -> None:
    def boom() -> None:
        raise RuntimeError("Connection closed by peer")

    with pytest.raises(RuntimeError, match="closed by peer"):
        await_future(WAITERS.submit(boom), 5.0, None)


def test_timeout_returns_not_done() -> None:
    forever = threading.Event()
    started = time.monotonic()
    assert await_future(WAITERS.submit(forever.wait), 0.05, AbortSignal()) == (False, None)
    assert time.monotonic() - started < 1.0
    forever.set()


def test_abort_wakes_the_waiter_at_once() -> None:
    forever, signal = threading.Event(), AbortSignal()
    threading.Timer(0.05, signal.set, args=("rank 3 failed",)).start()
    started = time.monotonic()
    with pytest.raises(StepAborted, match="rank 3 failed"):
        await_future(WAITERS.submit(forever.wait), 10.0, signal)
    assert time.monotonic() - started < 1.0
    forever.set()


def test_a_signal_already_set_aborts_and_watchers_are_released() -> None:
    forever, signal = threading.Event(), AbortSignal()
    signal.set("earlier failure")
    with pytest.raises(StepAborted):
        await_future(WAITERS.submit(forever.wait), 10.0, signal)
    assert not signal._watchers
    signal.clear()
    assert await_future(WAITERS.submit(lambda: 1), 5.0, signal) == (True, 1)
    forever.set()


def test_a_parked_wait_does_not_block_other_waits() -> None:
    forever = threading.Event()
    parked = WAITERS.submit(forever.wait)
    for _ in range(3):
        assert WAITERS.submit(lambda: None).result(timeout=5) is None
    assert not parked.done()
    forever.set()
    assert parked.result(timeout=5) is True


def test_a_view_since_now_ignores_the_failure_already_set_and_fires_for_a_later_one() -> None:
    """A group rebuilt while its rank reports a failure answers that failure: its waits
    end only for one announced after the rebuild began."""
    signal = AbortSignal()
    signal.set("rank 3 failed")
    since = AbortSince(signal)
    assert not since.is_set()
    since.check()  # no raise
    started = time.monotonic()
    done, _ = await_future(WAITERS.submit(lambda: time.sleep(0.3)), 5.0, since)
    assert done and time.monotonic() - started >= 0.25  # not woken by the old failure
    threading.Timer(0.1, signal.set, args=("rank 5 failed",)).start()
    with pytest.raises(StepAborted, match="rank 5"):
        await_future(WAITERS.submit(lambda: time.sleep(5)), 5.0, since)
    assert since.is_set()


def test_a_view_concerning_some_ranks_waits_through_a_widened_failure_of_others() -> None:
    """A TP group rebuilt while its unit (rank 1) reports: the Core widens the change's
    failure set with rank 3 (two kills of one step seen apart). The rebuild's waits go on
    to their end rather than stop as timed out; a later failure naming rank 1, or naming
    no rank, ends them. Chaos regression: tests/fault/test_tensor_parallel.py's restore
    case lost unit 1 to the widened set under load."""
    signal = AbortSignal()
    signal.set("ranks [0] failed", [0])
    since = AbortSince(signal, concerning=[1])
    threading.Timer(0.05, signal.set, args=("ranks [0, 3] failed", [0, 3])).start()
    started = time.monotonic()
    done, _ = await_future(WAITERS.submit(lambda: time.sleep(0.3)), 5.0, since)
    assert done and time.monotonic() - started >= 0.25
    assert not since.is_set()
    threading.Timer(0.05, signal.set, args=("ranks [0, 1, 3] failed", [0, 1, 3])).start()
    with pytest.raises(StepAborted, match=r"\[0, 1, 3\]"):
        await_future(WAITERS.submit(lambda: time.sleep(5)), 5.0, since)
    unnamed = AbortSince(signal, concerning=[1])
    threading.Timer(0.05, signal.set, args=("pause after step 4",)).start()
    with pytest.raises(StepAborted, match="pause"):
        await_future(WAITERS.submit(lambda: time.sleep(5)), 5.0, unnamed)
