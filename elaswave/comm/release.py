"""Releasing a device plane's work after a failure: abort in parallel, under a deadline.

Under NCCL (and HCCL, and the ``cpu-strict`` device) an operation that will never
complete (a receive from a dead rank, a collective a dead rank never joins, a receive
that the abandoned step posted ahead) is a kernel spinning on the device that also
stalls every later kernel on its stream; only aborting its communicator ends it. So when
a failure is announced every survivor aborts each device group that holds a failed rank
or has work in flight, all at once (an abort can take about half a second plus 10 ms per
pending kernel), and the groups it aborted are reported tainted: the Core's plan then
has every member rebuild them. Under gloo nothing parks and nothing is aborted: groups
that lost a member are replaced, the rest reused as they are.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import structlog
import torch

from elaswave.comm.group import Group

log = structlog.get_logger(__name__)

ABORT_DEADLINE_S = 10.0
"""How long the aborts of one release may take together before the ones still running
are reported late (the device is then suspect: :attr:`Released.late`)."""


@dataclass(frozen=True)
class Released:
    aborted: tuple[str, ...]
    """Groups aborted, sorted by name."""
    late: tuple[str, ...]
    """Groups whose abort had not returned by the deadline."""
    seconds: float


def must_release(group: Group, failed: Collection[int]) -> bool:
    """Whether ``group`` is aborted when ``failed`` are announced failed: where work
    parks (NCCL), if it holds a failed rank or has work in flight. A gloo group is never
    aborted (a dead peer ends its waits; an abandoned one stays parked on its thread,
    and aborting the group under it would take the process down)."""
    if group.aborted or not group.parks:
        return False
    return bool(set(group.spec.ranks) & set(failed)) or group.tainted


def release(
    groups: Sequence[Group], failed: Collection[int], *, deadline_s: float = ABORT_DEADLINE_S
) -> Released:
    """Abort every group of ``groups`` that :func:`must_release`, in parallel."""
    return abort_all([g for g in groups if must_release(g, failed)], deadline_s=deadline_s)


def abort_all(groups: Sequence[Group], *, deadline_s: float = ABORT_DEADLINE_S) -> Released:
    """Abort ``groups`` in parallel, waiting for them up to ``deadline_s``."""
    return abort_marked(mark_aborted(groups), deadline_s=deadline_s)


def mark_aborted(groups: Sequence[Group]) -> list[Group]:
    """Mark the groups of ``groups`` not aborted yet as aborted (so ``tainted``) at
    once, on the calling thread; returns them, sorted by name, for
    :func:`abort_marked`."""
    chosen = sorted((g for g in groups if not g.aborted), key=lambda g: g.name)
    for group in chosen:
        group.aborted = True
    return chosen


def abort_marked(chosen: Sequence[Group], *, deadline_s: float = ABORT_DEADLINE_S) -> Released:
    """Abort the communicators of ``chosen`` (marked by :func:`mark_aborted`) in parallel,
    waiting for them up to ``deadline_s``."""
    started = time.perf_counter()
    threads = [
        threading.Thread(target=g.abort_communicator, name=f"ew-abort-{g.name}", daemon=True)
        for g in chosen
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + deadline_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    late = tuple(g.name for g, t in zip(chosen, threads, strict=True) if t.is_alive())
    released = Released(tuple(g.name for g in chosen), late, time.perf_counter() - started)
    if chosen:
        log.info("device.released", aborted=released.aborted, late=late, seconds=released.seconds)
    return released


def device_healthy(device: torch.device, *, deadline_s: float = ABORT_DEADLINE_S) -> bool:
    """Whether ``device`` finishes the work queued on it within ``deadline_s`` once its
    communicators are aborted (a kernel that still spins after an abort, or a device
    that stopped answering, means this rank cannot train on: it should leave the job).
    A CPU is always healthy."""
    if device.type != "cuda":
        return True
    done = threading.Event()

    def synchronize() -> None:
        torch.cuda.synchronize(device)
        done.set()

    threading.Thread(target=synchronize, name="ew-device-check", daemon=True).start()
    return done.wait(deadline_s)
