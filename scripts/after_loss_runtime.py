"""Throughput after a loss in three stages, emulated device, real processes: the plan
the planner picks under ``--schedule auto`` against today's 1F1B plan for the same
losses, both against the fault-free job on 1F1B.

    .venv/bin/python scripts/after_loss_runtime.py [--steps 24] [--kill-step 8]
        [--out runs/after_loss] [--json FILE]

Job: dp=4 x pp=4 (16 processes), 16 layers (embedding, 14 blocks, head), global batch
64, micro-batch 2, ``--device emulated`` (the cost model's accelerator keeps the time;
the numbers are real). Rank 1, 5 and 9 (replica 1 of stages 0, 1 and 2) are SIGKILLed
in the forward of ``--kill-step``; no rank joins. Throughput is the global batch over
the median step time of a window: fault-free, steps 3 to the end; after the loss, from
two steps after the redone step to the end. Linear share of the ranks left: 13/16.
Every run's losses and parameters are compared with the fault-free one. EMULATED.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from elastic_throughput import MODEL_TOML, rate, train

from elaswave.runtime.core.compare import compare_runs

ROOT = Path(__file__).resolve().parents[1]
JOB = [
    "--device", "emulated", "--dp", "4", "--pp", "4",
    "--global-batch", "64", "--micro-batch", "2",
]  # fmt: skip
LOST = (1, 5, 9)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--kill-step", type=int, default=8)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "after_loss")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    kills = [x for r in LOST for x in ("--fault", f"kill:{r}@{args.kill_step}:forward")]
    steps = ["--steps", str(args.steps)]
    configs = {
        "fault-free 1f1b": ("free_1f1b", ["--schedule", "1f1b"]),
        "loss, 1f1b": ("loss_1f1b", [*kills, "--schedule", "1f1b"]),
        "loss, auto": ("loss_auto", [*kills, "--schedule", "auto"]),
    }
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "model.toml"
        config.write_text(MODEL_TOML)
        runs = {
            name: train(args.out / out, config, *steps, *flags, job=JOB)
            for name, (out, flags) in configs.items()
        }
    base = rate(runs["fault-free 1f1b"], 3, args.steps)
    rows = {}
    for name, summary in runs.items():
        lo = summary.recoveries[-1].step + 2 if summary.recoveries else 3
        after = rate(summary, lo, args.steps)
        diff = compare_runs(args.out / configs[name][0], args.out / "free_1f1b")
        rows[name] = {
            "samples_per_s": after, "vs_fault_free": after / base, "window": [lo, args.steps],
            "loss_rel": diff.loss_rel, "param_rel": diff.param_rel,
            "recoveries": [r.reason for r in summary.recoveries],
        }  # fmt: skip
    print(f"emulated dp4 x pp4, ranks {list(LOST)} killed at step {args.kill_step}; "
          f"linear share 13/16 = {13 / 16:.4f}")  # fmt: skip
    print("| run | samples/s | vs fault-free 1F1B | loss rel | param rel |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['samples_per_s']:.2f} | {r['vs_fault_free']:.4f} | "
              f"{r['loss_rel']:.1e} | {r['param_rel']:.1e} |")  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
