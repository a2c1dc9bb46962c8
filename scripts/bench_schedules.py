"""Fault-free pipelines under each schedule on the emulated device (real processes, the
device's time kept by the cost model): samples/s of ZB-H1 against 1F1B from interleaved
pairs, and each run's measured bubble against the bubble ``engine/steptime`` predicts
for the same action lists.

    .venv/bin/python scripts/bench_schedules.py [--pairs 3] [--steps 12] [--pp 4]
        [--global-batch 8] [--micro-batch 1] [--partition balanced] [--out runs/schedules]
        [--json FILE]

The layers are cut by the cost model (``--partition balanced``: on the tiny model, one
block a stage, the embedding and the head beside the first and last), as the
zero-bubble schedules assume stages of equal time; ``--partition even`` cuts by count.

A run's step time is the median of the summary's ``step_time_s`` after the first
``--skip`` steps. Its bubble is ``1 - busy / (pp x span)``, where ``span`` is the median
of the first stage's pipeline part of the step (from its start to the end of its last
action and sends, before the optimizer step: the part the simulation prices, in which
the first stage starts first) and ``busy`` the compute
the emulated device keeps per stage (the cost model's, so the same in the measurement
and the prediction); the predicted bubble is the same expression of the first stage's
pipeline part in :func:`elaswave.engine.steptime.plan_step_time` of the job's plan under
its schedule (``compute_end_s[0]``: under ZB-H1 the last stage, with the head, ends a
little after the first, so the predicted step is not the first stage's part). The order
of the two schedules alternates from pair to pair, so that drift of the shared machine
hits both alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from elaswave.engine.schedule import Schedule
from elaswave.engine.steptime import plan_step_time
from elaswave.runtime.job.config import JobConfig
from elaswave.runtime.job.results import read_summary, read_worker_results
from elaswave.runtime.job.sections import LayoutConfig, ScheduleConfig

ROOT = Path(__file__).resolve().parents[1]
SCHEDULES = (Schedule.ONE_F_ONE_B, Schedule.ZB_H1)


def _run(args: argparse.Namespace, schedule: Schedule, out: Path) -> tuple[float, float]:
    """Train once; the median step time after the skipped steps, and the median of the
    first stage's pipeline part of the step (its start to its last action's end, before
    the optimizer step: what the simulation prices)."""
    cmd = [
        sys.executable, "-m", "elaswave.cli.main", "train", "--device", "emulated",
        "--dp", "1", "--pp", str(args.pp), "--steps", str(args.steps),
        "--global-batch", str(args.global_batch), "--micro-batch", str(args.micro_batch),
        "--schedule", str(schedule), "--partition", args.partition, "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    first = next(r for r in read_worker_results(out) if r.stage == 0 and r.replica == 0)
    assert first.pipeline_s is not None
    step = statistics.median(read_summary(out).step_time_s[args.skip :])
    return step, statistics.median(first.pipeline_s[args.skip :])


def _predicted(args: argparse.Namespace, schedule: Schedule) -> tuple[float, float, float]:
    """(step, the first stage's pipeline part, busy seconds of all stages) steptime
    predicts for the job's plan."""
    cfg = JobConfig(
        layout=LayoutConfig(dp=1, pp=args.pp, device="emulated", partition=args.partition),
        schedule=ScheduleConfig(
            global_batch=args.global_batch,
            micro_batch=args.micro_batch,
            pipeline_schedule=schedule,
        ),
    )
    sim = plan_step_time(cfg.plan(), cfg.layer_costs, cfg.cost_device)
    return float(sim.step_s), sim.compute_end_s[0], sum(sim.busy_s)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip", type=int, default=2)
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--partition", default="balanced", help="even or balanced (default)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "schedules")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    steps: dict[Schedule, list[float]] = {s: [] for s in SCHEDULES}
    spans: dict[Schedule, list[float]] = {s: [] for s in SCHEDULES}
    for pair in range(args.pairs):
        order = SCHEDULES if pair % 2 == 0 else SCHEDULES[::-1]
        for schedule in order:
            step, span = _run(args, schedule, args.out / f"{schedule}_{pair}")
            steps[schedule].append(step)
            spans[schedule].append(span)
        ratio = steps[Schedule.ONE_F_ONE_B][-1] / steps[Schedule.ZB_H1][-1]
        print(f"pair {pair}: zb-h1 / 1f1b samples/s {ratio:.3f}", file=sys.stderr, flush=True)
    rows: dict[str, Any] = {}
    for schedule in SCHEDULES:
        pred_step, pred_span, busy = _predicted(args, schedule)
        step = statistics.median(steps[schedule])
        span = statistics.median(spans[schedule])
        bubble = 1.0 - busy / (args.pp * span)
        pred_bubble = 1.0 - busy / (args.pp * pred_span)
        rows[str(schedule)] = {
            "step_s": steps[schedule], "median_step_s": step,
            "pipeline_s": spans[schedule], "median_pipeline_s": span,
            "samples_per_s": args.global_batch / step, "bubble": bubble,
            "predicted_step_s": pred_step, "predicted_pipeline_s": pred_span,
            "predicted_bubble": pred_bubble, "bubble_error": (bubble - pred_bubble) / pred_bubble,
        }  # fmt: skip
    ratios = [a / b for a, b in zip(steps[SCHEDULES[0]], steps[SCHEDULES[1]], strict=True)]
    result = {
        "job": vars(args) | {"out": str(args.out), "json": str(args.json)},
        "schedules": rows,
        "zb_over_1f1b": {"pairs": ratios, "median": statistics.median(ratios)},
    }
    m = args.global_batch // args.micro_batch
    print(f"emulated device, dp1 x pp{args.pp} ({args.partition} partition), "
          f"{m} micro-batches, {args.pairs} interleaved pairs")  # fmt: skip
    print(
        "| schedule | samples/s | step (s) | pipeline part (s) | bubble | predicted step (s) "
        "| predicted pipeline part (s) | predicted bubble | bubble vs prediction |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['samples_per_s']:.2f} | {r['median_step_s']:.4f} | "
            f"{r['median_pipeline_s']:.4f} | {r['bubble']:.3f} | "
            f"{r['predicted_step_s']:.4f} | {r['predicted_pipeline_s']:.4f} | "
            f"{r['predicted_bubble']:.3f} | {r['bubble_error']:+.1%} |"
        )
    print(f"ZB-H1 / 1F1B samples/s: median {result['zb_over_1f1b']['median']:.3f} "
          f"(pairs {', '.join(f'{x:.3f}' for x in ratios)})")  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
