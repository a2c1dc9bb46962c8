"""Train the same job on every dp x pp x tp layout of up to 8 processes and compare each
with dp=1 x pp=1 x tp=1.

    .venv/bin/python scripts/layout_invariance.py [--steps 10] [--out runs/layouts]
        [--schedule 1f1b|zb-h1|zb-cost] [--config JOB.toml --tag NAME]

Layouts: tp in {1, 2, 4}, dp x pp x tp <= 8, pp <= 6 (the tiny model's layers), dp
dividing the global batch of 24 (micro-batch 1): dp in {1, 2, 3, 4, 6, 8}. Prints a
table and writes docs/layout_invariance.{json,md} (under ``--schedule zb-h1``, every
layout runs that schedule against the same reference, and the files are
docs/layout_invariance_zb-h1.{json,md}). ``--config``: a job file every layout (the
reference too) trains with, e.g. a recipe of gradient clipping and a learning-rate
schedule; ``--tag`` names its files. Measured on real CPU processes
(gloo); the numbers compared are per-step losses and final parameters, not timings.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tomllib
from pathlib import Path

from elaswave.engine.schedule import Schedule
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


def _sets_model(config: Path | None) -> bool:
    return config is not None and "model" in tomllib.loads(config.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "layouts")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs")
    parser.add_argument("--schedule", choices=[x.value for x in Schedule], default="1f1b")
    parser.add_argument("--config", type=Path, help="a job file every layout trains with")
    parser.add_argument("--tag", default="", help="names the files of a --config run")
    args = parser.parse_args()
    dirs = {}
    for dp, pp, tp in LAYOUTS:
        out = args.out / f"dp{dp}_pp{pp}_tp{tp}"
        reference = (dp, pp, tp) == (1, 1, 1)
        schedule = "1f1b" if reference else args.schedule
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
            "--schedule",
            schedule,
            *(["--config", str(args.config)] if args.config else []),
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
                "eval_rel_diff": diff.eval_rel,
                "param_digest": read_summary(out).param_digest[:12],
            }
        )
    evaluated = bool(read_summary(ref).eval_steps)
    suffix = "" if args.schedule == "1f1b" else f"_{args.schedule}"
    flag = "" if args.schedule == "1f1b" else f" --schedule {args.schedule}"
    if args.config:
        suffix += f"_{args.tag}" if args.tag else "_config"
        flag += f" --config {args.config} --tag {args.tag}"
    lines = [
        f"Layout invariance: {args.steps} steps, "
        + ("the job file's model" if _sets_model(args.config) else "tiny model, dropout 0.1")
        + f", global batch "
        f"{GLOBAL_BATCH}, micro-batch 1, schedule {args.schedule}, reference dp=1 x pp=1 x "
        "tp=1 under 1f1b (tolerance 1e-5)"
        + (f"; every layout with {args.config}" if args.config else ""),
        "",
        f"    .venv/bin/python scripts/layout_invariance.py{flag}",
        "",
        "| dp | pp | tp | processes | final loss | max rel loss diff | rel param diff | digest |"
        + (" max rel held-out loss diff |" if evaluated else ""),
        "|---|---|---|---|---|---|---|---|" + ("---|" if evaluated else ""),
    ]
    lines += [
        f"| {r['dp']} | {r['pp']} | {r['tp']} | {r['dp'] * r['pp'] * r['tp']} | "
        f"{r['final_loss']:.6f} | {r['loss_rel_diff']:.2e} | "
        f"{r['param_rel_diff']:.2e} | {r['param_digest']} |"
        + (f" {r['eval_rel_diff']:.2e} |" if evaluated else "")
        for r in rows
    ]
    text = "\n".join(lines)
    print(text)
    args.docs.mkdir(exist_ok=True)
    (args.docs / f"layout_invariance{suffix}.md").write_text(text + "\n")
    (args.docs / f"layout_invariance{suffix}.json").write_text(json.dumps(rows, indent=2) + "\n")
    worst = max(max(r["loss_rel_diff"], r["param_rel_diff"], r["eval_rel_diff"]) for r in rows)
    return 0 if worst <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
