"""Steady state after a few ranks are lost, simulated, with ElasWave's planner choosing
the pipeline schedule (``--schedule auto``, from the plan it runs before the loss:
the schedule it chose for the fault-free job) beside ElasWave on 1F1B, ReCycle and
TorchFT.

    .venv/bin/python scripts/after_loss_schedules.py [--md FILE] [--json FILE]

The cases and losses of ``scripts/churn.py``'s steady-state table (Llama2-7B on H100s,
one rank of each stage in turn, then of two and of three stages). Every figure is each
policy's samples/s relative to the fault-free job on 1F1B, the reference every policy
starts from; ElasWave's own fault-free job under ``auto`` is given in its first row.
Everything is SIMULATED (the runtime's planners and cost model, no device).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from churn import CASES, Case, _job

from elaswave.engine.recovery import Rebalancing, with_schedule
from elaswave.engine.schedule import Schedule
from elaswave.engine.steptime import plan_step_time
from elaswave.fabric.errors import Unrecoverable
from elaswave.sim.policies import SimJob, SimPolicy, answer, baseline

COLUMNS = ("elaswave auto", "schedule", "elaswave 1f1b", "recycle", "torchft")


def _rel(job: SimJob, policy: SimPolicy, failed: list[int], base: float) -> float | str:
    try:
        return answer(policy, job, job.plan(), failed, shorten=False).throughput / base
    except Unrecoverable as exc:  # out of memory, or nothing left: shown as such
        return type(exc).__name__


def rows(case: Case) -> list[dict]:
    plain = _job(case)
    auto = dataclasses.replace(plain, schedules=tuple(Schedule))
    base = baseline(plain).throughput
    choosing = Rebalancing(layers=auto.layers, device=auto.device, schedules=auto.schedules)
    start = with_schedule(auto.plan(), choosing)  # what `auto` runs before the loss
    losses = [[s * case.dp] for s in range(case.pp)]
    losses += [[s * case.dp for s in range(k)] for k in (2, 3) if k <= case.pp]
    out = []
    for failed in losses:
        chosen = answer(SimPolicy.ELASWAVE, auto, start, failed, shorten=False)
        out.append({
            "case": case.name,
            "stages": sorted(r // case.dp for r in failed),
            "elaswave auto": chosen.throughput / base,
            "schedule": str(chosen.plan.schedule),
            "elaswave 1f1b": _rel(plain, SimPolicy.ELASWAVE, failed, base),
            "recycle": _rel(plain, SimPolicy.RECYCLE, failed, base),
            "torchft": _rel(plain, SimPolicy.TORCHFT, failed, base),
        })  # fmt: skip
    return out


def markdown(table: list[dict]) -> str:
    head = ["layout", "ranks lost in stages", *COLUMNS, "auto >= recycle"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table:
        vals = [f"{r[c]:.3f}" if isinstance(r[c], float) else r[c] for c in COLUMNS]
        ok = isinstance(r["recycle"], str) or r["elaswave auto"] >= r["recycle"]
        stages = ", ".join(map(str, r["stages"])) or "none (fault-free)"
        out.append("| " + " | ".join([r["case"], stages, *vals, "yes" if ok else "no"]) + " |")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--md", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    table = []
    for case in CASES:
        plain = _job(case)
        auto = dataclasses.replace(plain, schedules=tuple(Schedule))
        fault_free = baseline(plain).step_s
        choosing = Rebalancing(layers=auto.layers, device=auto.device, schedules=auto.schedules)
        plan = with_schedule(auto.plan(), choosing)
        step = plan_step_time(plan, auto.layers, auto.device).step_s
        table.append({
            "case": case.name, "stages": [], "elaswave auto": fault_free / step,
            "schedule": str(plan.schedule), "elaswave 1f1b": 1.0, "recycle": 1.0,
            "torchft": 1.0,
        })  # fmt: skip
        table += rows(case)
    text = markdown(table)
    print(text)
    if args.md is not None:
        args.md.write_text(text + "\n")
    if args.json is not None:
        args.json.write_text(json.dumps(table, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
