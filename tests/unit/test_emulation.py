"""Device pacing (``--device emulated``) and fail-slow fault parsing."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from elaswave.engine.cost import compute_time, device, layer_costs
from elaswave.model.config import TINY
from elaswave.runtime.job.faults import FaultKind, parse_fault
from elaswave.runtime.worker.emulation import (
    DelayedSend,
    Pacer,
    arrival_stamp,
    arrived,
    clock_key,
    precise_sleep,
    sleep_until,
)
from elaswave.runtime.worker.faults import FaultInjector
from elaswave.runtime.worker.frequency import EmulatedFrequency

pytestmark = pytest.mark.timeout(60)

SPEC = device("emulated")
COSTS = {c.index: c for c in layer_costs(TINY, dtype_bytes=4)}


def _pacer(**kwargs) -> tuple[Pacer, list[float]]:
    slept: list[float] = []
    clock = EmulatedFrequency(base_mhz=SPEC.base_mhz, min_mhz=SPEC.min_mhz, max_mhz=SPEC.max_mhz)
    return Pacer(SPEC, COSTS, clock, sleep=slept.append, **kwargs), slept


def test_compute_waits_out_the_modelled_time() -> None:
    pacer, slept = _pacer()
    started = time.perf_counter()
    pacer.compute([1, 2], 2, started, backward=False)
    model = compute_time(2 * (COSTS[1].fwd_flops_per_sample * 2), SPEC, SPEC.base_mhz)
    assert model == pytest.approx(0.020, rel=0.01)  # two tiny blocks, 2 samples: 20 ms
    assert len(slept) == 1 and slept[0] == pytest.approx(model, abs=2e-3)
    assert pacer.clock.compute_s == pytest.approx(model)
    assert pacer.clock.expected_s == pytest.approx(model)
    assert pacer.clock.micro_batches == 1


def test_frequency_and_slowdown_scale_compute() -> None:
    pacer, _ = _pacer(slowdown=2.0)
    assert pacer.frequency is not None
    pacer.frequency.set_mhz(0, SPEC.max_mhz)
    pacer.compute([1], 2, time.perf_counter(), backward=True)
    base = compute_time(2 * COSTS[1].bwd_flops_per_sample, SPEC, SPEC.base_mhz)
    at_max = base * SPEC.base_mhz / SPEC.max_mhz
    assert pacer.clock.compute_s == pytest.approx(2.0 * at_max)
    assert pacer.clock.expected_s == pytest.approx(at_max)  # the work at its clock


def test_overrun_is_counted_when_real_work_exceeds_the_model() -> None:
    pacer, slept = _pacer()
    pacer.compute([1], 2, time.perf_counter() - 1.0, backward=False)  # took a second
    assert slept == [] and pacer.clock.overruns == 1


def test_a_queued_device_runs_compute_on_its_clock_not_the_hosts() -> None:
    """The host issues and goes on; each block starts when the device is free, its data
    has arrived and a GPU's host would have issued it; the step drains the clock."""
    pacer, slept = _pacer(queued=True)
    pacer.begin_step()
    fwd = compute_time(2 * COSTS[1].fwd_flops_per_sample, SPEC, SPEC.base_mhz)  # 10 ms
    t0 = time.perf_counter()
    pacer.compute([1], 2, t0, backward=False)
    pacer.compute([1], 2, time.perf_counter(), backward=False)
    assert slept == [] and time.perf_counter() - t0 < fwd  # nothing waited
    assert pacer.free == pytest.approx(t0 + 2 * fwd, abs=1e-3)  # back to back
    assert pacer.take_span() == pytest.approx((t0 + fwd, t0 + 2 * fwd), abs=1e-3)
    assert pacer.take_span() == (pacer.free, pacer.free)  # nothing queued since: its end
    late = pacer.free + 0.05  # data the modelled link delivers 50 ms after that
    began = time.perf_counter()
    precise_sleep(late + 0.005 - began)  # the host waited, and had it 5 ms after that
    pacer.received(began, [arrival_stamp(late)])
    pacer.compute([1], 2, time.perf_counter(), backward=False)
    assert pacer.free == pytest.approx(late + fwd, abs=1e-4)  # from the link's arrival
    assert pacer.send_delay(0) == pytest.approx(pacer.free - time.perf_counter(), abs=1e-3)
    assert pacer.clock.overruns == 0
    pacer.drain()
    assert time.perf_counter() >= pacer.free


def test_a_queued_device_waits_for_a_host_that_is_slower_than_it() -> None:
    """A block the host computes for longer than the device would: what it produces
    leaves late (an overrun: its sends are due when the host has them), and the host's
    own time between blocks still bounds when the device starts the next."""
    pacer, _ = _pacer(queued=True)
    pacer.begin_step()
    started = time.perf_counter()
    precise_sleep(0.05)  # 50 ms of real work for 10 ms of modelled
    pacer.compute([1], 2, started, backward=False)
    assert pacer.clock.overruns == 1 and pacer.send_delay(0) == pacer.p2p_delay(0)
    precise_sleep(0.1)  # 100 ms of the host's own (Python) time
    issued = time.perf_counter()
    pacer.compute([1], 2, issued, backward=False)
    assert pacer.take_span()[0] == pytest.approx(issued - 0.05, abs=2e-3)  # less real work
    pacer.begin_step()  # what an abandoned step queued is dropped
    assert pacer.free == pytest.approx(time.perf_counter(), abs=1e-3)


def test_an_arrival_stamp_counts_only_on_this_machines_clock() -> None:
    now = time.perf_counter()
    here = arrival_stamp(now - 0.01)
    assert arrived([here], now) == pytest.approx(now - 0.01, abs=1e-6)
    assert arrived([here, arrival_stamp(now - 0.02)], now) == pytest.approx(now - 0.01)
    assert arrived([arrival_stamp(now + 5.0)], now) == now  # never after the host has it
    elsewhere = torch.tensor([round((now - 0.01) * 1e9), clock_key() + 1])
    assert arrived([here, elsewhere], now) == now  # another machine's clock: the host's time


def test_real_device_only_adds_the_slowdown() -> None:
    slept: list[float] = []
    pacer = Pacer(None, COSTS, reference=SPEC, sleep=slept.append)
    pacer.compute([1], 2, time.perf_counter(), backward=False)
    assert slept == [] and not pacer.emulated and pacer.p2p_delay(10**6) == 0.0
    assert pacer.clock.expected_s == pytest.approx(0.010, rel=0.01)  # priced on the reference
    pacer.slowdown = 3.0
    started = time.perf_counter() - 0.01  # 10 ms of real work
    pacer.compute([1], 2, started, backward=False)
    assert len(slept) == 1 and 0.015 < slept[0] < 0.03  # waits 2 x the measured 10 ms


def test_a_slowdown_stretches_compute_not_the_wait_for_tp_members() -> None:
    """Chaos seed 31 case 89: two slowed members of one TP group stretched each other's
    waits (measured time x factor) until a collective timed out."""
    slept: list[float] = []
    waited = [0.0]
    pacer = Pacer(None, COSTS, reference=SPEC, sleep=slept.append, waited=lambda: waited[0])
    pacer.slowdown = 3.0
    started = time.perf_counter() - 0.1  # 100 ms in the layers, 80 of them in collectives
    waited[0] = 0.08
    pacer.compute([1], 2, started, backward=False)
    assert len(slept) == 1 and 0.03 < slept[0] < 0.05  # 2 x the 20 ms of own compute
    started = time.perf_counter() - 0.01  # the next layers: no collective since
    pacer.compute([1], 2, started, backward=False)
    assert 0.015 < slept[1] < 0.03


def test_delayed_send_posts_after_the_delay() -> None:
    posted: list[float] = []
    started = time.perf_counter()
    send = DelayedSend(lambda: posted.append(time.perf_counter()) or "work", 0.05)
    assert send.work(5.0) == "work"
    assert posted[0] - started >= 0.045


def test_delayed_sends_share_one_thread_and_post_in_due_order() -> None:
    """Sends posted out of order of their delays are posted in order of their due times,
    none before it, from one thread whatever their number (not a thread per send)."""
    posted: list[tuple[int, float, str]] = []
    started = time.perf_counter()
    delays = [0.3, 0.1, 0.2, 0.0, 0.1]  # apart by more than a loaded host stalls

    def post(i: int) -> int:
        posted.append((i, time.perf_counter(), threading.current_thread().name))
        return i

    sends = [DelayedSend(lambda i=i: post(i), d) for i, d in enumerate(delays)]
    assert [s.work(5.0) for s in sends] == list(range(len(delays)))
    assert [i for i, _, _ in posted] == [3, 1, 4, 2, 0]  # by due time, ties in send order
    assert all(t - started >= delays[i] for i, t, _ in posted)
    assert {name for _, _, name in posted} == {"delayed-sends"}


def test_a_delayed_send_that_fails_reports_its_error() -> None:
    def post() -> str:
        raise RuntimeError("peer gone")

    with pytest.raises(RuntimeError, match="peer gone"):
        DelayedSend(post, 0.0).work(5.0)
    assert DelayedSend(lambda: "next", 0.0).work(5.0) == "next"  # the poster goes on


def test_a_paced_wait_never_ends_before_its_deadline() -> None:
    for seconds in (0.0, 1e-4, 2e-3):
        started = time.perf_counter()
        precise_sleep(seconds)
        assert time.perf_counter() - started >= seconds
    deadline = time.perf_counter() + 1e-3
    sleep_until(deadline)
    assert time.perf_counter() >= deadline
    sleep_until(deadline - 1.0)  # already past: returns at once


def test_slow_fault_parses_and_applies_from_its_step() -> None:
    spec = parse_fault("slow:3=1.5@10")
    assert (spec.kind, spec.target, spec.step, spec.factor) == (FaultKind.SLOW, 3, 10, 1.5)
    assert str(spec) == "slow:3=1.5@10"
    faults = FaultInjector(3, 1, [spec, parse_fault("slow:3=2@20"), parse_fault("slow:4=3@0")])
    assert [faults.slowdown(s) for s in (9, 10, 19, 20)] == [1.0, 1.5, 1.5, 2.0]
    for bad, message in [
        ("slow:3@10", "slow:RANK=FACTOR@STEP"),
        ("slow:3=0.5@10", "must be above 1"),
        ("kill:3=2@10", "only a slow fault"),
        ("slow:3=2@10:forward", "slow:RANK=FACTOR@STEP"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_fault(bad)
