"""How many workers one Core hears: its CPU and a message's delay at N workers' traffic.

    .venv/bin/python scripts/bench_core_capacity.py [--workers 50 100 200 400] [--seconds 10]

A Core (the broker, the log service and the recorder that receives, dispatches and logs
what it keeps of every event: :class:`elaswave.runtime.core.recorder.Core`) runs in this
process on uvloop; a second process publishes, through one PUB socket, what N steady
workers send it at the default liveness settings: each worker's heartbeat every 0.2 s
and its unnumbered beacon every 0.25 s, each under its own sender (a load of 9 N
messages a second). The Core's CPU (every thread of this process: event loop, broker, log service)
and each message's delay from the load's clock to the recorder's dispatch are measured
over ``--seconds`` once the load runs. Not measured: the supervisor's own work (its
heartbeat watch and the change protocol, one task beside the recorder in a job) and
the workers' step events (one or two a step each).

A Core at its limit shows as a delay that grows over the window (messages wait in the
broker's and the recorder's queues) and a CPU near one core (the recorder's loop is one
thread). Writes docs/core_capacity.{md,json} unless ``--out`` says otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvloop
import zmq

from elaswave.bus.codec import encode
from elaswave.bus.schema import Beacon, Event, Heartbeat, sender_name
from elaswave.runtime.core.recorder import Core

ROOT = Path(__file__).resolve().parents[1]
HEARTBEAT_S = 0.2
BEACON_S = 0.25
TICK_S = 0.01
"""The load sends what is due every tick (in bursts of at most this much lag)."""


@dataclass(frozen=True)
class Load:
    workers: int
    seconds: float
    endpoint: str


def _publish(load: Load, ready: Any) -> None:
    """The load process: every worker's heartbeats and beacons, on their clocks."""
    sock = zmq.Context.instance().socket(zmq.PUB)
    sock.setsockopt(zmq.SNDHWM, 1_000_000)
    sock.connect(load.endpoint)
    time.sleep(0.5)  # the broker's subscription reaches this PUB (slow joiner)
    ready.set()
    names = [sender_name(r) for r in range(load.workers)]
    start = time.monotonic()
    # Spread the workers' clocks over their periods, as independent processes are.
    due_beat = [start + HEARTBEAT_S * r / load.workers for r in range(load.workers)]
    due_beacon = [start + BEACON_S * r / load.workers for r in range(load.workers)]
    while (now := time.monotonic()) < start + load.seconds:
        for r, name in enumerate(names):
            while due_beat[r] <= now:
                due_beat[r] += HEARTBEAT_S
                sock.send_multipart(
                    encode(Heartbeat(sender=name, rank=r, step=1, time=time.time()))
                )
            while due_beacon[r] <= now:
                due_beacon[r] += BEACON_S
                beacon = Beacon(  # unnumbered, as a bus client sends it: nothing sent yet
                    sender=name, topics=["control", "metrics"], seqs=[0, 0], time=time.time()
                )
                sock.send_multipart(encode(beacon))
        time.sleep(max(0.0, TICK_S - (time.monotonic() - now)))
    sock.close(linger=1000)


async def _measure(workers: int, seconds: float, warmup_s: float) -> dict[str, Any]:
    delays: list[tuple[float, float]] = []  # (arrival, delay)

    def on_event(event: Event) -> None:
        if event.sender != "core":
            now = time.time()
            delays.append((now, now - event.time))

    with tempfile.TemporaryDirectory() as tmp:
        async with Core(Path(tmp), on_event=on_event) as core:
            listener = asyncio.create_task(core.listen())
            ready = mp.get_context("spawn").Event()
            load = Load(workers, warmup_s + seconds + 1.0, core.publish_endpoint)
            proc = mp.get_context("spawn").Process(target=_publish, args=(load, ready))
            proc.start()
            if not await asyncio.to_thread(ready.wait, 30.0):
                raise SystemExit("the load process did not start")
            await asyncio.sleep(warmup_s)
            cpu0, wall0, n0 = time.process_time(), time.time(), len(delays)
            await asyncio.sleep(seconds)
            cpu, wall = time.process_time() - cpu0, time.time() - wall0
            window = delays[n0:]
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener
            await asyncio.to_thread(proc.join, 30.0)
    if not window:
        raise SystemExit(f"no message reached the Core at {workers} workers")
    half = len(window) // 2
    firsts = [d for _, d in window[:half]] or [0.0]
    lasts = [d for _, d in window[half:]] or [0.0]
    ordered = sorted(d for _, d in window)
    return {
        "workers": workers,
        "offered_msgs_per_s": workers * (1 / HEARTBEAT_S + 1 / BEACON_S),
        "received_msgs_per_s": len(window) / wall,
        "core_cpu_fraction": cpu / wall,
        "cpu_ms_per_msg": 1e3 * cpu / max(1, len(window)),
        "delay_ms_median": 1e3 * statistics.median(ordered),
        "delay_ms_p99": 1e3 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "delay_ms_first_half_median": 1e3 * statistics.median(firsts),
        "delay_ms_second_half_median": 1e3 * statistics.median(lasts),
    }


def _report(rows: list[dict[str, Any]], argv: str) -> str:
    lines = [
        "# How many workers one Core hears",
        "",
        f"    .venv/bin/python scripts/bench_core_capacity.py {argv}".rstrip(),
        "",
        "Each worker: a heartbeat every 0.2 s and a beacon every 0.25 s (9 messages a "
        "second), published by one load process; the Core's recorder receives and "
        "dispatches each, and logs the heartbeats it keeps (one a sender in 5 s). CPU: "
        "every thread of the Core's process over the window, in cores. Delay: the load's "
        "clock to the recorder's dispatch (the same host's clock). "
        f"Host: {os.cpu_count()} CPUs, the load process on them too. Not counted: the "
        "supervisor's heartbeat watch and change protocol, and the workers' step events.",
        "",
        "| workers | offered msg/s | received msg/s | Core CPU (cores) | CPU per msg (ms) "
        "| delay median (ms) | delay p99 (ms) | delay median, 1st / 2nd half (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['workers']} | {r['offered_msgs_per_s']:.0f} | {r['received_msgs_per_s']:.0f} "
            f"| {r['core_cpu_fraction']:.2f} | {r['cpu_ms_per_msg']:.3f} "
            f"| {r['delay_ms_median']:.1f} | {r['delay_ms_p99']:.1f} "
            f"| {r['delay_ms_first_half_median']:.1f} / {r['delay_ms_second_half_median']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[50, 100, 200, 400])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    args = parser.parse_args()
    if any(n < 1 for n in args.workers) or args.seconds <= 0 or args.warmup < 0:
        parser.error("--workers takes positive counts, --seconds a positive time")
    rows = []
    for n in args.workers:
        row = uvloop.run(_measure(n, args.seconds, args.warmup))
        print(json.dumps(row), flush=True)
        rows.append(row)
    argv = f"--workers {' '.join(map(str, args.workers))} --seconds {args.seconds:g}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "core_capacity.json").write_text(json.dumps(rows, indent=1) + "\n")
    (args.out / "core_capacity.md").write_text(_report(rows, argv))
    print(f"wrote {args.out / 'core_capacity.md'}")


if __name__ == "__main__":
    main()
