"""The heartbeat sender: a worker's liveness signal on the bus.

A daemon thread publishes a Heartbeat with the worker's current step when it starts and
then every interval.
Publishing goes through the Session's queue, so it never touches the training thread.
A worker that hangs (stopped, deadlocked in a driver, swapping) stops heartbeating even
though its process is alive; the Core's heartbeat monitor then fences it.
"""

from __future__ import annotations

import threading

from elaswave.bus.schema import Heartbeat, sender_name
from elaswave.bus.session import Session


class HeartbeatSender:
    def __init__(self, session: Session, rank: int, *, interval_s: float, sender: str = "") -> None:
        self.session = session
        self.rank = rank
        self.sender = sender or sender_name(rank)
        self.interval_s = interval_s
        self.step = -1
        """The step being trained; set by the training loop."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"agent-{rank}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        """Beat at once, then every interval: a worker that hangs right after it started
        (before it told the Core so) has beaten already, and its silence is counted."""
        while True:
            self.session.publish(Heartbeat(sender=self.sender, rank=self.rank, step=self.step))
            if self._stop.wait(self.interval_s):
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)
