"""How long a restarted Core takes to read its predecessor's state back, by log length.

    .venv/bin/python scripts/bench_core_restore.py [--ranks 64] [--steps 1000 4000 16000]

For each length, an event log of a steady job is written (every rank's StepCompleted
and StepTiming of every step, a heartbeat a rank every five steps: more than the Core
logged before the health log, where a StepCompleted is the last stage's alone; with
``--health-apart``, what it logs since: a step's first timing and StepCompleted, and
each rank's first timing and heartbeat), and a Core restores from it three ways, each
in a fresh process (its peak memory is its own):

- ``whole``: from the whole log (no restore point);
- ``point``: from a restore point taken at the log's end;
- ``point+tail``: from a point as many bytes before the end as the Core lets its log grow
  between points (:data:`~elaswave.runtime.core.restorepoint.RESTORE_EVERY`, or twice
  the point's size if more): the most log a restart reads after its point.

The supervisor's persisted state has taken in the whole log in each. Reported: seconds
from the Core's start to its serving (the restore and the bus's binding), records read
back, and the process's peak RSS. Writes docs/core_restore.{md,json} unless ``--out``
says otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from elaswave.bus.codec import encode
from elaswave.bus.eventlog import EventLogWriter
from elaswave.bus.schema import Heartbeat, StepCompleted, StepTiming, sender_name
from elaswave.rundir import EVENT_LOG, RESTORE_POINT
from elaswave.runtime.core.recorder import Core
from elaswave.runtime.core.restorepoint import RESTORE_EVERY

ROOT = Path(__file__).resolve().parents[1]
WAYS = ("whole", "point", "point+tail")


def write_log(run_dir: Path, ranks: int, steps: int, start: int = 0, apart: bool = False) -> int:
    """Append ``steps`` steps of ``ranks`` ranks' events from step ``start``; the log's
    length. ``apart``: what the event log holds of them since the health log
    (:data:`~elaswave.runtime.core.recorder.HEALTH_CHATTER`): a step's first timing and
    the StepCompleted of the last stage's first rank, and each rank's first timing and
    heartbeat."""
    if apart:
        return write_apart(run_dir, ranks, steps, start)
    with EventLogWriter(run_dir / EVENT_LOG) as log:
        for step in range(start, start + steps):
            t = 1.8e9 + step
            for rank in range(ranks):
                stamp = {"sender": sender_name(rank), "time": t}
                health = 2 * step
                events: list[Any] = [
                    StepTiming(
                        **stamp, seq=health + 2, rank=rank, step=step, compute_s=0.4,
                        expected_s=0.4, micro_batches=8,
                    ),
                    StepCompleted(
                        **stamp, seq=step + 1, rank=rank, step=step, loss=2.0,
                        step_time_s=1.0, samples=8,
                    ),
                ]  # fmt: skip
                if step % 5 == 0:
                    events.insert(0, Heartbeat(**stamp, seq=health + 1, rank=rank, step=step))
                for event in events:
                    log.append(encode(event), t)
        return log.position


def write_apart(run_dir: Path, ranks: int, steps: int, start: int) -> int:
    with EventLogWriter(run_dir / EVENT_LOG) as log:
        for step in range(start, start + steps):
            t = 1.8e9 + step
            firsts = range(ranks) if step == 0 else range(1)  # what the protocol learns
            for rank in firsts:
                timing = StepTiming(
                    sender=sender_name(rank), seq=step + 2, time=t, rank=rank, step=step,
                    compute_s=0.4, expected_s=0.4, micro_batches=8,
                )  # fmt: skip
                log.append(encode(timing), t)
            if step == 0:
                for rank in range(ranks):
                    beat = Heartbeat(sender=sender_name(rank), seq=1, rank=rank, step=0, time=t)
                    log.append(encode(beat), t)
            last = ranks - 1
            done = StepCompleted(
                sender=sender_name(last), seq=step + 1, time=t, rank=last, step=step, loss=2.0,
                step_time_s=1.0, samples=8,
            )  # fmt: skip
            log.append(encode(done), t)
        return log.position


async def take_point(run_dir: Path) -> None:
    """Restore from the whole log and take a restore point at its end."""
    size = (run_dir / EVENT_LOG).stat().st_size
    async with Core(run_dir, nonce="bench", restore=True, taken=size) as core:
        await core.save_point()


async def restore(run_dir: Path) -> dict[str, Any]:
    size = (run_dir / EVENT_LOG).stat().st_size
    started = time.perf_counter()
    async with Core(run_dir, nonce="bench", restore=True, taken=size) as core:
        seconds = time.perf_counter() - started
        return {"seconds": round(seconds, 3), "records": core.restored}


def peak_rss_mib() -> int:
    """This process's peak resident memory (VmHWM: getrusage's maxrss keeps the
    parent's from before the exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def child(run_dir: Path) -> None:
    """One restore in this process: its figures as JSON on stdout."""
    figures = asyncio.run(restore(run_dir))
    figures["peak_rss_mib"] = peak_rss_mib()
    print(json.dumps(figures))


def measure(run_dir: Path) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(run_dir)],
        check=True,
        capture_output=True,
        text=True,
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def one_length(ranks: int, steps: int, scratch: Path, apart: bool) -> dict[str, Any]:
    run_dir = scratch / f"s{steps}"
    run_dir.mkdir()
    size = write_log(run_dir, ranks, steps, apart=apart)
    row: dict[str, Any] = {"ranks": ranks, "steps": steps, "log_mib": round(size / 2**20, 1)}
    row["whole"] = measure(run_dir)
    asyncio.run(take_point(run_dir))
    row["point_mib"] = round((run_dir / RESTORE_POINT).stat().st_size / 2**20, 1)
    row["point"] = measure(run_dir)
    per_step = size / steps
    every = max(RESTORE_EVERY, 2 * (run_dir / RESTORE_POINT).stat().st_size)
    tail_steps = int(every / per_step)
    write_log(run_dir, ranks, tail_steps, start=steps, apart=apart)
    row["point+tail"] = measure(run_dir)
    row["tail_mib"] = round((run_dir / EVENT_LOG).stat().st_size / 2**20 - size / 2**20, 1)
    shutil.rmtree(run_dir)
    return row


def report(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| ranks | steps | log MiB | point MiB | "
        + " | ".join(f"{w} s (records, peak MiB)" for w in WAYS)
        + " |",
        "|---:|---:|---:|---:|" + "---:|" * len(WAYS),
    ]
    for r in rows:
        cells = [f"{r[w]['seconds']:.2f} ({r[w]['records']}, {r[w]['peak_rss_mib']})" for w in WAYS]
        lines.append(
            f"| {r['ranks']} | {r['steps']} | {r['log_mib']} | {r['point_mib']} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--steps", type=int, nargs="+", default=[1000, 4000, 16000])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "core_restore")
    parser.add_argument(
        "--health-apart",
        action="store_true",
        help="write the event log as it is since the health log: two records a step",
    )
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for steps in args.steps:
            rows.append(one_length(args.ranks, steps, Path(tmp), args.health_apart))
            print(report(rows[-1:]).splitlines()[-1], flush=True)
    table = report(rows)
    print(table)
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(table + "\n")


if __name__ == "__main__":
    main()
