"""Control-plane faults, measured: what each does to a dp=4 x pp=2 job, and its extra MTTR.

    .venv/bin/python scripts/control_plane_faults.py [--repeats 3] [--steps 8]

Every case is a real run (real processes, SIGKILL/SIGSTOP, the fault-injecting bus
transport) compared with the fault-free run of the same job: losses and parameters
within 1e-4 when it continues; when it stops, the resumed run within 1e-5. Extra MTTR is
the case's median MTTR (kill to the redone step's completion) minus the median of a
single SIGKILL on a healthy bus, measured in the same invocation. A Core lost without
a worker failure has no recovery: its row says how long the Core was away and how long
the workers paused (0 while the outage stays under --core-outage). Writes
docs/control_plane.{md,json}. Timings are measured on real CPU processes (2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from elaswave.bus.schema import RecoveryPlan, StepTiming, WorkerStarted
from elaswave.runtime.core.compare import compare_runs, load_params, loss_rel_diff, param_rel_diff
from elaswave.runtime.core.replay import replay_run
from elaswave.runtime.core.runlog import read_run_log
from elaswave.runtime.core.supervisor import CORE_FAULT_ENV, CORE_RESTORE_EVERY_ENV
from elaswave.runtime.job.results import read_summary

ROOT = Path(__file__).resolve().parents[1]
KILL = ("--fault", "kill:1@3:backward")
LOSSY_10 = "drop=0.1,dup=0.1,reorder=0.1,delay=0.005"


@dataclass
class Case:
    name: str
    fault: str
    args: tuple[str, ...]
    stops: bool = False
    kill_host: str | None = None
    """'mid-step' or 'during-recovery': SIGKILL the job host (``elaswave train``) there."""
    core: tuple[str, signal.Signals, float] | None = None
    """(when, signal, seconds): signal the Core process at 'step2' or 'step4' (a SIGSTOPped
    Core gets SIGCONT after the seconds), or have it SIGKILL itself right after it
    publishes a recovery's 'plan' or 'commit'."""
    steps: int | None = None
    """Steps of this case's job (and of its own fault-free reference); None: --steps."""
    mttr: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


CASES = [
    Case("baseline", "one worker SIGKILLed mid-backward (healthy bus)", KILL),
    Case("two-at-once", "two workers of different stages SIGKILLed in the same backward",
         (*KILL, "--fault", "kill:6@3:backward")),
    Case("kill-before-ack", "a worker SIGKILLed during a recovery, plan in hand, before acking",
         (*KILL, "--fault", "kill:6@3:plan")),
    Case("silent-before-ack", "a worker SIGSTOPped during a recovery before acking "
         "(ack deadline 2 s, heartbeat deadline 30 s)",
         (*KILL, "--fault", "hang:6@3:plan", "--plan-ack-timeout", "2",
          "--heartbeat-timeout", "30")),
    Case("kill-while-applying", "a worker SIGKILLed during a recovery, after the commit "
         "(the plan rolled back)", (*KILL, "--fault", "kill:6@3:apply")),
    Case("lossy-bus-10", "bus drops 10%, duplicates 10%, reorders 10%, delays 0-5 ms",
         (*KILL, "--bus-faults", LOSSY_10)),
    Case("lossy-bus-30", "bus drops 30%, duplicates 10%, reorders 10%, delays 0-5 ms",
         (*KILL, "--bus-faults", "drop=0.3,dup=0.1,reorder=0.1,delay=0.005")),
    Case("core-killed-mid-step", "the Core SIGKILLed in step 4 (restarted by the job host)",
         (), core=("step4", signal.SIGKILL, 0.0)),
    Case("core-stopped-past-bound", "the Core SIGSTOPped 3 s in step 2, outage bound 1 s "
         "(a 40-step job)", ("--core-outage", "1"), core=("step2", signal.SIGSTOP, 3.0),
         steps=40),
    Case("core-killed-plan-out", "the Core SIGKILLed just after publishing a recovery plan",
         KILL, core=("plan", signal.SIGKILL, 0.0)),
    Case("core-killed-after-commit", "the Core SIGKILLed just after a recovery's commit",
         KILL, core=("commit", signal.SIGKILL, 0.0)),
    Case("core-killed-mid-step-lossy", "the Core SIGKILLed in step 4, on a bus dropping 10%",
         ("--bus-faults", LOSSY_10), core=("step4", signal.SIGKILL, 0.0)),
    Case("core-killed-plan-out-lossy", "the Core SIGKILLed just after publishing a recovery "
         "plan, on a bus dropping 10%", (*KILL, "--bus-faults", LOSSY_10),
         core=("plan", signal.SIGKILL, 0.0)),
    Case("host-killed-mid-step", "the job host (store, workers' parent) SIGKILLed in step 4",
         ("--checkpoint-every", "2"), stops=True, kill_host="mid-step"),
    Case("host-killed-in-recovery", "the job host SIGKILLed while a recovery plan is out",
         ("--fault", "kill:1@4:backward", "--checkpoint-every", "2"), stops=True,
         kill_host="during-recovery"),
]  # fmt: skip


def train_cmd(out: Path, steps: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "elaswave.cli.main", "train", "--out", str(out),
            "--dp", "4", "--pp", "2", "--steps", str(steps), "--global-batch", "16",
            "--micro-batch", "2", "--overwrite", *args]  # fmt: skip


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=600)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


def _reached(events: list, when: str) -> bool:
    if when.startswith("step"):
        # A worker is in step N once it reported step N - 1 (the log keeps a worker's
        # heartbeats, which say its step, once in 5 s).
        return any(isinstance(e, StepTiming) and e.step >= int(when[4:]) - 1 for e in events)
    return any(isinstance(e, RecoveryPlan) for e in events)  # during-recovery


def _log_records(path: Path, event: str) -> list[dict]:
    docs = []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        if line.startswith("{") and f'"{event}"' in line:
            doc = json.loads(line)
            if doc.get("event") == event:
                docs.append(doc)
    return docs


def _iso(text: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def signal_core(out: Path, cmd: list[str], when: str, sig: signal.Signals, hold_s: float):
    """Run the job and signal its Core at ``when``; return the finished process and what
    the outage was: how long until a Core served again, how long the workers paused."""
    shutil.rmtree(out, ignore_errors=True)  # a previous invocation's log and pid file
    log = out / "events.log"
    own = when in ("plan", "commit")  # the Core kills itself there: see CORE_FAULT_ENV
    env = dict(os.environ, **{CORE_FAULT_ENV: when}) if own else None
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
    )
    deadline = time.monotonic() + 300
    while not own and not (
        (out / "core.pid").exists()
        and log.exists()
        and _reached([r.event for r in read_run_log(out)], when)
    ):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{' '.join(cmd)}: the job ended before the signal point")
        time.sleep(0.01)
    signalled = time.time()
    if not own:
        pid = int((out / "core.pid").read_text())
        os.kill(pid, sig)
        if sig == signal.SIGSTOP:
            time.sleep(hold_s)
            os.kill(pid, signal.SIGCONT)
    _, err = proc.communicate(timeout=600)
    proc.stderr = err
    if own:
        (hit,) = _log_records(out / "logs" / "core0.log", "core.fault_injected")
        signalled = _iso(hit["timestamp"])
    restored = _log_records(out / "logs" / "core1.log", "core.restored")
    if restored:
        back = _iso(restored[0]["timestamp"])
        source = f"restore point at byte {restored[0]['point']}" if restored[0]["point"] else "log"
        away = f"a new Core served {back - signalled:.2f} s after the kill (from its {source})"
    else:
        away = f"the Core was stopped {hold_s:.1f} s" if sig == signal.SIGSTOP else ""
    logs = [out / "logs" / f"rank{rank}.log" for rank in range(8)]
    paused = [d["paused_s"] for p in logs for d in _log_records(p, "core.outage_resumed")]
    steps = {d["step"] for p in logs for d in _log_records(p, "core.outage_paused")}
    pause = (
        f"all {len(paused)} workers paused before step {min(steps)} for up to {max(paused):.2f} s"
        if paused
        else "no worker paused"
    )
    return proc, f"{away}; {pause}".lstrip("; ")


def kill_host(out: Path, cmd: list[str], when: str) -> str:
    """Start the job, SIGKILL the job host at ``when``; say how long its children lived."""
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while True:
        events = [r.event for r in read_run_log(out)]
        if when == "mid-step" and any(isinstance(e, StepTiming) and e.step == 3 for e in events):
            break
        if when == "during-recovery" and any(isinstance(e, RecoveryPlan) for e in events):
            break
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{' '.join(cmd)}: the job ended before the kill point")
        time.sleep(0.02)
    pids = [e.pid for e in events if isinstance(e, WorkerStarted)]
    pids.append(int((out / "core.pid").read_text()))
    killed = time.monotonic()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    while any(alive(p) for p in pids) and time.monotonic() - killed < 30:
        time.sleep(0.01)
    left = [p for p in pids if alive(p)]
    if left:
        raise SystemExit(f"processes {left} outlived the job host")
    return (
        f"all {len(pids) - 1} workers and the Core gone {time.monotonic() - killed:.2f} s "
        "after the host"
    )


def resume_check(out: Path, ref: Path, steps: int) -> str:
    resumed = out.with_name(out.name + "_resumed")
    proc = run([sys.executable, "-m", "elaswave.cli.main", "train", "--out", str(resumed),
                "--resume", str(out)])  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"resume of {out} failed:\n{proc.stderr[-2000:]}")
    s = read_summary(resumed)
    ref_loss = read_summary(ref).loss
    loss = loss_rel_diff(list(s.loss), list(ref_loss[s.first_step :]))
    params = param_rel_diff(load_params(resumed), load_params(ref))
    if s.steps_completed != steps or loss > 1e-5 or params > 1e-5:
        raise SystemExit(f"resumed {out}: loss {loss:.1e}, params {params:.1e}")
    return f"resumed from step {s.first_step}: loss {loss:.0e}, params {params:.0e} rel."


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "control_plane")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs")
    parser.add_argument(
        "--restore-every",
        type=int,
        default=2048,
        help="event log bytes between the Core's restore points (default 2048: a restarted "
        "Core reads a point, as after a long job; 0: the Core's own default, 32 MiB)",
    )
    args = parser.parse_args()
    if args.restore_every:
        os.environ[CORE_RESTORE_EVERY_ENV] = str(args.restore_every)
    args.out.mkdir(parents=True, exist_ok=True)
    refs: dict[int, Path] = {}
    for steps in sorted({c.steps or args.steps for c in CASES}):
        refs[steps] = args.out / f"reference_{steps}"
        if run(train_cmd(refs[steps], steps)).returncode != 0:
            raise SystemExit("the fault-free reference run failed")
    for case in CASES:
        steps = case.steps or args.steps
        ref = refs[steps]
        for i in range(1 if case.stops else args.repeats):
            out = args.out / f"{case.name}_{i}"
            cmd = train_cmd(out, steps, *case.args)
            if case.kill_host:
                case.notes.append(kill_host(out, cmd, case.kill_host))
                case.notes.append(resume_check(out, ref, steps))
                continue
            started = time.monotonic()
            if case.core:
                proc, outage = signal_core(out, cmd, *case.core)
                case.notes.append(f"run {i}: {outage}")
            else:
                proc = run(cmd)
            if case.stops:
                if proc.returncode != 1:
                    raise SystemExit(f"{case.name}: expected the job to stop, rc {proc.returncode}")
                reason = proc.stderr.strip().splitlines()[-1]
                case.notes.append(f"stopped after {time.monotonic() - started:.1f} s: {reason}")
                case.notes.append(resume_check(out, ref, steps))
                continue
            if proc.returncode != 0:
                raise SystemExit(f"{case.name} failed:\n{proc.stderr[-3000:]}")
            diff = compare_runs(out, ref)
            replay = replay_run(out)
            if diff.loss_rel > 1e-4 or diff.param_rel > 1e-4 or replay.diverged is not None:
                raise SystemExit(f"{case.name}: diverged ({diff}, replay {replay.diverged})")
            s = read_summary(out)
            if s.recoveries:
                case.mttr.append(sum(r.mttr_s for r in s.recoveries))
            if i == 0:
                recs = s.recoveries
                case.notes.append(
                    f"recoveries {[list(r.ranks) for r in recs]}, superseded "
                    f"{[r.superseded for r in recs]}; {len(replay.plans)} plan(s) replayed; "
                    f"loss {diff.loss_rel:.0e}, params {diff.param_rel:.0e} rel."
                )
                bus = s.bus.workers
                if bus.get("injected_dropped"):
                    case.notes.append(
                        f"workers: {bus['injected_dropped']} dropped, {bus['duplicates']} dups "
                        f"discarded, {bus['asked']} asked again, {bus['fetched']} fetched"
                    )
    base = statistics.median(CASES[0].mttr)
    rows = []
    for case in CASES:
        mttr = statistics.median(case.mttr) if case.mttr else None
        outcome = "stops, resumable" if case.stops else "continues, matches fault-free"
        rows.append({
            "case": case.name, "fault": case.fault, "outcome": outcome,
            "mttr_s": mttr, "extra_mttr_s": None if mttr is None else mttr - base,
            "runs": case.mttr, "notes": case.notes,
        })  # fmt: skip
    lines = [
        "# Control-plane faults (measured)",
        "",
        f"`.venv/bin/python scripts/control_plane_faults.py --repeats {args.repeats} "
        f"--steps {args.steps} --restore-every {args.restore_every}`: dp=4 x pp=2, real CPU "
        f"processes on the 2-core host. MTTR is the median over runs of the sum over a "
        f"run's recoveries; extra MTTR is against the baseline row of the same invocation "
        f"({base:.3f} s). A restarted Core restores from its newest restore point and the "
        f"log after it (points every {args.restore_every or '32 MiB of'} bytes of log).",
        "",
        "| fault | outcome | MTTR (s) | extra MTTR (s) | details |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        mttr = "-" if r["mttr_s"] is None else f"{r['mttr_s']:.3f}"
        extra = "-" if r["extra_mttr_s"] is None else f"{r['extra_mttr_s']:+.3f}"
        lines.append(f"| {r['fault']} | {r['outcome']} | {mttr} | {extra} | "
                     f"{'; '.join(r['notes'])} |")  # fmt: skip
    args.docs.mkdir(exist_ok=True)
    (args.docs / "control_plane.md").write_text("\n".join(lines) + "\n")
    (args.docs / "control_plane.json").write_text(json.dumps(rows, indent=2))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
