"""Train the same job on every dp x pp x tp layout of up to 8 processes and compare each
with dp=1 x pp=1 x tp=1.

    .venv/bin/python scripts/layout_invariance.py [--steps 10] [--out runs/layouts]

Layouts: tp in {1, 2, 4}, dp x pp x tp <= 8, pp <= 6 (the tiny model's layers), dp
dividing the global batch of 24 (micro-batch 1): dp in {1, 2, 3, 4, 6, 8}. Prints a
table and writes docs/layout_invariance.{json,md}. Measured on real CPU processes
(gloo); the numbers compared are per-step losses and final parameters, not timings.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from elaswave.runtime.core.compare import compare_runs
from elaswave.runtime.job.results import read_summary

GLOBAL_BATCH = 24
LAYOUTS = [
    (dp, pp, tp)
    for tp in (1, 2, 4)
    for dp in (1, 2, 3, 4, 6, 8)
    for pp in range(1, 7)
    if dp * pp * tp <= 8 and GLOBAL_BATCH % dp == 0
]
ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "layouts")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs")
    args = parser.parse_args()
    dirs = {}
    for dp, pp, tp in LAYOUTS:
        out = args.out / f"dp{dp}_pp{pp}_tp{tp}"
        cmd = [
            sys.executable,
            "-m",
            "elaswave.cli.main",
            "train",
            "--dp",
            str(dp),
            "--pp",
            str(pp),
            "--tp",
            str(tp),
            "--steps",
            str(args.steps),
            "--global-batch",
            str(GLOBAL_BATCH),
            "--micro-batch",
            "1",
            "--out",
            str(out),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            print(proc.stderr, file=sys.stderr)
            return 1
        dirs[(dp, pp, tp)] = out
        print(f"dp{dp} x pp{pp} x tp{tp}: done", file=sys.stderr, flush=True)
    ref = dirs[(1, 1, 1)]
    rows = []
    for (dp, pp, tp), out in dirs.items():
        diff = compare_runs(out, ref)
        rows.append(
            {
                "dp": dp,
                "pp": pp,
                "tp": tp,
                "final_loss": read_summary(out).loss[-1],
                "loss_rel_diff": diff.loss_rel,
                "param_rel_diff": diff.param_rel,
                "param_digest": read_summary(out).param_digest[:12],
            }
        )
    lines = [
        f"Layout invariance: {args.steps} steps, tiny model, dropout 0.1, global batch "
        f"{GLOBAL_BATCH}, micro-batch 1, reference dp=1 x pp=1 x tp=1 (tolerance 1e-5)",
        "",
        "    .venv/bin/python scripts/layout_invariance.py",
        "",
        "| dp | pp | tp | processes | final loss | max rel loss diff | rel param diff | digest |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['dp']} | {r['pp']} | {r['tp']} | {r['dp'] * r['pp'] * r['tp']} | "
        f"{r['final_loss']:.6f} | {r['loss_rel_diff']:.2e} | "
        f"{r['param_rel_diff']:.2e} | {r['param_digest']} |"
        for r in rows
    ]
    text = "\n".join(lines)
    print(text)
    args.docs.mkdir(exist_ok=True)
    (args.docs / "layout_invariance.md").write_text(text + "\n")
    (args.docs / "layout_invariance.json").write_text(json.dumps(rows, indent=2) + "\n")
    worst = max(max(r["loss_rel_diff"], r["param_rel_diff"]) for r in rows)
    return 0 if worst <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
