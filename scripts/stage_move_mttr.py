"""A rank moving stage, measured: its MTTR and bytes moved, against the same change done
by checkpoint-restart.

    .venv/bin/python scripts/stage_move_mttr.py [--repeats 3]

The change: dp=2 x pp=2 has lost rank 2 of stage 1 (step 3), and now loses rank 3, the
last rank of stage 1 (step 5, forward). The pipeline goes on over the two ranks of
stage 0, as dp=1 x pp=2.

* **ElasWave** (in-step): rank 1 moves from stage 0 to stage 1 inside the running
  process, and rebuilds stage 1's layers from rank 3's host snapshot (kept in stage 0).
  MTTR: from the SIGKILL to the redone step's completion (summary.json).
* **Checkpoint-restart**: the same job with in-step recovery off (``[train] recovery =
  false``) and a checkpoint every step, so no step but the failed one is lost (its
  best case): the job stops at the kill, and a new job resumes on dp=1 x pp=2 from the
  latest checkpoint. MTTR: from the SIGKILL to the stop, plus from the new job's launch
  to its first step's completion (no time between the two: a scheduler adds some).
  Bytes: what the new job reads from the checkpoint (parameters, master weights and
  both Adam moments of every layer).

Both run on the emulated device (modelled compute and transfers, real processes,
real SIGKILL), interleaved, ``--repeats`` pairs; the medians are written to
docs/stage_move_mttr.{md,json}. Emulated figures.
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
JOB = ("--device", "emulated", "--pp", "2", "--global-batch", "16", "--micro-batch", "2")
STEPS = 10
KILL = "kill:3@5:forward"


def _train(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "elaswave.cli.main", "train", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600, check=False)


def elastic(out: Path) -> dict[str, float]:
    proc = _train("--out", str(out), *JOB, "--dp", "2", "--steps", str(STEPS),
                  "--fault", "kill:2@3:backward", "--fault", KILL)  # fmt: skip
    if proc.returncode:
        raise SystemExit(f"elastic run failed: {proc.stderr[-2000:]}")
    rec = read_summary(out).recoveries[1]
    moved = [list(s.ranks) for s in rec.plan.stages]
    return {"mttr_s": rec.mttr_s, "bytes": rec.bytes_moved, "stages": moved}


def checkpoint_restart(out: Path, config: Path) -> dict[str, float]:
    first = out / "stopped"
    proc = _train("--out", str(first), *JOB, "--dp", "2", "--steps", str(STEPS),
                  "--config", str(config), "--checkpoint-every", "1",
                  "--fault", "kill:2@3:backward")  # fmt: skip
    # In-step recovery is off: the first kill already stops the job. Its checkpoint of
    # step 2 stands for the one the same change would restart from (every step is
    # checkpointed: only the failed step is redone, as in the elastic run).
    stopped_at = time.time()
    if proc.returncode != 1:
        raise SystemExit(f"the job without recovery should stop: {proc.stderr[-2000:]}")
    killed_at = json.loads((first / "faults" / "rank2.json").read_text())["killed_at"]
    second = out / "resumed"
    launched = time.time()
    proc = _train("--out", str(second), "--resume", str(first), *JOB, "--dp", "1",
                  "--steps", str(STEPS))  # fmt: skip
    if proc.returncode:
        raise SystemExit(f"resume failed: {proc.stderr[-2000:]}")
    steps = [
        rec.event for rec in read_event_log(second / "events.log")
        if isinstance(rec.event, StepCompleted)
    ]  # fmt: skip
    done = min(steps, key=lambda e: e.step).time
    read = sum(p.stat().st_size for p in (first / "checkpoints").glob("step2/**/*") if p.is_file())
    return {"mttr_s": (stopped_at - killed_at) + (done - launched), "bytes": read,
            "stop_s": stopped_at - killed_at, "restart_s": done - launched}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows: dict[str, list[dict[str, float]]] = {"elastic": [], "restart": []}
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "no_recovery.toml"
        config.write_text("[train]\nrecovery = false\n")
        for k in range(args.repeats):
            rows["elastic"].append(elastic(Path(tmp) / f"e{k}"))
            rows["restart"].append(checkpoint_restart(Path(tmp) / f"r{k}", config))
            e, r = rows["elastic"][-1], rows["restart"][-1]
            print(f"pair {k}: elastic {e['mttr_s']:.3f} s ({e['bytes']} B, stages {e['stages']}); "
                  f"checkpoint-restart {r['mttr_s']:.3f} s (stop {r['stop_s']:.3f} s + "
                  f"restart {r['restart_s']:.3f} s, {r['bytes']} B read)")  # fmt: skip
    med = {
        name: {key: statistics.median(x[key] for x in xs) for key in ("mttr_s", "bytes")}
        for name, xs in rows.items()
    }
    doc = {"repeats": args.repeats, "median": med, "runs": rows}
    (ROOT / "docs" / "stage_move_mttr.json").write_text(json.dumps(doc, indent=2))
    e, r = med["elastic"], med["restart"]
    md = f"""# A rank moving stage: MTTR and bytes, against checkpoint-restart (emulated)

`.venv/bin/python scripts/stage_move_mttr.py --repeats {args.repeats}` (see its docstring):
dp=2 x pp=2 on the emulated device loses the last rank of stage 1 (`{KILL}`, after
rank 2 at step 3); the pipeline continues over stage 0's two ranks as dp=1 x pp=2.
Interleaved pairs on the 2-core host; medians. Emulated device: modelled compute and
transfers, real processes and SIGKILL.

| change done by | MTTR (median) | bytes moved or read |
|---|---|---|
| ElasWave: rank 1 moves to stage 1 in-process | {e["mttr_s"]:.3f} s | {e["bytes"]:.0f} |
| checkpoint-restart: stop, resume as dp=1 x pp=2 | {r["mttr_s"]:.3f} s | {r["bytes"]:.0f} |

ElasWave rebuilds stage 1 from rank 3's host snapshot, kept in stage 0; checkpoint-restart
writes a checkpoint every step and reads the latest one back.

Checkpoint-restart's MTTR is a lower bound: no scheduler delay between the stop and the
new job, and a checkpoint at every step (no lost steps beyond the failed one).
"""
    (ROOT / "docs" / "stage_move_mttr.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
