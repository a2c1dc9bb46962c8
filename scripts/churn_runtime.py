"""Elastic training under churn, on real processes: a 20-event trace on dp=3 x pp=2.

    .venv/bin/python scripts/churn_runtime.py [--out docs] [--steps 30]

The job runs on the emulated device (modelled compute and transfers; real processes,
real SIGKILL and SIGSTOP, the real bus), 2 ranks per node, under TRACE: slow ranks,
kills in several phases, a hang, a node kill, ranks killed in the same step, a slow
rank that then dies, joins in bursts and joins during other changes, and stage 1 lost
whole (its last ranks die in step 9 before any joiner reaches it, so a stage-0 rank
moves to stage 1 and rebuilds it from the host snapshots kept in stage 0). It is
compared with the same job without faults (losses and final parameters, relative), and
``elaswave replay`` recomputes every plan from the event log. Writes
OUT/churn_runtime.{md,json}. (The simulator's churn benchmark is scripts/churn.py; this
one needs the host to itself for several minutes, so it is its own script.)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from elaswave.runtime.core.compare import compare_runs
from elaswave.runtime.core.replay import replay_run
from elaswave.runtime.job.results import read_summary

ROOT = Path(__file__).resolve().parents[1]
TRACE = (
    "slow:1=2@1", "slow:4=2@2", "kill:1@3:backward", "join@4", "slow:3=2@4",
    "slow:0=1.5@5", "hang:3@6:forward", "kill:4@9:optimizer", "kill:5@9:forward",
    "join@10", "join@10", "join@11", "slow:2=2@12", "kill-node:0@13:backward",
    "join@14", "join@17", "kill:2@19:grad-sync", "join@20", "join@22", "join@24",
)  # fmt: skip
JOB = ("--device", "emulated", "--dp", "3", "--pp", "2", "--global-batch", "24",
       "--micro-batch", "2", "--ranks-per-node", "2", "--heartbeat-timeout", "2")  # fmt: skip


def train(out: Path, *args: str) -> None:
    cmd = [sys.executable, "-m", "elaswave.cli.main", "train", "--out", str(out), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1200, check=False)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    faults = [x for f in TRACE for x in ("--fault", f)]
    with tempfile.TemporaryDirectory() as tmp:
        run, ref = Path(tmp) / "churn", Path(tmp) / "ref"
        train(run, *JOB, "--steps", str(args.steps), *faults)
        train(ref, *JOB, "--steps", str(args.steps))
        diff = compare_runs(run, ref)
        replayed = replay_run(run)
        summary = read_summary(run)
    recs = summary.recoveries
    moves = []
    before: dict[int, int] = {r: k for k in range(2) for r in range(3 * k, 3 * k + 3)}
    for rec in recs:
        after = {r: k for k, s in enumerate(rec.plan.stages) for r in s.ranks}
        moves += [(rec.step, r, before[r], k) for r, k in after.items() if before.get(r, k) != k]
        before = after
    doc = {
        "trace": list(TRACE),
        "steps": args.steps,
        "steps_completed": summary.steps_completed,
        "loss_rel": diff.loss_rel,
        "param_rel": diff.param_rel,
        "replayed": len(replayed.plans),
        "diverged": None if replayed.diverged is None else replayed.diverged.generation,
        "recoveries": [
            {"kind": str(rec.kind), "ranks": list(rec.ranks), "step": rec.step}
            | {"mttr_s": rec.mttr_s, "bytes_moved": rec.bytes_moved}
            | {"communicators": rec.communicators}
            | {"stages": [list(s.ranks) for s in rec.plan.stages]}
            for rec in recs
        ],
        "stage_moves": moves,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "churn_runtime.json").write_text(json.dumps(doc, indent=1) + "\n")
    kinds = Counter(str(r.kind) for r in recs)
    lines = [
        "# Churn on real processes: a 20-event trace on dp=3 x pp=2 (emulated device)",
        "",
        "`.venv/bin/python scripts/churn_runtime.py` (see its docstring). Emulated device:",
        "modelled compute and transfers; real processes, SIGKILL/SIGSTOP and bus.",
        "",
        f"Trace ({len(TRACE)} events): `{' '.join(TRACE)}`",
        "",
        f"- steps completed: {summary.steps_completed} of {args.steps}",
        f"- against the fault-free run: losses within {diff.loss_rel:.1e}, final "
        f"parameters within {diff.param_rel:.1e} (relative)",
        f"- `elaswave replay`: {len(replayed.plans)} plans reproduced byte for byte"
        + ("" if replayed.diverged is None else f"; DIVERGED at {replayed.diverged.generation}"),
        f"- changes: {len(recs)} ({', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))})",
        "- ranks that changed stage: "
        + (", ".join(f"rank {r} {a} -> {b} at step {s}" for s, r, a, b in moves) or "none"),
        "",
        "Communicators: the most process groups one participant held open under each",
        "plan (device groups, pooled host links, TP group), as the workers report them.",
        "",
        "| step | change | ranks | MTTR s | bytes moved | communicators | stages after |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['step']} | {r['kind']} | {r['ranks']} | {r['mttr_s']:.2f} | {r['bytes_moved']} "
        f"| {r['communicators']} | {r['stages']} |"
        for r in doc["recoveries"]
    ]
    (args.out / "churn_runtime.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if diff.loss_rel > 1e-4 or diff.param_rel > 1e-4 or replayed.diverged is not None:
        raise SystemExit("the churn run does not match its fault-free twin or its replay")


if __name__ == "__main__":
    main()
