"""Elastic training under churn, simulated: spot-cluster traces in the published form.

    .venv/bin/python scripts/churn.py [--out docs] [--seeds 1,2,3] [--quick] [--render]

Each row is one generated spot trace (:func:`elaswave.sim.trace.spot_trace`: the
cluster starts empty, nodes arrive, preemption bursts reclaim some, replacements with
new ids arrive minutes later, capacity dips in the afternoon) mapped onto a job's node
slots, and every policy simulated over the same stretch of it (from the job's start to
the trace's end) with the runtime's own planners and cost model. Recovery times are
the assumptions of RecoveryCosts. Columns: time-averaged samples/s relative to the
fault-free job; ElasWave's linear scaling efficiency (that ratio over the fraction of
node slots filled); ElasWave over ReCycle and over TorchFT; and the overhead bound: one
minus the time ElasWave's changes stop training (detection, edits, moves, lost partial
steps) over the span, the most any plan could reach under these assumptions.

Everything is SIMULATED. Writes OUT/churn.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

from elaswave.cli.sim import summarise
from elaswave.engine.cost import device
from elaswave.engine.recovery import Rebalancing, with_schedule
from elaswave.engine.schedule import Schedule
from elaswave.engine.steptime import plan_step_time
from elaswave.fabric.errors import Unrecoverable
from elaswave.model.config import PRESETS
from elaswave.sim.mttr import RecoveryCosts
from elaswave.sim.policies import Layout, SimJob, SimPolicy, answer, baseline
from elaswave.sim.timeline import simulate
from elaswave.sim.trace import spot_trace, to_slots

POLICIES = [SimPolicy.ELASWAVE, SimPolicy.ELASWAVE_MIGRATE, SimPolicy.RECYCLE,
            SimPolicy.TORCHFT, SimPolicy.RESTART]  # fmt: skip


@dataclass(frozen=True)
class Case:
    name: str
    tp: int
    pp: int
    dp: int
    global_batch: int
    devices_per_node: int
    capacity: int
    hours: float
    bursts_per_hour: float
    burst_mean: float


CASES = [
    Case("32 x 1-GPU nodes, tp1 pp4 dp8", 1, 4, 8, 512, 1, 34, 10.9, 5.0, 3.0),
    Case("24 x 1-GPU nodes, tp1 pp4 dp6", 1, 4, 6, 384, 1, 26, 5.0, 6.0, 2.0),
    Case("128 x 8-GPU nodes (1,024 GPUs), tp8 pp4 dp32", 8, 4, 32, 2048, 8, 136, 10.0, 4.0, 4.0),
]


def _job(case: Case, schedules: tuple[Schedule, ...] = ()) -> SimJob:
    return SimJob(PRESETS["llama2-7b"], device("h100"), tp=case.tp, pp=case.pp, dp=case.dp,
                  micro_batch=1, global_batch=case.global_batch,
                  devices_per_node=case.devices_per_node, layout=Layout.STAGE_MAJOR,
                  schedules=schedules)  # fmt: skip


STEADY = [SimPolicy.ELASWAVE, SimPolicy.RECYCLE, SimPolicy.TORCHFT]


def steady_state(case: Case, schedules: tuple[Schedule, ...] = ()) -> list[dict]:
    """Each policy's samples/s relative to fault-free once it has answered a few ranks
    lost (no change overheads): one rank of each stage in turn, then one rank in each of
    two and of three stages (replica 0's), the states a trace spends most time in.
    ``schedules``: those ElasWave's planner chooses from, from the plan it runs before
    the loss (the reference stays the fault-free job on 1F1B)."""
    job = _job(case, schedules)
    base = baseline(_job(case)).throughput
    choosing = Rebalancing(layers=job.layers, device=job.device, schedules=schedules)
    start = {p: job.plan() for p in STEADY}
    start[SimPolicy.ELASWAVE] = with_schedule(job.plan(), choosing)  # what it runs
    losses = [[s * case.dp] for s in range(case.pp)]
    losses += [[s * case.dp for s in range(k)] for k in (2, 3) if k <= case.pp]
    rows = []
    for failed in losses:
        rel = {}
        for p in STEADY:
            try:
                rel[p.value] = answer(p, job, start[p], failed, shorten=False).throughput / base
            except Unrecoverable as exc:  # out of memory, or nothing left: shown as such
                rel[p.value] = type(exc).__name__
        stages = sorted(r // case.dp for r in failed)
        filled = 1 - len(failed) / (case.pp * case.dp)
        rows.append({"case": case.name, "stages": stages, "filled": filled, "vs_fault_free": rel})
    return rows


def run_case(
    case: Case, seed: int, costs: RecoveryCosts, schedules: tuple[Schedule, ...] = ()
) -> dict:
    job = _job(case, schedules)
    events = spot_trace(
        capacity=case.capacity,
        hours=case.hours,
        seed=seed,
        bursts_per_hour=case.bursts_per_hour,
        burst_mean=case.burst_mean,
    )
    trace = to_slots(events, job.num_nodes, source=f"{case.name} seed {seed}")
    span = (trace.end_ms - trace.start_ms) / 1000
    started = time.perf_counter()
    timelines = [simulate(job, p, trace.events, until_s=span, costs=costs) for p in POLICIES]
    doc = summarise(job, timelines, trace, description=f"spot trace seed {seed}", costs=costs,
                    model_name="llama2-7b")  # fmt: skip
    pol = doc["policies"]
    ew = pol["elaswave"]
    stopped_s = sum(c["overhead_s"] + c["lost_s"] for c in ew["changes"])
    removes = sum(e.kind.value == "remove" for e in events)
    choosing = Rebalancing(layers=job.layers, device=job.device, schedules=schedules)
    own = plan_step_time(with_schedule(job.plan(), choosing), job.layers, job.device).step_s
    return {
        "elaswave_fault_free": baseline(job).step_s / own,
        "case": case.name,
        "seed": seed,
        "nodes": job.num_nodes,
        "trace_events": len(events),
        "trace_removals": removes,
        "slot_events": len(trace.events),
        "span_h": span / 3600,
        "vs_fault_free": {p: pol[p]["vs_fault_free"] for p in pol},
        "waited_s": {p: pol[p]["waited_s"] for p in pol},
        "elaswave_lse": ew["linear_scaling_efficiency"],
        "slots_filled": ew["device_fraction"],
        "vs_recycle": ew["samples_per_s"] / pol["recycle"]["samples_per_s"],
        "vs_torchft": ew["samples_per_s"] / pol["torchft"]["samples_per_s"],
        "overhead_bound": 1 - stopped_s / span,
        "simulated_in_s": time.perf_counter() - started,
    }


def _steady_md(steady: list[dict]) -> list[str]:
    head = ["layout", "ranks lost in stages", "slots filled"] + [p.value for p in STEADY]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in steady:
        vals = [r["vs_fault_free"][p.value] for p in STEADY]
        out.append("| " + " | ".join([
            r["case"], ", ".join(map(str, r["stages"])), f"{r['filled']:.3f}",
            *(f"{v:.3f}" if isinstance(v, float) else v for v in vals),
        ]) + " |")  # fmt: skip
    return out


def markdown(rows: list[dict], costs: RecoveryCosts, steady: list[dict]) -> str:
    head = ["trace", "seed", "events (removals)", "span h"] + [p.value for p in POLICIES]
    head += ["E LSE", "E/ReCycle", "E/TorchFT", "overhead bound", "bound", "bound/ReCycle",
             "bound/TorchFT", "E/bound"]  # fmt: skip
    out = [
        "# Elastic training under churn, simulated",
        "",
        "All figures are **SIMULATED** (`elaswave.sim`: the runtime's planners and cost "
        "model, no device). Command: `.venv/bin/python scripts/churn.py`. Llama2-7B on "
        "H100-like devices, micro-batch 1, stage-major. Traces: `spot_trace` in the "
        "published form (the cluster starts empty; bursts of preemptions; replacements "
        "with new node ids minutes later; an afternoon capacity dip), mapped onto the "
        "job's node slots (the job starts once every slot is filled; later arrivals are "
        "spares). Every policy runs over the same span (the job's start to the trace's "
        "end). Values are time-averaged samples/s relative to the fault-free job. "
        f"Assumed recovery times: {json.dumps(costs.__dict__)}.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in rows:
        vals = [f"{r['vs_fault_free'][p.value]:.3f}" for p in POLICIES]
        out.append(
            "| "
            + " | ".join(
                [
                    r["case"],
                    str(r["seed"]),
                    f"{r['trace_events']} ({r['trace_removals']})",
                    f"{r['span_h']:.1f}",
                    *vals,
                    f"{r['elaswave_lse']:.3f}",
                    f"{r['vs_recycle']:.3f}",
                    f"{r['vs_torchft']:.3f}",
                    f"{r['overhead_bound']:.3f}",
                    f"{_bound(r):.3f}",
                    f"{_bound(r) / r['vs_fault_free']['recycle']:.3f}",
                    f"{_bound(r) / r['vs_fault_free']['torchft']:.3f}",
                    f"{r['vs_fault_free']['elaswave'] / _bound(r):.3f}",
                ]
            )
            + " |"
        )
    out += [
        "",
        "E = elaswave (migrate+dvfs; its planner chooses the pipeline schedule, "
        "`--schedule auto`, unless this table was made with `--schedule 1f1b`). Fault-free "
        "is the job on 1F1B, every policy's reference; ElasWave's own fault-free job runs "
        f"the schedule its planner chooses ({_gains(rows)} the 1F1B job's samples/s, "
        "SIMULATED), so its ratios may pass 1. LSE = its ratio to fault-free over the fraction of "
        "node slots filled. Overhead bound = 1 - (time ElasWave's changes stop training: "
        "detection, communicator edits, shard restores, moves, partial steps lost) / span. "
        "Bound = overhead bound x the fraction of node slots filled x ElasWave's own "
        "fault-free speed: what ElasWave would "
        "reach scaling linearly whenever it trains, under the assumed change overheads; "
        "bound/ReCycle and bound/TorchFT are the most it could be ahead of them, and "
        "E/bound how close its plans come. Where bound/TorchFT is below 1.2 (or "
        "bound/ReCycle below 1.05), those ratios cannot be reached on that trace under "
        "these overheads.",
        "",
        "## The steady state after a few ranks are lost",
        "",
        "Each policy's samples/s relative to fault-free once it has answered the loss "
        "(no change overheads; replica 0's rank in each listed stage; SIMULATED):",
        "",
        *_steady_md(steady),
        "",
        "The bound assumes linear scaling. ElasWave keeps the global batch and its "
        "micro-batches: a stage left with 7 ranks splits every 8-sample micro-batch "
        "unevenly (one survivor takes 2 samples, in rotation), its neighbours wait for "
        "that share, the waits add up over the stages that are short, and layers move "
        "only whole; so its step grows by more than the lost fraction. ReCycle keeps "
        "every replica and hides part of the re-routed work in the pipeline's bubbles by "
        "deferring weight-gradient passes (`elaswave/sim/recycle.py`). ElasWave's "
        "planner chooses the schedule (`docs/schedules.md`): zero-bubble lists whose "
        "weight-gradient halves fill the bubbles 1F1B leaves, planned for the plan's own "
        "stage costs, with the layers and clocks rebalanced under each schedule; from the "
        "plan it runs before the loss (its fault-free job's) that puts it ahead of ReCycle "
        "in every row above (the same table with `--schedule 1f1b` and "
        "`scripts/after_loss_schedules.py` show both).",
        "",
        "On real processes (emulated device), a dp=3 x pp=2 job under a 20-event churn "
        "trace, with a stage lost whole and taken over by a rank of another stage: "
        "`docs/churn_runtime.md` (`scripts/churn_runtime.py`). A rank moving stage against "
        "checkpoint-restart: `docs/stage_move_mttr.md`. A job left with fewer ranks than "
        "stages waits for joiners with `--wait-for-nodes` (tests/fault/test_wait_for_nodes.py).",
    ]
    return "\n".join(out) + "\n"


def _gains(rows: list[dict]) -> str:
    """ElasWave's own fault-free speed over the 1F1B job's, over ``rows``."""
    gains = sorted({f"{r.get('elaswave_fault_free', 1.0):.3f}x" for r in rows})
    return gains[0] if len(gains) == 1 else f"{gains[0]} to {gains[-1]}"


def _bound(row: dict) -> float:
    """ElasWave's samples/s relative to fault-free at linear scaling from its own
    fault-free speed (its schedule's, relative to the 1F1B reference), less the time its
    changes stop training."""
    gain = row.get("elaswave_fault_free", 1.0)
    return float(row["overhead_bound"] * row["slots_filled"] * gain)


def plot(rows: list[dict], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    width = 0.8 / len(POLICIES)
    for k, p in enumerate(POLICIES):
        xs = [i + k * width for i in range(len(rows))]
        ax.bar(xs, [r["vs_fault_free"][p.value] for r in rows], width, label=p.value)
    labels = [f"{r['case'].split(',')[0]}\nseed {r['seed']}" for r in rows]
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))], labels, fontsize=7)
    ax.set_ylabel("time-averaged samples/s vs fault-free")
    ax.set_title("Churn on spot traces (SIMULATED)", fontsize=10)
    ax.legend(fontsize=8, ncol=len(POLICIES))
    ax.set_ylim(0, 1.05)
    fig.savefig(path, format="png", dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs"))
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--quick", action="store_true", help="the first case, one seed")
    parser.add_argument(
        "--cases", default=",".join(str(i) for i in range(len(CASES))),
        help=f"which cases, by index (0..{len(CASES) - 1}, default all); runs of different "
        "cases may go in parallel, each with its own OUT, their rows then joined into one "
        "churn.json and --render",
    )  # fmt: skip
    parser.add_argument(
        "--schedule", choices=["auto", "1f1b"], default="auto",
        help="ElasWave's schedules: auto (its planner chooses, default) or 1f1b only",
    )  # fmt: skip
    parser.add_argument(
        "--render", action="store_true", help="rewrite OUT/churn.{md,png} from OUT/churn.json"
    )
    args = parser.parse_args()
    schedules = tuple(Schedule) if args.schedule == "auto" else ()
    if args.render:
        try:
            rows = json.loads((args.out / "churn.json").read_text())["rows"]
        except (OSError, ValueError, KeyError) as exc:
            parser.error(f"--render needs {args.out}/churn.json written by this script: {exc}")
        steady = [r for case in CASES for r in steady_state(case, schedules)]
        (args.out / "churn.md").write_text(markdown(rows, RecoveryCosts(), steady))
        plot(rows, args.out / "churn.png")
        print(f"wrote {args.out}/churn.{{md,png}} from {args.out}/churn.json")
        return
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
        picked = [int(i) for i in args.cases.split(",")]
        cases = [CASES[i] for i in picked if i >= 0]
        if len(cases) != len(picked):
            raise IndexError
    except (ValueError, IndexError):
        parser.error(
            f"--seeds {args.seeds!r} --cases {args.cases!r}: comma-separated integers, "
            f"cases 0..{len(CASES) - 1}"
        )
    cases = cases[:1] if args.quick else cases
    costs = RecoveryCosts()
    rows = []
    for case in cases:
        for seed in seeds[:1] if args.quick else seeds:
            row = run_case(case, seed, costs, schedules)
            rows.append(row)
            print(f"{case.name} seed {seed}: elaswave {row['vs_fault_free']['elaswave']:.3f} "
                  f"recycle {row['vs_fault_free']['recycle']:.3f} torchft "
                  f"{row['vs_fault_free']['torchft']:.3f} LSE {row['elaswave_lse']:.3f} "
                  f"({row['simulated_in_s']:.0f} s)", flush=True)  # fmt: skip
    steady = [r for case in cases for r in steady_state(case, schedules)]
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {"rows": rows, "steady": steady}
    (args.out / "churn.json").write_text(json.dumps(doc, indent=1) + "\n")
    (args.out / "churn.md").write_text(markdown(rows, costs, steady))
    plot(rows, args.out / "churn.png")
    print(f"wrote {args.out}/churn.{{md,json,png}}")


if __name__ == "__main__":
    main()
