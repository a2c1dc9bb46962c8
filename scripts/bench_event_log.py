"""What a job's logs hold, by kind of record, and what the event log grows by in a day.

    .venv/bin/python scripts/bench_event_log.py [--tree DIR] [--steps 150] [-- FLAGS]

Trains a job (``elaswave train``, the tiny model on an emulated device, dp4 x pp2 on
two nodes' agents unless FLAGS say otherwise) from the ElasWave tree ``--tree`` (default:
this one; a worktree of an older commit measures that commit's logs), then counts the
records and bytes of RUN_DIR/events.log and of the health log (RUN_DIR/health) by kind.
The figures by kind give what the event log keeps a day of a job of RANKS ranks at a
step a second (``--project``): a record kind sent once a step a rank (step timings)
grows with ranks x steps, once a step (StepCompleted) with steps, a rank's sampled
heartbeats with ranks x seconds, a node agent's with nodes x seconds.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack

from elaswave.bus.eventlog import read_event_log
from elaswave.bus.rolling import read_rolling_log
from elaswave.rundir import EVENT_LOG, HEALTH_LOG

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_FLAGS = ("--dp", "4", "--pp", "2", "--device", "emulated", "--nnodes", "1")


def train(tree: Path, run_dir: Path, steps: int, flags: list[str]) -> float:
    """Run the job from ``tree``; its wall seconds."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    argv = [sys.executable, "-m", "elaswave.cli.main", "train", "--steps", str(steps)]
    argv += ["--out", str(run_dir), *flags]
    started = time.monotonic()
    subprocess.run(argv, check=True, env=env, capture_output=True, cwd=tree)
    return time.monotonic() - started


def tally(records: Any) -> dict[str, dict[str, int]]:
    """kind -> records and bytes (as written: the record's map with its frames)."""
    out: dict[str, dict[str, int]] = collections.defaultdict(lambda: {"records": 0, "bytes": 0})
    for r in records:
        kind = type(r.event).__name__ if r.event is not None else "invalid"
        out[kind]["records"] += 1
        packed = msgpack.packb({"t": r.t, "frames": r.frames}, use_bin_type=True)
        out[kind]["bytes"] += len(packed)
    return dict(out)


def project(
    kinds: dict[str, dict[str, int]], run: dict[str, Any], ranks: int, nodes: int, log: str
) -> int:
    """Bytes a day of ``ranks`` ranks on ``nodes`` nodes at a step a second, from the
    bytes of each kind of record in the measured run (the records a job writes once,
    at its start and end, left out; of the heartbeats and step timings in the event
    log, since the health log, a sender's first, and a step's first timing)."""
    apart = "health" in run["logs"]  # the event log keeps a step's first timing only
    per_step_rank = {"StepTiming"} if log == "health" or not apart else set()
    per_step = {"StepCompleted"}
    one_a_step = {"StepTiming"} - per_step_rank
    per_rank_second = {"Heartbeat"} if log == "health" or not apart else set()
    per_node_second = {"NodeHeartbeat"}
    day = 86_400
    total = 0.0
    for kind, n in kinds.items():
        if kind in one_a_step:  # of a record's size
            total += n["bytes"] / n["records"] * day
        elif kind in per_step_rank:
            total += n["bytes"] / (run["steps"] * run["ranks"]) * ranks * day
        elif kind in per_step:
            total += n["bytes"] / run["steps"] * day
        elif kind in per_rank_second:
            total += n["bytes"] / (run["seconds"] * run["ranks"]) * ranks * day
        elif kind in per_node_second:
            total += n["bytes"] / (run["seconds"] * run["nodes"]) * nodes * day
    return round(total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", type=Path, default=ROOT)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--ranks", type=int, default=8, help="the job's ranks (as FLAGS make)")
    parser.add_argument("--nodes", type=int, default=1, help="the job's nodes (as FLAGS make)")
    parser.add_argument("--project", type=int, nargs="+", default=[64, 1000])
    parser.add_argument("--json", type=Path)
    parser.add_argument("flags", nargs="*", default=list(DEFAULT_FLAGS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        seconds = train(args.tree.resolve(), run_dir, args.steps, args.flags)
        logs = {
            "events": tally(read_event_log(run_dir / EVENT_LOG)),
            "health": tally(read_rolling_log(run_dir / HEALTH_LOG)),
        }
    run = {"steps": args.steps, "ranks": args.ranks, "nodes": args.nodes, "seconds": seconds}
    run["logs"] = [name for name, kinds in logs.items() if kinds]
    doc: dict[str, Any] = {"tree": str(args.tree), "run": run, "logs": logs, "per_day": {}}
    for name, kinds in logs.items():
        size = sum(n["bytes"] for n in kinds.values())
        print(f"{name}: {size} bytes in {sum(n['records'] for n in kinds.values())} records")
        for kind, n in sorted(kinds.items(), key=lambda kv: -kv[1]["bytes"]):
            print(f"  {kind:16s} {n['records']:7d} records {n['bytes']:9d} bytes")
    for ranks in args.project:
        nodes = max(1, ranks // 8)
        day = {name: project(kinds, run, ranks, nodes, name) for name, kinds in logs.items()}
        doc["per_day"][ranks] = day
        print(
            f"a day of {ranks} ranks on {nodes} nodes at a step a second: event log "
            f"{day['events'] / 2**20:.0f} MiB, health log {day['health'] / 2**20:.0f} MiB"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
