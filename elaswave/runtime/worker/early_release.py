"""Releasing the device plane as soon as a failure is heard, on the bus's thread.

Under NCCL a collective or a receive whose peer is gone spins on the device until its
communicator is aborted, and the training thread can be held behind it where no abort
signal reaches: a device allocation (``cudaMalloc`` may synchronise the device), a copy
to the host, a launch. The executor releases the plane once the training thread has
stopped (:func:`elaswave.runtime.worker.executor.recover`), which a thread held
so never does: a joiner whose allocator had nothing cached yet stayed so for a minute in
an H100's churn, past the Core's stop deadline, and the job ended. So when a failure is
announced, the thread that hears it aborts every device group the executor would
release (one that holds a failed rank or has work in flight:
:func:`elaswave.comm.release.must_release`); the executor's own release then finds them
aborted and reports them tainted. Where work does not park (gloo), nothing is aborted.

An abort that races a launch on the same communicator (torch then polls a communicator
freed under it) may take this process down: a fail-stop, which the job survives, where
a rank that never stops ends it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Sequence

from elaswave.comm.group import Group
from elaswave.comm.release import abort_marked, mark_aborted, must_release
from elaswave.runtime.worker.trainer import Trainer


class EarlyRelease:
    """Aborts the groups ``groups()`` names that a failure of some ranks stalls."""

    def __init__(self, groups: Callable[[], Sequence[Group]]) -> None:
        self._groups = groups

    def failed(self, ranks: Collection[int]) -> threading.Thread | None:
        """Abort, on a thread of its own, the groups that ``ranks`` failing stalls;
        that thread (None when none needs it). Called on the thread that hears the
        announcement: it must not wait."""
        stalled = mark_aborted([g for g in self._groups() if must_release(g, set(ranks))])
        if not stalled:  # marked now: the training thread reports them tainted, whenever
            return None  # their aborts return
        thread = threading.Thread(
            target=abort_marked, args=(stalled,), name="ew-early-release", daemon=True
        )
        thread.start()
        return thread


def device_groups(trainer: Trainer | None) -> list[Group]:
    """The process groups of ``trainer``'s device plane, as a thread other than the
    training thread sees them (a trainer being replaced gives its old groups, which the
    change has released already). Not the TP group: its members fail as one rank, so a
    failure elsewhere leaves its collectives to complete (the executor still aborts it
    if work on it is left when the rank stops)."""
    return [] if trainer is None else trainer.device.process_groups()
