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

The modelled device runs a queue, as a GPU's stream does (``Pacer.queued``, every job
without tensor parallelism): the host issues a block's compute and goes on, the device
clock (``Pacer.free``) starts it when the device is free and its inputs have arrived,
a pipeline send leaves when the clock has produced what it carries and carries when the
modelled link delivers it (:func:`arrival_stamp`: the receiving device starts from that,
not from when its host got the message), and the step waits for the clock before its
gradient reduction (:meth:`Pacer.drain`). The host's own time between actions (Python,
a message's trip between two processes and their threads) then stays out of the
device's time, as it does on a GPU, instead of adding to every action on the pipeline's
critical path. A
host slower than the device still shows: the device cannot start what the host has not
issued, and a send the host posts after its due time leaves late (counted as an
overrun). Under tensor parallelism the members' real collectives inside a block tie
their hosts, not their clocks, so there the device blocks on its compute as before.

A fail-slow fault (``slow:RANK=FACTOR@STEP``) multiplies this rank's compute time from
that step on; on real devices (``cpu``, ``cuda``, ``npu``) it is emulated the same way by
waiting ``FACTOR - 1`` times the measured compute.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

import structlog
import torch

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


@functools.cache
def clock_key() -> int:
    """This machine's boot (``time.perf_counter`` is its monotonic clock, one for every
    process of one boot), 0 where unknown."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")
        return int(boot[:15], 16)
    except (OSError, ValueError):
        return 0


def arrival_stamp(due: float) -> torch.Tensor:
    """What a queued device's pipeline send carries beside its data: when the modelled
    link delivers it (``due``, ``time.perf_counter``) and on which clock."""
    return torch.tensor([round(due * 1e9), clock_key()], dtype=torch.int64)


def stamp_buffer() -> torch.Tensor:
    return torch.empty(2, dtype=torch.int64)


def arrived(stamps: Sequence[torch.Tensor], now: float) -> float:
    """When data that came with ``stamps`` arrived on the modelled link: the latest
    stamp, where every one is on this machine's clock; else ``now``, when the host
    has it. Not later than ``now`` (the sender posts a send at its due time, so the host
    has it later: by the host's own delivery, which is no part of the device's)."""
    key = clock_key()
    due = [ns / 1e9 for ns, k in (t.tolist() for t in stamps) if key and k == key]
    return min(max(due), now) if due and len(due) == len(stamps) else now


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
    queued: bool = False
    """The emulated device runs a queue (see the module's documentation): compute does
    not block the host; False: each block's compute waits out its modelled time."""
    free: float = 0.0
    """When the emulated device finishes the work it has been given
    (``time.perf_counter``)."""
    _ready: float = 0.0
    """When the latest data the host has taken arrived."""
    _ahead: float = 0.0
    """Seconds of this step the host spent on what a GPU's host does not wait for: its
    real compute and its waits for data (a queued device's issue time is the host's
    time less these)."""
    _span: tuple[float, float] | None = None
    _waited_mark: float = 0.0

    @property
    def emulated(self) -> bool:
        return self.model is not None

    @property
    def mhz(self) -> float:
        assert self.model is not None
        return self.frequency.get_mhz(0) if self.frequency is not None else self.model.base_mhz

    def begin_step(self) -> None:
        """A step starts on an idle device (what an abandoned step queued is dropped)."""
        self.clock = StepClock()
        self.free = self._ready = time.perf_counter()
        self._ahead = 0.0

    def received(self, began: float, stamps: Sequence[torch.Tensor] = ()) -> None:
        """The host waited, from ``began``, for data it now has (with ``stamps``, when
        the modelled link delivered it: :func:`arrived`): the device's next work starts
        after it arrived; a queued device's host would not have waited."""
        now = time.perf_counter()
        self._ready = max(self._ready, arrived(stamps, now) if stamps else now)
        if self.queued:
            self._ahead += now - began

    def take_span(self) -> tuple[float, float]:
        """When the device ran the work queued since the last call, for the step's
        timeline; an action with no compute (the first stage's ``I``) at the point its
        data was in and the device free."""
        span, self._span = self._span, None
        if span is not None:
            return span
        at = max(self.free, self._ready)
        return at, at

    def drain(self) -> None:
        """Wait until the device has done what it was given (a no-op unless queued)."""
        if self.queued:
            sleep_until(self.free)

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
        if self.queued and self.model is not None:
            self._queue(spent, started, measured)
            return
        self.free = started + spent
        if not self._wait_until(self.free) and self.model is not None:
            self.clock.overruns += 1

    def _queue(self, spent: float, issued: float, measured: float) -> None:
        """Queue ``spent`` seconds of device work the host issued at ``issued`` (and then
        computed for real in ``measured`` seconds): it starts when the device is free,
        its inputs are in and a GPU's host would have issued it."""
        begin = max(self.free, self._ready, issued - self._ahead)
        self.free = begin + spent
        self._span = (begin, self.free)
        self._ahead += measured
        if time.perf_counter() > self.free:  # what it produced leaves late
            self.clock.overruns += 1

    def p2p_delay(self, num_bytes: int) -> float:
        """Seconds a send of ``num_bytes`` takes on the modelled link (0 on real devices):
        one issued on a stream of its own, whose data is ready (a layer's parameters)."""
        return 0.0 if self.model is None else p2p_time(num_bytes, self.model)

    def send_delay(self, num_bytes: int) -> float:
        """Seconds from now until a send of ``num_bytes`` that the device's compute
        produced (issued after it) is delivered: the rest of the queued compute, then
        the modelled link."""
        if self.model is None:
            return 0.0
        return max(0.0, self.free - time.perf_counter()) + p2p_time(num_bytes, self.model)

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
