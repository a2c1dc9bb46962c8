"""Device pacing: make a CPU worker keep the time of a modelled accelerator.

On a 2-core CPU shared by many workers, real compute is too small and too contended to
show pipeline dynamics. With ``--device emulated`` each worker trains for real (gloo on
CPU, the numbers are the real numbers) but keeps the time of a modelled device: after
each layer block's real forward or backward it waits out the rest of the time the cost
model (:mod:`elaswave.engine.cost`) gives for that work at the device's current clock,
its point-to-point sends are delivered after the modelled transfer time, and each
optimizer step lasts at least the modelled DP collectives. As long as the real work is
shorter than the modelled work, step times, bubbles, stragglers and MTTR follow the model,
not the host: these figures are *emulated*, and every output says so.

A fail-slow fault (``slow:RANK=FACTOR@STEP``) multiplies this rank's compute time from
that step on; on real devices (``cpu``, ``cuda``, ``npu``) it is emulated the same way by
waiting ``FACTOR - 1`` times the measured compute.
"""

from __future__ import annotations

import heapq
import itertools
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import structlog

from elaswave.engine.cost import DeviceSpec, LayerCost, compute_time, p2p_time
from elaswave.engine.cost import ring_allreduce_time as ring_time
from elaswave.runtime.worker.frequency import EmulatedFrequency

log = structlog.get_logger(__name__)

SPIN_S = 2e-4
"""The last part of an emulated wait spent reading the clock instead of sleeping. The
kernel wakes a sleeper about 0.1 ms late on this kind of host (timer slack and the
scheduler's wake-up), and a pipeline of short emulated actions adds that up along its
critical path: 24 actions of 5 ms each on a stage of ``dp1 x pp4`` under ZB-H1 lost 3 ms
a step to it. Polling costs at most this much CPU per wait."""


def sleep_until(deadline: float) -> None:
    """Return at ``deadline`` (``time.perf_counter``), within microseconds: sleep to
    :data:`SPIN_S` before it, then poll the clock."""
    ahead = deadline - time.perf_counter() - SPIN_S
    if ahead > 0:
        time.sleep(ahead)
    while time.perf_counter() < deadline:
        pass


def precise_sleep(seconds: float) -> None:
    """``time.sleep`` that ends on time (:func:`sleep_until`)."""
    sleep_until(time.perf_counter() + seconds)


@dataclass
class StepClock:
    """What one step's compute cost on this rank, for the fail-slow detector."""

    compute_s: float = 0.0
    """Forward plus backward seconds (modelled when emulated, else measured)."""
    expected_s: float = 0.0
    """The same work without slowdown, priced by the cost model (at the current clock
    when emulated), 0 when unknown."""
    micro_batches: int = 0
    overruns: int = 0
    """Emulated compute blocks whose real compute took longer than the model allowed
    (the emulation fell behind: the host is too slow or too loaded for the model)."""


@dataclass
class Pacer:
    """Keeps one worker on the time of its modelled device (or adds a fail-slow delay).

    ``model`` is None on real devices: then only a slowdown factor above 1 adds waiting.
    """

    model: DeviceSpec | None
    layers: dict[int, LayerCost]
    """Cost of every layer of the model, by global layer index."""
    frequency: EmulatedFrequency | None = None
    """The emulated clock (the DVFS executor sets it); None on real devices."""
    reference: DeviceSpec | None = None
    """The device ``expected_s`` is priced on when ``model`` is None (real devices): the
    fail-slow detector compares ranks by measured over expected time, so the expected
    time only has to be proportional to each rank's work."""
    slowdown: float = 1.0
    """Fail-slow factor applied to compute time."""
    clock: StepClock = field(default_factory=StepClock)
    sleep: Callable[[float], None] = precise_sleep
    waited: Callable[[], float] | None = None
    """Seconds this process has spent in its layers' own collectives so far (its TP
    group's, :class:`~elaswave.runtime.worker.tpgroup.TpLink`): on real devices a fail-slow
    factor stretches the compute of a layer, not its wait for the other members (two
    slowed members would otherwise stretch each other's waits without end)."""
    _waited_mark: float = 0.0

    @property
    def emulated(self) -> bool:
        return self.model is not None

    @property
    def mhz(self) -> float:
        assert self.model is not None
        return self.frequency.get_mhz(0) if self.frequency is not None else self.model.base_mhz

    def begin_step(self) -> None:
        self.clock = StepClock()

    def _flops(self, layer_ids: Sequence[int], samples: int, backward: bool) -> float:
        per = (lambda c: c.bwd_flops_per_sample) if backward else (lambda c: c.fwd_flops_per_sample)
        return samples * sum(per(self.layers[i]) for i in layer_ids)

    def compute(
        self,
        layer_ids: Sequence[int],
        samples: int,
        started: float,
        *,
        backward: bool,
        part: float = 1.0,
    ) -> None:
        """Called right after the real compute of ``layer_ids`` on ``samples`` samples,
        which began at ``started`` (``time.perf_counter``): wait out the modelled rest.
        ``part``: the share of the backward it was (one half of a split backward)."""
        measured = time.perf_counter() - started
        flops = self._flops(layer_ids, samples, backward) * part
        if self.model is None:
            own = measured
            if self.waited is not None:  # the collectives' share is not this rank's compute
                now = self.waited()
                own = max(0.0, measured - (now - self._waited_mark))
                self._waited_mark = now
            spent = measured + own * (self.slowdown - 1.0)
            reference = self.reference
            expected = (
                0.0 if reference is None else compute_time(flops, reference, reference.base_mhz)
            )
        else:
            expected = compute_time(flops, self.model, self.mhz)
            spent = expected * self.slowdown
        self.clock.compute_s += spent
        self.clock.expected_s += expected
        if not backward:
            self.clock.micro_batches += 1
        if not self._wait_until(started + spent) and self.model is not None:
            self.clock.overruns += 1

    def p2p_delay(self, num_bytes: int) -> float:
        """Seconds a send of ``num_bytes`` takes on the modelled link (0 on real devices)."""
        return 0.0 if self.model is None else p2p_time(num_bytes, self.model)

    def transfer(self, num_bytes: int, started: float) -> None:
        """Called after a blocking point-to-point transfer of ``num_bytes`` (one rank's
        share of a recovery's moves) begun at ``started``: wait out its modelled time."""
        if self.model is not None and num_bytes > 0:
            self._wait_until(started + p2p_time(num_bytes, self.model))

    def collectives(self, num_bytes: int, dp: int, started: float) -> None:
        """Called after a step's reduce-scatter and all-gather of a ``num_bytes`` bucket
        over ``dp`` ranks, begun at ``started``: wait out their modelled time."""
        if self.model is not None and dp > 1:
            self._wait_until(started + ring_time(num_bytes, self.model, dp=dp))

    def _wait_until(self, deadline: float) -> bool:
        """Sleep until ``deadline``; False if it had already passed."""
        remaining = deadline - time.perf_counter()
        if remaining > 0:
            self.sleep(remaining)
            return True
        return False


W = TypeVar("W")


class _Poster:
    """One thread per process that runs callbacks at their due times (the delayed sends
    of an emulated device): a send is a push on its heap, not a thread of its own
    (``threading.Timer`` started one per send, on the sender's critical path)."""

    def __init__(self) -> None:
        self._due: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._changed = threading.Condition()
        threading.Thread(target=self._run, name="delayed-sends", daemon=True).start()

    def at(self, deadline: float, fire: Callable[[], None]) -> None:
        """Run ``fire`` on the poster's thread at ``deadline`` (``time.perf_counter``)."""
        with self._changed:
            heapq.heappush(self._due, (deadline, next(self._order), fire))
            self._changed.notify()

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._due or self._due[0][0] - time.perf_counter() > SPIN_S:
                    left = self._due[0][0] - time.perf_counter() - SPIN_S if self._due else None
                    self._changed.wait(left)
                deadline, _, fire = heapq.heappop(self._due)
            sleep_until(deadline)
            fire()


_POSTER: tuple[int, _Poster] | None = None
_POSTER_LOCK = threading.Lock()


def _poster() -> _Poster:
    """This process's poster, started on first use (a forked child starts its own)."""
    global _POSTER
    with _POSTER_LOCK:
        if _POSTER is None or _POSTER[0] != os.getpid():
            _POSTER = (os.getpid(), _Poster())
        return _POSTER[1]


class DelayedSend(Generic[W]):
    """A point-to-point send posted after the modelled transfer time, off the caller's
    thread (the process's :class:`_Poster`), so that compute goes on meanwhile;
    :meth:`work` waits for the post."""

    def __init__(self, post: Callable[[], W], delay_s: float) -> None:
        self._posted = threading.Event()
        self._work: tuple[W] | None = None
        self._error: BaseException | None = None
        self._post = post
        _poster().at(time.perf_counter() + delay_s, self._fire)

    def _fire(self) -> None:
        try:
            self._work = (self._post(),)
        except BaseException as exc:
            self._error = exc
        finally:
            self._posted.set()

    def work(self, timeout_s: float) -> W:
        if not self._posted.wait(timeout_s):
            raise TimeoutError(f"a delayed send was not posted within {timeout_s:g} s")
        if self._error is not None:
            raise self._error
        assert self._work is not None  # posted without an error
        return self._work[0]
