"""Throughput with and without per-step host snapshots, from paired runs.

    .venv/bin/python scripts/snapshot_overhead.py [--pairs 5] [--layouts 2x2 4x2] [--steps 30]

Each pair is the same job run twice back to back, once with snapshots (the default) and
once with ``--no-snapshots``, in alternating order so that drift of the shared machine
hits both sides alike. A run's throughput is the global batch over its median step time
(steps after the first two, which carry start-up costs); the overhead of a pair is
``1 - with / without``, and the figure reported is the median over pairs. Both runs must
end with identical parameters (snapshots never change the numbers).

Wall-clock throughput on this shared 2-core machine swings by 20 % between identical
runs, so each pair also reports the snapshots' CPU cost: the CPU seconds every worker
process spent in its training loop (all threads: training, snapshot keeper, bus), summed
over workers, per step. With more worker processes than cores, throughput is bounded by
that sum, so ``cpu with / cpu without - 1`` is the overhead the machine pays, measured
with less noise. Finally, the snapshot sender and keeper threads account their own CPU
time (``time.thread_time``), so each run with snapshots also reports their share of all
CPU the workers used: the direct cost, free of run-to-run noise. On an accelerator the
holder's host-side update runs on the otherwise idle host CPU instead. Writes
docs/snapshot_overhead.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from elaswave.runtime.job.results import Summary, WorkerResult, read_summary, read_worker_results

ROOT = Path(__file__).resolve().parents[1]
WARMUP_STEPS = 2


def train(out: Path, dp: int, pp: int, steps: int, snapshots: bool) -> Summary:
    cmd = [
        sys.executable,
        "-m",
        "elaswave.cli.main",
        "train",
        "--out",
        str(out),
        "--dp",
        str(dp),
        "--pp",
        str(pp),
        "--steps",
        str(steps),
        "--global-batch",
        "16",
        "--micro-batch",
        "2",
    ]
    if not snapshots:
        cmd.append("--no-snapshots")
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    return read_summary(out)


def throughput(summary: Summary) -> float:
    return summary.global_batch / statistics.median(summary.step_time_s[WARMUP_STEPS:])


def workers_of(run_dir: Path) -> list[WorkerResult]:
    return read_worker_results(run_dir)


def cpu_per_step(run_dir: Path, steps: int) -> float:
    """CPU seconds per step, summed over every worker's training loop."""
    return sum(w.cpu_s for w in workers_of(run_dir)) / steps


def snapshot_share(run_dir: Path) -> float:
    """The snapshot threads' CPU (sender and keepers) as a fraction of all loop CPU."""
    workers = workers_of(run_dir)
    return sum(w.snapshot_cpu_s for w in workers) / sum(w.cpu_s for w in workers)


def parse_layout(text: str) -> tuple[int, int]:
    try:
        dp, pp = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"layout {text!r}: expected DPxPP, e.g. 2x2") from None
    return dp, pp


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--layouts", type=parse_layout, nargs="+", default=[(2, 2), (4, 2)])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "snapshot_overhead")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs")
    args = parser.parse_args()
    if args.pairs < 1 or args.steps <= WARMUP_STEPS:
        parser.error(f"--pairs must be >= 1 and --steps > {WARMUP_STEPS}")

    results = []
    for dp, pp in args.layouts:
        pairs = []
        for i in range(args.pairs):
            order = (True, False) if i % 2 == 0 else (False, True)
            runs, cpu = {}, {}
            for snapshots in order:
                out = args.out / f"{dp}x{pp}_{i}_{'on' if snapshots else 'off'}"
                runs[snapshots] = train(out, dp, pp, args.steps, snapshots)
                cpu[snapshots] = cpu_per_step(out, args.steps)
                if snapshots:
                    share = snapshot_share(out)
            if runs[True].param_digest != runs[False].param_digest:
                raise SystemExit(f"{dp}x{pp} pair {i}: snapshots changed the parameters")
            with_, without = throughput(runs[True]), throughput(runs[False])
            pairs.append(
                {
                    "with": with_,
                    "without": without,
                    "overhead": 1 - with_ / without,
                    "cpu_with_s": cpu[True],
                    "cpu_without_s": cpu[False],
                    "cpu_overhead": cpu[True] / cpu[False] - 1,
                    "snapshot_cpu_share": share,
                }
            )
            print(
                f"{dp}x{pp} pair {i}: {with_:.1f} samples/s with snapshots, {without:.1f} "
                f"without: overhead {pairs[-1]['overhead']:+.2%}; CPU per step "
                f"{cpu[True] * 1e3:.1f} ms vs {cpu[False] * 1e3:.1f} ms "
                f"({pairs[-1]['cpu_overhead']:+.2%}); snapshot threads {share:.2%} of CPU",
                flush=True,
            )
        results.append(
            {
                "dp": dp,
                "pp": pp,
                "pairs": pairs,
                "median_with": statistics.median(p["with"] for p in pairs),
                "median_without": statistics.median(p["without"] for p in pairs),
                "median_overhead": statistics.median(p["overhead"] for p in pairs),
                "median_cpu_overhead": statistics.median(p["cpu_overhead"] for p in pairs),
                "median_snapshot_cpu_share": statistics.median(
                    p["snapshot_cpu_share"] for p in pairs
                ),
            }
        )

    lines = [
        f"Snapshot overhead: tiny model, {args.steps} steps, global batch 16, micro-batch 2; "
        f"{args.pairs} paired runs per layout (with / without snapshots, alternating order); "
        f"throughput from the median step time after step {WARMUP_STEPS}. Measured on this "
        "2-core CPU (gloo); the holder's host update shares the cores with training.",
        "",
        "| layout | samples/s with | samples/s without | throughput overhead (median of "
        "pairs) | pair overheads | CPU overhead (median of pairs) | pair CPU overheads | "
        "snapshot threads' share of CPU (median) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['dp']}x{r['pp']} | {r['median_with']:.1f} | {r['median_without']:.1f} | "
        f"{r['median_overhead']:+.2%} | "
        + ", ".join(f"{p['overhead']:+.1%}" for p in r["pairs"])
        + f" | {r['median_cpu_overhead']:+.2%} | "
        + ", ".join(f"{p['cpu_overhead']:+.1%}" for p in r["pairs"])
        + f" | {r['median_snapshot_cpu_share']:.2%} |"
        for r in results
    ]
    text = "\n".join(lines)
    print(text)
    args.docs.mkdir(exist_ok=True)
    (args.docs / "snapshot_overhead.md").write_text(text + "\n")
    (args.docs / "snapshot_overhead.json").write_text(
        json.dumps({"steps": args.steps, "results": results}, indent=2) + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
