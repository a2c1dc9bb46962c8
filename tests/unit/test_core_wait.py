"""The Core's wait_until keeps its deadline however busy the bus is."""

from __future__ import annotations

import asyncio
import time

import pytest

from elaswave.runtime.core.recorder import Core


@pytest.mark.timeout(30)
def test_wait_until_keeps_its_deadline_while_events_keep_arriving(tmp_path) -> None:
    """Every event wakes the wait. With one arriving at every loop turn, a wake-up and
    the deadline coincide; on Python 3.11 an ``asyncio.timeout`` around ``wait_for``
    then loses the deadline and waits forever (it did, under a busy bus)."""
    core = Core(tmp_path)

    async def go() -> float:
        async def events() -> None:
            while True:
                core._changed.set()  # what every received event does
                await asyncio.sleep(0)

        poker = asyncio.create_task(events())
        worst = 0.0
        for _ in range(60):
            started = time.monotonic()
            assert not await core.wait_until(lambda: False, 0.05)
            worst = max(worst, time.monotonic() - started)
        poker.cancel()
        return worst

    assert asyncio.run(go()) < 1.0
