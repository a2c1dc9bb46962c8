"""Train the same job on six dp x pp layouts and compare each with dp=1 x pp=1.

    .venv/bin/python scripts/layout_invariance.py [--steps 20] [--out runs/layouts]

Prints a table and writes docs/layout_invariance.{json,md}. Measured on real CPU
processes (gloo); the numbers compared are losses and parameters, not timings.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from elaswave.runtime.compare import compare_runs, load_summary

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (2, 4)]
ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "layouts")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs")
    args = parser.parse_args()
    dirs = {}
    for dp, pp in LAYOUTS:
        out = args.out / f"dp{dp}_pp{pp}"
        cmd = [
            sys.executable,
            "-m",
            "elaswave.cli.main",
            "train",
            "--dp",
            str(dp),
            "--pp",
            str(pp),
            "--steps",
            str(args.steps),
            "--global-batch",
            "16",
            "--micro-batch",
            "2",
            "--out",
            str(out),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            print(proc.stderr, file=sys.stderr)
            return 1
        dirs[(dp, pp)] = out
    ref = dirs[(1, 1)]
    rows = []
    for (dp, pp), out in dirs.items():
        diff = compare_runs(out, ref)
        rows.append(
            {
                "dp": dp,
                "pp": pp,
                "final_loss": load_summary(out)["loss"][-1],
                "loss_rel_diff": diff.loss_rel,
                "param_rel_diff": diff.param_rel,
                "param_digest": load_summary(out)["param_digest"][:12],
            }
        )
    lines = [
        f"Layout invariance: {args.steps} steps, tiny model, dropout 0.1, global batch 16, "
        "reference dp=1 x pp=1 (tolerance 1e-5)",
        "",
        "| dp | pp | final loss | max rel loss diff | rel param diff | digest |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['dp']} | {r['pp']} | {r['final_loss']:.6f} | {r['loss_rel_diff']:.2e} | "
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
