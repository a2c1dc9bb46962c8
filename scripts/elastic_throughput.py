"""Throughput after an elastic change, emulated device: the throughput-restoring issue's matrix.

    .venv/bin/python scripts/elastic_throughput.py [--steps 34] [--kill-step 10]
        [--slow-step 6] [--join-step 18] [--attempts 3] [--max-overrun 0.05]

All runs use ``--device emulated``: 16 CPU processes train the real model (numbers are
real) while keeping the time of the cost model's emulated accelerator, so step times
show pipeline dynamics, not the 2-core host. Every figure here is **emulated**.

Job: dp=4 x pp=4, 16 layers (embedding, 14 blocks, head), global batch 64, micro-batch 2.

* Fail-stop: rank 5 (stage 1) is SIGKILLed at ``--kill-step``; the job continues with 15
  workers under each rebalancing policy (resize only, + layer migration, + DVFS). Linear
  scaling efficiency = post-change throughput / pre-change throughput / (15 / 16).
* Fail-slow: rank 5 computes 1.5x and 2x slower from ``--slow-step`` on, without
  mitigation (``--rebalance none``) and with it (``migrate+dvfs``: the detector flags
  the rank, every worker pauses at a step boundary, samples and layers move off it).
  Normalised throughput = throughput after the change / the fault-free run's.
* Scale-up: the fail-stop run with ``migrate+dvfs``, then a new worker joins at
  ``--join-step`` (``join@STEP``). Ratio = throughput after the join / the same run's
  throughput before the failure (target: at least 0.95).

Throughput is the global batch over the median step time of a window: before the change,
steps 3 .. change - 1; after it, from two steps after the redone step to the end; between
the failure and the join, from two steps after the failure's redone step to the step
before the join's (the joiner starts up on the same host during the join step and after).
Each run's losses and final parameters are compared with the fault-free run.

Emulation overruns: each worker reports per step how many compute blocks (one forward or
one backward of a micro-batch) took longer in real compute than the model allows. When
more than ``--max-overrun`` of the blocks in a run's throughput windows overran, the
host could not keep up and the run is repeated (up to ``--attempts`` runs); the attempt
with the fewest overruns in its windows is the one reported, and every attempt is listed.

Writes docs/elastic_throughput.{md,json}. ``--render`` rewrites the .md from the .json
without training; ``--replicates A.json B.json`` adds a table of the headline figures of
other runs of the same command (run-to-run spread on the shared host).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from elaswave.bus.schema import StepTiming
from elaswave.engine.record import record_to_json
from elaswave.runtime.core.compare import compare_runs
from elaswave.runtime.core.runlog import read_run_log
from elaswave.runtime.job.results import Summary, read_summary

ROOT = Path(__file__).resolve().parents[1]
MODEL_TOML = '[model]\npreset = "tiny"\nnum_blocks = 14\n'
JOB = [
    "--device", "emulated", "--dp", "4", "--pp", "4",
    "--global-batch", "64", "--micro-batch", "2",
]  # fmt: skip
WORKERS = 16
Window = tuple[int, int]


def train(out: Path, config: Path, *args: str, job: list[str] = JOB) -> Summary:
    """Run ``elaswave train`` on ``job`` plus ``args``; its summary (exits if it fails)."""
    cmd = [sys.executable, "-m", "elaswave.cli.main", "train", "--out", str(out)]
    cmd += ["--config", str(config), *job, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return read_summary(out)


def rate(summary: Summary, lo: int, hi: int) -> float:
    """Samples per second over steps [lo, hi), from the median step time."""
    window = summary.step_time_s[lo:hi]
    if len(window) < 2:
        raise SystemExit(f"throughput window [{lo}, {hi}) has fewer than 2 steps")
    return summary.global_batch / statistics.median(window)


def overruns(run_dir: Path, windows: list[Window]) -> dict:
    """Emulation overruns from the StepTiming events: over the whole run (every report,
    redone steps included) and over the throughput windows (latest report of a step)."""
    reports = [r.event for r in read_run_log(run_dir) if isinstance(r.event, StepTiming)]
    latest = {(t.rank, t.step): t for t in reports}
    inside = [t for (_, step), t in latest.items() if any(lo <= step < hi for lo, hi in windows)]
    count = sum(t.overruns for t in inside)
    blocks = sum(2 * t.micro_batches for t in inside)  # one forward, one backward each
    return {
        "windows": count,
        "window_blocks": blocks,
        "fraction": count / blocks if blocks else 0.0,
        "run": sum(t.overruns for t in reports),
        "run_blocks": sum(2 * t.micro_batches for t in reports),
    }


@dataclass
class Run:
    out: Path
    summary: Summary
    windows: list[Window]
    rates: list[float]
    overruns: dict

    def doc(self) -> dict:
        return {
            "run_dir": _rel(self.out),
            "windows": self.windows,
            "rates": self.rates,
            "overruns": self.overruns,
        }


@dataclass
class Measured:
    best: Run
    attempts: list[Run]
    command: str


def measure(
    args: argparse.Namespace,
    name: str,
    flags: list[str],
    windows_of: Callable[[dict], list[Window]],
) -> Measured:
    """Train one configuration; repeat it while the emulation overran too often."""
    tried: list[Run] = []
    for attempt in range(args.attempts):
        out = args.out / (name if attempt == 0 else f"{name}_rerun{attempt}")
        summary = train(out, args.config, *flags)
        windows = windows_of(summary)
        run = Run(
            out=out,
            summary=summary,
            windows=windows,
            rates=[rate(summary, lo, hi) for lo, hi in windows],
            overruns=overruns(out, windows),
        )
        tried.append(run)
        ov = run.overruns
        print(
            f"  {out.name}: windows {windows}, rates "
            f"{[round(r, 1) for r in run.rates]} samples/s (emulated), overruns "
            f"{ov['windows']}/{ov['window_blocks']} blocks in the windows "
            f"({ov['fraction']:.1%}), {ov['run']}/{ov['run_blocks']} in the run",
            flush=True,
        )
        if ov["fraction"] <= args.max_overrun:
            break
        if attempt + 1 < args.attempts:
            print(f"  more than {args.max_overrun:.0%} overran: running it again", flush=True)
    best = min(tried, key=lambda r: r.overruns["fraction"])
    command = " ".join(
        ["elaswave train", "--config", _rel(args.config), *JOB, *flags, "--out", _rel(best.out)]
    )
    return Measured(best=best, attempts=tried, command=command)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _ov(row: dict) -> str:
    ov = row["overruns"]
    return f"{ov['windows']}/{ov['window_blocks']} ({ov['fraction']:.1%}); run {ov['run']}"


def _attempts(row: dict) -> str:
    runs = [a["run_dir"] for a in row["attempts"]]
    return "1" if len(runs) == 1 else f"{len(runs)} (kept {runs.index(row['run_dir']) + 1})"


def _layers(plan: dict) -> list[int]:
    return [st["layers"][1] - st["layers"][0] for st in plan["stages"]]


def _mhz(plan: dict) -> list[int | str]:
    return [round(st["mhz"]) if st["mhz"] else "base" for st in plan["stages"]]


def _window(w: list[int]) -> str:
    return f"{w[0]}-{w[1] - 1}"


def run_matrix(args: argparse.Namespace) -> dict:
    """Train every configuration; the figures, plans, checks and overruns as JSON."""
    started = time.monotonic()
    k, j, n = args.kill_step, args.join_step, args.steps
    args.out.mkdir(parents=True, exist_ok=True)
    args.config = args.out / "model.toml"
    args.config.write_text(MODEL_TOML)
    steps = ["--steps", str(n)]

    print("fault-free run", flush=True)
    base = measure(args, "baseline", steps, lambda s: [(3, n)])
    base_rate = base.best.rates[0]
    ref = base.best.out
    print(f"baseline: {base_rate:.1f} samples/s (emulated)", flush=True)

    def after_recovery(s: Summary) -> list[Window]:
        return [(3, k), (s.recoveries[0].step + 2, n)]

    rows = []
    for policy in ("resize", "migrate", "migrate+dvfs"):
        print(f"fail-stop, {policy}", flush=True)
        flags = [*steps, "--fault", f"kill:5@{k}:backward", "--rebalance", policy]
        m = measure(args, f"kill_{policy.replace('+', '_')}", flags, after_recovery)
        s, (pre, post) = m.best.summary, m.best.rates
        rec = record_to_json(s.recoveries[0])
        diff = compare_runs(m.best.out, ref)
        rows.append(
            {
                "policy": policy,
                "command": m.command,
                "pre": pre,
                "post": post,
                "lse": post / pre / ((WORKERS - 1) / WORKERS),
                "mttr_s": rec["mttr_s"],
                "bytes_moved": rec["bytes_moved"],
                "plan": rec["plan"],
                "reason": rec["reason"],
                "loss_rel": diff.loss_rel,
                "param_rel": diff.param_rel,
                **m.best.doc(),
                "attempts": [a.doc() for a in m.attempts],
            }
        )
        r = rows[-1]
        print(
            f"kill, {policy}: {pre:.1f} -> {post:.1f} samples/s, LSE {r['lse']:.3f}, MTTR "
            f"{r['mttr_s']:.2f} s, loss diff {r['loss_rel']:.1e}, params {r['param_rel']:.1e}",
            flush=True,
        )

    def slow_window(s: Summary) -> list[Window]:
        slow = [r for r in s.recoveries if r.kind == "fail-slow"]
        return [(max([args.slow_step + 2] + [r.step + 2 for r in slow]), n)]

    slow_rows = []
    for factor in (1.5, 2.0):
        for policy in ("none", "migrate+dvfs"):
            print(f"fail-slow {factor:g}x, {policy}", flush=True)
            fault = f"slow:5={factor:g}@{args.slow_step}"
            flags = [*steps, "--fault", fault, "--rebalance", policy]
            m = measure(args, f"slow_{factor:g}_{policy.replace('+', '_')}", flags, slow_window)
            s = m.best.summary
            slow = [record_to_json(r) for r in s.recoveries if r.kind == "fail-slow"]
            diff = compare_runs(m.best.out, ref)
            slow_rows.append(
                {
                    "factor": factor,
                    "policy": policy,
                    "command": m.command,
                    "rate": m.best.rates[0],
                    "normalised": m.best.rates[0] / base_rate,
                    "window": list(m.best.windows[0]),
                    "mitigated_at": [r["step"] for r in slow],
                    "mttr_s": [r["mttr_s"] for r in slow],
                    "plan": slow[-1]["plan"] if slow else None,
                    "loss_rel": diff.loss_rel,
                    "param_rel": diff.param_rel,
                    **m.best.doc(),
                    "attempts": [a.doc() for a in m.attempts],
                }
            )
            r = slow_rows[-1]
            print(
                f"slow {factor:g}x, {policy}: normalised throughput {r['normalised']:.3f} "
                f"(steps {r['window'][0]}-{n - 1}; mitigated at {r['mitigated_at']})",
                flush=True,
            )

    def scale_windows(s: Summary) -> list[Window]:
        fail = [r for r in s.recoveries if r.kind == "fail-stop"]
        join = [r for r in s.recoveries if r.kind == "join"]
        if len(fail) != 1 or len(join) != 1:
            raise SystemExit(f"scale-up run: recoveries {[str(r.kind) for r in s.recoveries]}")
        return [(3, k), (fail[0].step + 2, j), (join[0].step + 2, n)]

    print("scale-up after a failure", flush=True)
    flags = [*steps, "--fault", f"kill:5@{k}:backward", "--fault", f"join@{j}"]
    m = measure(args, "kill_join", [*flags, "--rebalance", "migrate+dvfs"], scale_windows)
    s, (pre, degraded, post) = m.best.summary, m.best.rates
    fail, join = (record_to_json(r) for r in s.recoveries)
    diff = compare_runs(m.best.out, ref)
    after = m.best.windows[2]
    scale = {
        "command": m.command,
        "pre": pre,
        "degraded": degraded,
        "post": post,
        "ratio": post / pre,
        "ratio_fault_free": post / base_rate,
        "degraded_lse": degraded / pre / ((WORKERS - 1) / WORKERS),
        "steps_after_join": after[1] - after[0],
        "failure": fail,
        "join": join,
        "loss_rel": diff.loss_rel,
        "param_rel": diff.param_rel,
        **m.best.doc(),
        "attempts": [a.doc() for a in m.attempts],
    }
    print(
        f"scale-up: {pre:.1f} -> {degraded:.1f} (15 workers) -> {post:.1f} samples/s after "
        f"the join; ratio {scale['ratio']:.3f}, loss diff {diff.loss_rel:.1e}, params "
        f"{diff.param_rel:.1e}",
        flush=True,
    )
    if scale["steps_after_join"] < 8:
        print(f"warning: only {scale['steps_after_join']} steps after the join", flush=True)

    return {
        "timing": "emulated",
        "args": {
            "steps": n,
            "kill_step": k,
            "slow_step": args.slow_step,
            "join_step": j,
            "attempts": args.attempts,
            "max_overrun": args.max_overrun,
        },
        "wall_s": time.monotonic() - started,
        "baseline_rate": base_rate,
        "baseline": {
            "command": base.command,
            "rate": base_rate,
            **base.best.doc(),
            "attempts": [a.doc() for a in base.attempts],
        },
        "fail_stop": rows,
        "fail_slow": slow_rows,
        "scale_up": scale,
    }


def headline(doc: dict) -> list[float]:
    """The figures a replicate is compared on, in the order of :data:`HEADLINE`."""
    return [
        doc["baseline_rate"],
        *(r["lse"] for r in doc["fail_stop"]),
        *(r["normalised"] for r in doc["fail_slow"]),
        doc["scale_up"]["ratio"],
    ]


HEADLINE = [
    "fault-free throughput (samples/s)",
    "fail-stop LSE, resize",
    "fail-stop LSE, migrate",
    "fail-stop LSE, migrate+dvfs",
    "fail-slow 1.5x, none (normalised)",
    "fail-slow 1.5x, migrate+dvfs (normalised)",
    "fail-slow 2x, none (normalised)",
    "fail-slow 2x, migrate+dvfs (normalised)",
    "scale-up: after the join / before the failure",
]


def render(doc: dict) -> str:
    a = doc["args"]
    n, k, j, slow_step = a["steps"], a["kill_step"], a["join_step"], a["slow_step"]
    base_rate = doc["baseline_rate"]
    lines = [
        "# Elastic throughput (emulated device)",
        "",
        "Every throughput and time below is **emulated**: `--device emulated` trains the "
        "real model on CPU (16 worker processes on a shared 2-core host; losses and "
        "parameters are real) while each worker keeps the time of the cost model's "
        "emulated accelerator. They show pipeline dynamics, not the host's speed.",
        "",
        "Job: dp=4 x pp=4 (16 workers), 16 layers (embedding, 14 blocks, head; the "
        f'run\'s `model.toml`: `[model]` with `preset = "tiny"`, `num_blocks = 14`), global '
        f"batch 64, micro-batch 2, {n} steps. Fault-free run: "
        f"**{base_rate:.1f} samples/s** (emulated, steps 3-{n - 1}).",
        "",
        "Command (9 configurations of about 1.5 min each, plus repeats; this run took "
        f"{doc['wall_s'] / 60:.1f} min of wall time):",
        "",
        "    .venv/bin/python scripts/elastic_throughput.py "
        f"--steps {n} --kill-step {k} --slow-step {slow_step} --join-step {j} "
        f"--attempts {a['attempts']} --max-overrun {a['max_overrun']:g}",
        "",
        "Definitions:",
        "",
        "* Throughput = global batch (64) / median step time over a window of steps (a "
        "step's time is its slowest rank's). The fault-free run: steps 3 to the last. "
        f"Before a failure: steps 3-{k - 1}. After a recovery: from two steps after its "
        "redone step (the step the recovery re-runs) to the last step.",
        "* Linear scaling efficiency (LSE, fail-stop) = throughput after / throughput "
        "before / (15/16).",
        "* Normalised throughput (fail-slow) = throughput from step "
        f"max({slow_step} + 2, redone step + 2) to the last (the slowdown starts at step "
        f"{slow_step}; without mitigation there is no redone step) / the fault-free run's.",
        "* Scale-up ratio = throughput after the join / the same run's throughput before the "
        f"failure (target >= 0.95). The window between failure and join ends at step {j - 1}: "
        f"the joiner is started during step {j} and starts up on the same host.",
        "* Numeric check: `elaswave.runtime.core.compare.compare_runs` against the fault-free run: "
        "max relative loss difference over all steps, and max |param diff| / max |param| "
        "(tolerance 1e-4).",
        "* Overruns: compute blocks (one forward or backward of a micro-batch on one rank) "
        "whose real compute exceeded the modelled time, from the StepTiming events in "
        "the run's logs (`events.log` and `health/`); shown as overruns / blocks in the "
        "throughput windows (fraction), and "
        f"the whole run's total. A run with more than {a['max_overrun']:.0%} in its windows "
        f"is repeated (up to {a['attempts']} runs) and the attempt with the fewest is "
        "reported. Overruns only count compute blocks: the host delaying a worker elsewhere "
        "(point-to-point delivery, collectives, the optimizer) is not counted, so figures "
        "also move between repeated runs with few overruns"
        + (" (see the spread below)." if doc.get("replicates") else "."),
        "",
        f"## Fail-stop: rank 5 (stage 1) SIGKILLed at step {k} (backward)",
        "",
        "| policy | before (samples/s) | after (samples/s) | LSE | "
        "MTTR s | optimizer bytes moved | layers per stage after | stage clocks (MHz) | "
        "max rel loss diff | rel param diff | overruns in windows; run | runs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["fail_stop"]:
        lines.append(
            f"| {r['policy']} | {r['pre']:.1f} | {r['post']:.1f} | {r['lse']:.3f} | "
            f"{r['mttr_s']:.2f} | {r['bytes_moved']:,} | {_layers(r['plan'])} | "
            f"{_mhz(r['plan'])} | {r['loss_rel']:.1e} | {r['param_rel']:.1e} | "
            f"{_ov(r)} | {_attempts(r)} |"
        )
    lines += [
        "",
        f"The before window has {k - 3} steps: the host's noise in it moves LSE by a few "
        "hundredths"
        + (" (compare the spread below)" if doc.get("replicates") else "")
        + ", which is how an LSE slightly above 1 arises.",
        "",
        f"## Fail-slow: rank 5 (stage 1) computes FACTOR x slower from step {slow_step}",
        "",
        f"Normalised to the fault-free run's {base_rate:.1f} samples/s (emulated).",
        "",
        "| slowdown | policy | throughput (samples/s) | normalised throughput | "
        "window (steps) | rebalanced at step | samples per micro-batch, stage 1 replicas | "
        "layers per stage | stage clocks (MHz) | max rel loss diff | rel param diff | "
        "overruns in windows; run | runs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["fail_slow"]:
        plan = r["plan"]
        sizes = plan["stages"][1]["sizes"] if plan else "[2, 2, 2, 2] (unchanged)"
        lines.append(
            f"| {r['factor']:g}x | {r['policy']} | {r['rate']:.1f} | {r['normalised']:.3f} | "
            f"{_window(r['window'])} | {r['mitigated_at'] or '-'} | {sizes} | "
            f"{_layers(plan) if plan else '-'} | {_mhz(plan) if plan else '-'} | "
            f"{r['loss_rel']:.1e} | {r['param_rel']:.1e} | {_ov(r)} | {_attempts(r)} |"
        )
    s = doc["scale_up"]
    w = s["windows"]
    lines += [
        "",
        f"## Scale-up: rank 5 SIGKILLed at step {k}, a new worker joins at step {j}",
        "",
        f"`--rebalance migrate+dvfs --fault kill:5@{k}:backward --fault join@{j}`. The failure "
        f"is redone at step {s['failure']['step']}; rank {s['join']['ranks']} joins "
        f"with its recovery redone at step {s['join']['step']}.",
        "",
        "| phase | window (steps) | workers | throughput (samples/s) | vs before the failure |",
        "|---|---|---|---|---|",
        f"| before the failure | {_window(w[0])} | 16 | {s['pre']:.1f} | 1.000 |",
        f"| after the failure | {_window(w[1])} | 15 | {s['degraded']:.1f} | "
        f"{s['degraded'] / s['pre']:.3f} (LSE {s['degraded_lse']:.3f}) |",
        f"| after the join | {_window(w[2])} ({s['steps_after_join']} steps) | 16 | "
        f"{s['post']:.1f} | **{s['ratio']:.3f}** |",
        "",
        f"Throughput after the join / before the failure: **{s['ratio']:.3f}** "
        f"({'meets' if s['ratio'] >= 0.95 else 'misses'} the 0.95 target); / the "
        f"fault-free run's: {s['ratio_fault_free']:.3f}. "
        f"MTTR: failure {s['failure']['mttr_s']:.2f} s, join {s['join']['mttr_s']:.2f} s; "
        f"optimizer bytes moved: failure {s['failure']['bytes_moved']:,}, join "
        f"{s['join']['bytes_moved']:,}.",
        "",
        "| plan | stage | layers | ranks | DP width | samples per micro-batch | clock (MHz) |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, plan in (
        ("after the failure", s["failure"]["plan"]),
        ("after the join", s["join"]["plan"]),
    ):
        for i, st in enumerate(plan["stages"]):
            lines.append(
                f"| {label} | {i} | {st['layers'][0]}-{st['layers'][1] - 1} "
                f"({st['layers'][1] - st['layers'][0]}) | {st['ranks']} | {len(st['ranks'])} | "
                f"{st['sizes']} | {round(st['mhz']) if st['mhz'] else 'base'} |"
            )
    lines += [
        "",
        f"Numbers: max rel loss diff {s['loss_rel']:.1e}, rel param diff {s['param_rel']:.1e} "
        f"against the fault-free run. Overruns in the windows: {_ov(s)}; runs: {_attempts(s)}.",
    ]
    if replicates := doc.get("replicates"):
        figures = [headline(doc), *(r["headline"] for r in replicates)]
        lines += [
            "",
            "## Run-to-run spread",
            "",
            f"The same command run {len(figures)} times on the same host, one after the "
            "other (run 1 is the one reported above; the others were added with "
            "`--replicates`), headline figures only:",
            "",
            "| figure | " + " | ".join(f"run {i + 1}" for i in range(len(figures))) + " |",
            "|---|" + "---|" * len(figures),
        ]
        for i, name in enumerate(HEADLINE):
            cells = " | ".join(f"{f[i]:.1f}" if i == 0 else f"{f[i]:.3f}" for f in figures)
            lines.append(f"| {name} | {cells} |")
    lines += [
        "",
        "## Runs",
        "",
        "Each configuration's `elaswave train` command, with every attempt's window "
        "throughputs (samples/s, emulated) and overruns:",
        "",
    ]
    for row in (doc["baseline"], *doc["fail_stop"], *doc["fail_slow"], s):
        lines.append(f"* `{row['command']}`")
        for at in row["attempts"]:
            ov = at["overruns"]
            kept = (
                " (reported)"
                if at["run_dir"] == row["run_dir"] and len(row["attempts"]) > 1
                else ""
            )
            lines.append(
                f"  * {Path(at['run_dir']).name}{kept}: windows "
                f"{[_window(x) for x in at['windows']]}, {[round(x, 1) for x in at['rates']]}; "
                f"overruns {ov['windows']}/{ov['window_blocks']} ({ov['fraction']:.1%}) in the "
                f"windows, {ov['run']}/{ov['run_blocks']} in the run"
            )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=34)
    parser.add_argument("--kill-step", type=int, default=10)
    parser.add_argument("--slow-step", type=int, default=6)
    parser.add_argument("--join-step", type=int, default=18)
    parser.add_argument("--attempts", type=int, default=3, help="runs per configuration, at most")
    parser.add_argument(
        "--max-overrun",
        type=float,
        default=0.05,
        help="repeat a run when more than this fraction of compute blocks in its "
        "throughput windows overran the emulated time",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "elastic")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs")
    parser.add_argument(
        "--render",
        action="store_true",
        help="train nothing: rewrite DOCS/elastic_throughput.md from DOCS/elastic_throughput.json",
    )
    parser.add_argument(
        "--replicates",
        type=Path,
        nargs="*",
        default=[],
        metavar="JSON",
        help="elastic_throughput.json files of other runs of the same command: their "
        "headline figures are kept in the .json and tabulated next to this run's",
    )
    args = parser.parse_args()
    k, j, n = args.kill_step, args.join_step, args.steps
    if not 4 < k < n - 6:
        parser.error("--kill-step must leave 4 steps before it and 6 after it")
    if not 3 <= args.slow_step < n - 8:
        parser.error("--slow-step must be at least 3 and leave 8 steps after it")
    if not k + 6 <= j <= n - 12:
        parser.error("--join-step must be 6 steps after --kill-step and 12 before the end")
    if args.attempts < 1:
        parser.error("--attempts must be at least 1")
    result = args.docs / "elastic_throughput.json"
    replicates = [
        {"source": str(path), "headline": headline(json.loads(path.read_text()))}
        for path in args.replicates
    ]
    doc = json.loads(result.read_text()) if args.render else run_matrix(args)
    if replicates:
        doc["replicates"] = replicates
    args.docs.mkdir(exist_ok=True)
    result.write_text(json.dumps(doc, indent=2) + "\n")
    text = render(doc)
    print(text, end="")
    (args.docs / "elastic_throughput.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
