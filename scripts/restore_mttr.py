"""Lost state restored from the last checkpoint: inside the running job, against a
restart of the job by ``--resume`` (new processes); and what writing checkpoints costs.

    .venv/bin/python scripts/restore_mttr.py [--pairs 3] [--overhead-pairs 5]

The loss: dp=2 x pp=2 writing a checkpoint every 2 steps loses rank 0 and rank 3, the
holder of its only snapshot copy, in the backward of step 5 (``kill:0@5:backward``,
``kill:3@5:backward``): shard 0 has no copy left in memory.

* **In the job** (the default with ``--checkpoint-every``): the survivors (ranks 1 and
  2) load the newest complete checkpoint in their running processes, as dp=1 x pp=2,
  and train on from it. MTTR: from the SIGKILL to the completion of the first step
  after the checkpoint (summary.json's record).
* **Restart** (``--no-restore-in-job``): the job stops; a new job resumes it with
  ``--resume`` as dp=1 x pp=2. MTTR: from the SIGKILL to the stop, plus from the new
  job's launch to the completion of its first step (no scheduler delay between them:
  a lower bound).

Both then re-train the steps after the checkpoint; MTTR ends at the first of them in
both. Interleaved pairs on this host, medians.

Checkpoint cost: the same job without faults, 60 steps, with and without
``--checkpoint-every 10``, interleaved; the mean step time of each run (steps after the
first two: a step that writes counts as often as it comes), and the overhead pair by
pair. Results: docs/restore_mttr.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from elaswave.bus.eventlog import read_event_log
from elaswave.bus.schema import StepCompleted
from elaswave.runtime.job.results import read_summary

ROOT = Path(__file__).resolve().parents[1]
JOB = ("--pp", "2", "--global-batch", "16", "--micro-batch", "2", "--steps", "10",
       "--checkpoint-every", "2")  # fmt: skip
OVERHEAD_STEPS = 60
KILLS = ("--fault", "kill:0@5:backward", "--fault", "kill:3@5:backward")


def _train(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "elaswave.cli.main", "train", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600, check=False)


def _killed_at(run: Path) -> float:
    return min(
        json.loads((run / "faults" / f"rank{r}.json").read_text())["killed_at"] for r in (0, 3)
    )


def in_job(out: Path) -> dict[str, float]:
    proc = _train("--out", str(out), *JOB, "--dp", "2", *KILLS)
    if proc.returncode:
        raise SystemExit(f"the restoring run failed: {proc.stderr[-2000:]}")
    (rec,) = read_summary(out).recoveries
    assert rec.restored, rec
    return {"mttr_s": rec.mttr_s, "checkpoint": rec.committed_step}


def restart(out: Path) -> dict[str, float]:
    first = out / "stopped"
    proc = _train("--out", str(first), *JOB, "--dp", "2", "--no-restore-in-job", *KILLS)
    stopped_at = time.time()
    if proc.returncode != 1 or "no copy of it is left in memory" not in proc.stderr:
        raise SystemExit(f"the run without restore should stop: {proc.stderr[-2000:]}")
    second = out / "resumed"
    launched = time.time()
    proc = _train("--out", str(second), "--resume", str(first), *JOB, "--dp", "1")
    if proc.returncode:
        raise SystemExit(f"resume failed: {proc.stderr[-2000:]}")
    steps = [
        rec.event for rec in read_event_log(second / "events.log")
        if isinstance(rec.event, StepCompleted)
    ]  # fmt: skip
    done = min(steps, key=lambda e: e.step)
    stop_s = stopped_at - _killed_at(first)
    return {"mttr_s": stop_s + (done.time - launched), "stop_s": stop_s,
            "restart_s": done.time - launched, "checkpoint": done.step - 1}  # fmt: skip


def step_time(out: Path, *extra: str) -> float:
    proc = _train("--out", str(out), "--dp", "2", "--pp", "2", "--global-batch", "16",
                  "--micro-batch", "2", "--steps", str(OVERHEAD_STEPS), *extra)  # fmt: skip
    if proc.returncode:
        raise SystemExit(f"run failed: {proc.stderr[-2000:]}")
    times = read_summary(out).step_time_s
    return statistics.fmean(times[2:])  # a checkpoint step counts as often as it comes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--overhead-pairs", type=int, default=7)
    args = parser.parse_args()
    rows: dict[str, list[dict[str, float]]] = {"in_job": [], "restart": []}
    overhead: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.pairs):
            pair = [("in_job", in_job), ("restart", restart)]
            for name, run in pair if k % 2 == 0 else pair[::-1]:
                rows[name].append(run(Path(tmp) / f"{name}{k}"))
            a, b = rows["in_job"][-1], rows["restart"][-1]
            print(f"pair {k}: in the job {a['mttr_s']:.3f} s (checkpoint "
                  f"{a['checkpoint']:.0f}); restart {b['mttr_s']:.3f} s (stop "
                  f"{b['stop_s']:.3f} s + new job {b['restart_s']:.3f} s, checkpoint "
                  f"{b['checkpoint']:.0f})", flush=True)  # fmt: skip
        for k in range(args.overhead_pairs):
            runs = {"off": (), "on": ("--checkpoint-every", "10")}
            order = ["off", "on"] if k % 2 == 0 else ["on", "off"]
            got = {name: step_time(Path(tmp) / f"o{name}{k}", *runs[name]) for name in order}
            got["overhead"] = got["on"] / got["off"] - 1
            overhead.append(got)
            print(f"overhead pair {k}: step {got['off'] * 1e3:.1f} ms without, "
                  f"{got['on'] * 1e3:.1f} ms with checkpoints: {got['overhead']:+.1%}",
                  flush=True)  # fmt: skip
    med = {name: statistics.median(x["mttr_s"] for x in xs) for name, xs in rows.items()}
    cost = {key: statistics.median(x[key] for x in overhead) for key in ("off", "on", "overhead")}
    doc = {"pairs": args.pairs, "median_mttr_s": med, "runs": rows, "overhead": overhead,
           "median_overhead": cost}  # fmt: skip
    (ROOT / "docs" / "restore_mttr.json").write_text(json.dumps(doc, indent=2))
    command = f"scripts/restore_mttr.py --pairs {args.pairs} --overhead-pairs {args.overhead_pairs}"
    off, on = cost["off"] * 1e3, cost["on"] * 1e3
    md = f"""# Lost state restored from a checkpoint: inside the job, against a restart

`.venv/bin/python {command}`
(see its docstring): dp=2 x pp=2 with `--checkpoint-every 2` loses rank 0 and the holder
of its only snapshot copy (rank 3) in step 5; both ways go on as dp=1 x pp=2 from the
newest complete checkpoint. Interleaved pairs on this 2-core CPU host (gloo), medians.

| recovery | MTTR (median of {args.pairs}) |
|---|---|
| restored inside the running job | {med["in_job"]:.3f} s |
| job stops, new job `--resume`s (no scheduler delay) | {med["restart"]:.3f} s |

MTTR: from the SIGKILL to the completion of the first step after the checkpoint; both
then train the same steps again. Per pair: `restore_mttr.json`.

Writing a checkpoint every 10 steps (the same job, no faults, {OVERHEAD_STEPS} steps, mean step
time of each run after its first two; {args.overhead_pairs} interleaved pairs): {off:.1f} ms
without, {on:.1f} ms with, overhead {cost["overhead"]:+.1%} (median of the pairs'
overheads).
"""
    (ROOT / "docs" / "restore_mttr.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
