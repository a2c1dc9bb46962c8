"""A worker's side of a Core outage: train on, then pause every worker at one step boundary.

Training needs no Core: the workers' collectives run over torch.distributed. So while
the Core is away (lost and being restarted by the job host), workers keep training. A
worker that has not heard the Core (its beacons, every 0.25 s) for ``bound_s`` seconds
stops at a step boundary and waits for it, keeping its state in memory; it resumes the
moment it hears the Core again.

The workers must all stop at the *same* boundary, or those still training would block
in collectives with those waiting. They agree through the job's store, which the job
host serves and which outlives the Core: the first worker to decide, at the boundary
before step ``s``, sets ``core/outage`` to ``s + 1`` with a compare-and-set, and every
worker pauses at the boundary before that step. Nobody can be past it: no worker can
finish step ``s`` before the deciding one has trained it. Workers read the key only
while the Core is silent, so a healthy job pays nothing for it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import structlog
import torch.distributed as dist

from elaswave.bus.schema import CORE_SENDER, Event

log = structlog.get_logger(__name__)

OUTAGE_KEY = "core/outage"


class CoreWatch:
    """When this worker last heard the Core, and the pause an outage calls for."""

    def __init__(self, bound_s: float, store: dist.Store | None = None) -> None:
        self.store = store
        """The job's store (set once the worker has connected to it)."""
        self.bound_s = bound_s
        self.look_s = min(1.0, bound_s / 2)
        """Silence after which the worker reads the store's outage key at each boundary."""
        self._last = time.monotonic()
        self._lock = threading.Lock()
        self.pauses = 0

    def heard(self, event: Event) -> None:
        """On the bus thread, for every event: note the Core's."""
        if event.sender == CORE_SENDER:
            with self._lock:
                self._last = time.monotonic()

    def silent_s(self) -> float:
        with self._lock:
            return time.monotonic() - self._last

    def pause_before(self, step: int) -> bool:
        """At the boundary before ``step``: True when every worker pauses here."""
        silent = self.silent_s()
        if silent < self.look_s or self.store is None:
            return False
        current = self.store.get(OUTAGE_KEY).decode() if self.store.check([OUTAGE_KEY]) else ""
        if current and int(current) >= step:
            return int(current) == step  # an outage already decided: pause at its step
        if silent < self.bound_s:
            return False
        # Decide: train this step (a peer may already be in it), stop before the next.
        agreed = self.store.compare_set(OUTAGE_KEY, current, str(step + 1)).decode()
        log.warning("core.outage", silent_s=round(silent, 2), pause_before=int(agreed))
        return int(agreed) == step

    def wait(self, step: int, interrupted: Callable[[], bool]) -> None:
        """Paused before ``step``: return once the Core is heard again, or when
        ``interrupted()`` (a failure announced by the returned Core)."""
        started = time.monotonic()
        log.warning("core.outage_paused", step=step, silent_s=round(self.silent_s(), 2))
        while self.silent_s() >= self.look_s and not interrupted():
            time.sleep(0.02)
        self.pauses += 1
        log.warning("core.outage_resumed", step=step, paused_s=round(time.monotonic() - started, 3))
