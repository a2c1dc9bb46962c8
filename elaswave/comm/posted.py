"""Posted point-to-point operations, held until they complete.

gloo's TCP transport keeps only a weak reference to the buffer of a posted send or
receive; torch's ``Work`` for it owns the buffer, and nothing else does. Freeing the
``Work`` of an operation that has not completed breaks the whole connection to that
peer, not just the one operation:

* a receive's *recv-ready* notice has already gone to the peer, so the peer sends the
  data; the reader finds the buffer gone, stops mid-message, and never reads the socket
  again: every later message on the pair is lost;
* a send's data is written when the peer's receive is posted; the writer finds the
  buffer gone and stalls at the head of the pair's queue: every later send waits behind
  it.

Both are the ordinary course of a failure: a step that is abandoned leaves receives it
pre-posted and sends it never waited for, and the Python objects holding them go out of
scope. One pair serves every purpose between two ranks (:mod:`elaswave.comm.links`), so
the next plan's live remap on that pair then waits for ever (chaos seed 33, case 85:
two survivors each waiting for the other's shard piece on a link that had stalled when
the step before the failure was abandoned).

So every send and receive a group posts is held in its :class:`Posted` until it has
completed. A ``Work`` reports completion only once it has been waited, which every
operation that is not abandoned is; the abandoned ones (a handful per failure) stay
held, with their buffers, for as long as the group lives.
"""

from __future__ import annotations

import threading

import torch.distributed as dist

_FIRST_SWEEP = 32
"""Held operations before the first sweep for completed ones."""


class Posted:
    """The posted operations of one gloo group (thread-safe: sends and receives are
    posted from the training thread, waiter threads and snapshot threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._works: list[dist.Work] = []
        self._sweep_at = _FIRST_SWEEP

    def hold(self, work: dist.Work) -> dist.Work:
        """Hold ``work`` until it completes; returns it. Completed ones are dropped in
        sweeps, each after the number held has doubled since the last (amortised O(1))."""
        with self._lock:
            self._works.append(work)
            if len(self._works) >= self._sweep_at:
                self._works = [w for w in self._works if not w.is_completed()]
                self._sweep_at = max(_FIRST_SWEEP, 2 * len(self._works))
        return work

    def pending(self) -> int:
        """Held operations that have not completed."""
        with self._lock:
            return sum(1 for w in self._works if not w.is_completed())
