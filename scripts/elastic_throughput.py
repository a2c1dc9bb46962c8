"""Throughput after an elastic change, emulated device: the throughput-restoring issue's matrix.

    .venv/bin/python scripts/elastic_throughput.py [--steps 30] [--kill-step 10]

All runs use ``--device emulated``: 16 CPU processes train the real model (numbers are
real) while keeping the time of the cost model's emulated accelerator, so step times
show pipeline dynamics, not the 2-core host. Every figure here is **emulated**.

Job: dp=4 x pp=4, 16 layers (embedding, 14 blocks, head), global batch 64, micro-batch 2.

* Fail-stop: rank 5 (stage 1) is SIGKILLed at ``--kill-step``; the job continues with 15
  workers under each rebalancing policy (resize only, + layer migration, + DVFS). Linear
  scaling efficiency = post-change throughput / pre-change throughput / (15 / 16).
  Each run's losses and final parameters are compared with the fault-free run.
* Fail-slow: rank 5 computes 1.5x and 2x slower from ``--slow-step`` on, without
  mitigation (``--rebalance none``) and with it (``migrate+dvfs``: the detector flags
  the rank, every worker pauses at a step boundary, samples and layers move off it).
  Normalised throughput = throughput after the change / the fault-free run's.

Throughput is the global batch over the median step time of a window: before the change,
steps 3 .. change - 1; after it, from two steps after the redone step to the end.
Writes docs/elastic_throughput.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from elaswave.runtime.compare import compare_runs, load_summary

ROOT = Path(__file__).resolve().parents[1]
MODEL_TOML = '[model]\npreset = "tiny"\nnum_blocks = 14\n'
JOB = [
    "--device", "emulated", "--dp", "4", "--pp", "4",
    "--global-batch", "64", "--micro-batch", "2",
]  # fmt: skip
WORKERS = 16


def train(out: Path, config: Path, *args: str) -> dict:
    cmd = [sys.executable, "-m", "elaswave.cli.main", "train", "--out", str(out)]
    cmd += ["--config", str(config), *JOB, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return load_summary(out)


def rate(summary: dict, lo: int, hi: int) -> float:
    """Samples per second over steps [lo, hi), from the median step time."""
    window = summary["step_time_s"][lo:hi]
    if len(window) < 2:
        raise SystemExit(f"throughput window [{lo}, {hi}) has fewer than 2 steps")
    return summary["global_batch"] / statistics.median(window)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-step", type=int, default=10)
    parser.add_argument("--slow-step", type=int, default=6)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "elastic")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs")
    args = parser.parse_args()
    if not 4 < args.kill_step < args.steps - 6:
        parser.error("--kill-step must leave 4 steps before it and 6 after it")
    args.out.mkdir(parents=True, exist_ok=True)
    config = args.out / "model.toml"
    config.write_text(MODEL_TOML)
    steps = ["--steps", str(args.steps)]
    k = args.kill_step

    base = train(args.out / "baseline", config, *steps)
    base_rate = rate(base, 3, args.steps)
    print(f"baseline: {base_rate:.1f} samples/s (emulated)", flush=True)

    rows = []
    for policy in ("resize", "migrate", "migrate+dvfs"):
        out = args.out / f"kill_{policy.replace('+', '_')}"
        s = train(out, config, *steps, "--fault", f"kill:5@{k}:backward", "--rebalance", policy)
        rec = s["recoveries"][0]
        pre, post = rate(s, 3, k), rate(s, rec["step"] + 2, args.steps)
        diff = compare_runs(out, args.out / "baseline")
        rows.append(
            {
                "policy": policy,
                "pre": pre,
                "post": post,
                "lse": post / pre / ((WORKERS - 1) / WORKERS),
                "mttr_s": rec["mttr_s"],
                "bytes_moved": rec["bytes_moved"],
                "plan": rec["plan"],
                "reason": rec["reason"],
                "loss_rel": diff.loss_rel,
                "param_rel": diff.param_rel,
            }
        )
        r = rows[-1]
        print(
            f"kill, {policy}: {pre:.1f} -> {post:.1f} samples/s, LSE {r['lse']:.3f}, MTTR "
            f"{r['mttr_s']:.2f} s, loss diff {r['loss_rel']:.1e}, params {r['param_rel']:.1e}",
            flush=True,
        )

    slow_rows = []
    for factor in (1.5, 2.0):
        for policy in ("none", "migrate+dvfs"):
            out = args.out / f"slow_{factor:g}_{policy.replace('+', '_')}"
            fault = f"slow:5={factor:g}@{args.slow_step}"
            s = train(out, config, *steps, "--fault", fault, "--rebalance", policy)
            slow = [r for r in s["recoveries"] if r["kind"] == "fail-slow"]
            start = max([args.slow_step + 2] + [r["step"] + 2 for r in slow])
            diff = compare_runs(out, args.out / "baseline")
            slow_rows.append(
                {
                    "factor": factor,
                    "policy": policy,
                    "normalised": rate(s, start, args.steps) / base_rate,
                    "window": [start, args.steps],
                    "mitigated_at": [r["step"] for r in slow],
                    "plan": slow[-1]["plan"] if slow else None,
                    "loss_rel": diff.loss_rel,
                    "param_rel": diff.param_rel,
                }
            )
            r = slow_rows[-1]
            print(
                f"slow {factor:g}x, {policy}: normalised throughput {r['normalised']:.3f} "
                f"(steps {start}-{args.steps - 1}; mitigated at {r['mitigated_at']})",
                flush=True,
            )

    lines = [
        "Elastic throughput, **emulated device** (`--device emulated`: real training on "
        "CPU keeping the cost model's emulated-accelerator time). dp=4 x pp=4, 16 layers, "
        f"global batch 64, micro-batch 2, {args.steps} steps; rank 5 (stage 1) SIGKILLed "
        f"at step {k}. Fault-free run: {base_rate:.1f} samples/s (emulated).",
        "",
        "| policy | before (samples/s) | after (samples/s) | linear scaling efficiency | "
        "MTTR s | optimizer bytes moved | layers per stage after | stage clocks (MHz) | "
        "max rel loss diff | rel param diff |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        layers = [st["layers"][1] - st["layers"][0] for st in r["plan"]["stages"]]
        mhz = [st["mhz"] or "base" for st in r["plan"]["stages"]]
        lines.append(
            f"| {r['policy']} | {r['pre']:.1f} | {r['post']:.1f} | {r['lse']:.3f} | "
            f"{r['mttr_s']:.2f} | {r['bytes_moved']:,} | {layers} | "
            f"{[m if isinstance(m, str) else round(m) for m in mhz]} | "
            f"{r['loss_rel']:.1e} | {r['param_rel']:.1e} |"
        )
    lines += [
        "",
        f"Fail-slow: rank 5 computes FACTOR x slower from step {args.slow_step}. Normalised "
        "throughput = throughput over the window / the fault-free run's (emulated).",
        "",
        "| slowdown | policy | normalised throughput | window (steps) | rebalanced at step | "
        "samples per replica of stage 1 after | layers per stage after | "
        "max rel loss diff | rel param diff |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in slow_rows:
        plan = r["plan"]
        sizes = plan["stages"][1]["sizes"] if plan else "-"
        layers = [st["layers"][1] - st["layers"][0] for st in plan["stages"]] if plan else "-"
        lines.append(
            f"| {r['factor']:g}x | {r['policy']} | {r['normalised']:.3f} | "
            f"{r['window'][0]}-{r['window'][1] - 1} | {r['mitigated_at'] or '-'} | {sizes} | "
            f"{layers} | {r['loss_rel']:.1e} | {r['param_rel']:.1e} |"
        )
    text = "\n".join(lines)
    print(text)
    args.docs.mkdir(exist_ok=True)
    (args.docs / "elastic_throughput.md").write_text(text + "\n")
    (args.docs / "elastic_throughput.json").write_text(
        json.dumps(
            {"baseline_rate": base_rate, "fail_stop": rows, "fail_slow": slow_rows}, indent=2
        )
        + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
