"""``elaswave sim``: predict a job's throughput and MTTR under a trace, per policy.

The job is described by flags (model preset, device preset, TP x PP x DP, micro- and
global batch); the trace comes from a CSV file in the published spot-trace form
(``--trace``: the cluster starts empty), a per-device MTBF (``--mtbf-hours``), fixed
intervals (``--every-s``) or a generated spot cluster (``--spot-hours``), and is mapped
onto the job's node slots (:func:`elaswave.sim.trace.to_slots`). Every policy runs the same trace;
the command prints one line per policy and writes ``sim.json`` and ``sim.png`` to
``--out``. Everything but :func:`render` is pure and needs no matplotlib.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from elaswave.engine.cost import DEVICES, DeviceSpec, LayerCost, device
from elaswave.engine.schedule import ScheduleSetting
from elaswave.engine.steptime import plan_step_time
from elaswave.model.config import PRESETS, preset
from elaswave.sim.mttr import RecoveryCosts
from elaswave.sim.policies import Layout, SimJob, SimPolicy, baseline, elaswave_start
from elaswave.sim.timeline import Timeline, simulate
from elaswave.sim.trace import (
    SlotTrace,
    TraceEvent,
    filled_fraction,
    format_trace,
    full_start,
    periodic_failures,
    poisson_failures,
    slot_trace,
    spot_trace,
    to_slots,
)

PLOT_EXTRA = "install the plot extra: pip install 'elaswave[plot]'"
COLOURS = {
    SimPolicy.ELASWAVE: "tab:blue",
    SimPolicy.ELASWAVE_MIGRATE: "tab:cyan",
    SimPolicy.ELASWAVE_RESIZE: "tab:purple",
    SimPolicy.RECYCLE: "tab:orange",
    SimPolicy.TORCHFT: "tab:red",
    SimPolicy.RESTART: "tab:grey",
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sim",
        help="simulate a large job under a failure trace, per elastic policy",
        description="Simulate TP x PP x DP training under a trace of node removals, "
        "additions and slowdowns with ElasWave's planners and the baselines (ReCycle, "
        "TorchFT, checkpoint-restart); print throughput and MTTR per policy and write "
        "OUT/sim.json and OUT/sim.png. Recovery control-plane times are assumptions, "
        "printed with the result; plans and step times are the runtime's own.",
    )
    _add_job_flags(p)
    _add_trace_flags(p)
    _add_output_flags(p)


def _add_job_flags(p: argparse.ArgumentParser) -> None:
    """The job: model, device, layout, how long it runs."""
    p.add_argument("--model", default="llama2-7b", help=f"one of {', '.join(PRESETS)}")
    p.add_argument("--device", default="ascend-910b", help=f"one of {', '.join(DEVICES)}")
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--pp", type=int, default=3)
    p.add_argument("--dp", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=8192)
    p.add_argument("--devices-per-node", type=int, default=8)
    p.add_argument(
        "--profile",
        type=Path,
        metavar="PATH",
        help="a run's profile.json (elaswave train --profile on): price the layers by "
        "their measured seconds on --device instead of the FLOP formulas; the model must "
        "have as many layers, and --tp must be 1 (the layers were measured whole)",
    )
    p.add_argument(
        "--schedule",
        default=ScheduleSetting.AUTO.value,
        help="ElasWave's pipeline schedule, as `elaswave run --schedule`: auto (default: "
        "its planner takes the one it simulates fastest, for the initial plan and at every "
        "change), 1f1b, zb-h1 or zb-cost; the other policies run 1F1B",
    )
    p.add_argument(
        "--layout",
        default=Layout.REPLICA_MAJOR.value,
        help="how TP groups fill nodes: replica-major (a replica's stages on consecutive "
        "nodes) or stage-major (a stage's replicas on consecutive nodes)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=1000,
        help="without --trace or --spot-hours: simulate as long as the fault-free job takes "
        "for this many steps (default 1000); every policy runs over the same time span",
    )
    p.add_argument(
        "--hours",
        type=float,
        help="the simulated span in hours (default: the trace's end from the job's start, "
        "or --steps fault-free steps)",
    )


def _add_trace_flags(p: argparse.ArgumentParser) -> None:
    """Where the trace comes from, and the generators' settings."""
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--trace",
        type=Path,
        help="published spot trace, CSV of time_ms,add|remove|slow,NODE[,FACTOR]: the "
        "cluster starts empty; the job starts once it has a node for every node slot, "
        "later arrivals wait as spares for a removed node's slot",
    )
    src.add_argument("--mtbf-hours", type=float, help="per-device MTBF: Poisson node removals")
    src.add_argument("--every-s", type=float, help="remove a node every this many seconds")
    src.add_argument(
        "--spot-hours",
        type=float,
        help="a generated spot cluster this many hours long: preemption bursts, "
        "replacements minutes later, less capacity in the afternoon",
    )
    p.add_argument("--count", type=int, default=1, help="removals for --every-s (default 1)")
    p.add_argument("--repair-s", type=float, help="with --mtbf-hours: a node returns after this")
    p.add_argument(
        "--spot-nodes",
        type=int,
        help="with --spot-hours: nodes the spot cluster targets (default: the job's "
        "nodes plus 10%%, at least one spare)",
    )
    p.add_argument(
        "--spot-bursts-per-hour",
        type=float,
        default=0.5,
        help="with --spot-hours: preemption bursts per hour (default 0.5)",
    )
    p.add_argument(
        "--spot-burst-mean",
        type=float,
        help="with --spot-hours: mean nodes a burst reclaims (default 5%% of the cluster)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of --mtbf-hours and --spot-hours")


def _add_output_flags(p: argparse.ArgumentParser) -> None:
    """Which policies run, and where the results go."""
    p.add_argument(
        "--policies",
        default=",".join(p.value for p in SimPolicy),
        help=f"comma-separated, from {', '.join(p.value for p in SimPolicy)}",
    )
    p.add_argument(
        "--checkpoint-every", type=int, default=100, help="restart: steps per checkpoint"
    )
    p.add_argument("--out", type=Path, default=Path("runs/sim"), help="directory for the results")
    p.add_argument("--no-plot", action="store_true", help="write sim.json only")


def _positive(name: str, value: float | None) -> None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ValueError(f"--{name} {value!r}: must be a positive number")


def parse_policies(text: str) -> list[SimPolicy]:
    out = []
    for word in (w.strip() for w in text.split(",")):
        try:
            out.append(SimPolicy(word))
        except ValueError:
            valid = ", ".join(p.value for p in SimPolicy)
            raise ValueError(f"--policies: unknown policy {word!r}; valid: {valid}") from None
    if not out:
        raise ValueError("--policies: name at least one policy")
    return list(dict.fromkeys(out))


def profiled_layers(path: Path, spec: DeviceSpec, *, tp: int) -> tuple[LayerCost, ...]:
    """The layers of a run's profile.json priced on ``spec`` at its base clock."""
    from elaswave.runtime.host.profile import LayerProfile  # imports torch: only when asked for

    if tp != 1:
        raise ValueError(f"--profile with --tp {tp}: the profile measured whole layers; use --tp 1")
    try:
        raw = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"--profile {str(path)!r}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"--profile {str(path)!r}: not JSON: {exc}") from None
    try:
        return LayerProfile.from_dict(raw).costs(spec)
    except ValueError as exc:
        raise ValueError(f"--profile {str(path)!r}: {exc}") from None


def job_from_args(args: argparse.Namespace) -> SimJob:
    try:
        layout = Layout(args.layout)
    except ValueError:
        valid = ", ".join(v.value for v in Layout)
        raise ValueError(f"--layout {args.layout!r}: valid layouts: {valid}") from None
    try:
        schedule = ScheduleSetting(args.schedule)
    except ValueError:
        valid = ", ".join(v.value for v in ScheduleSetting)
        raise ValueError(f"--schedule {args.schedule!r}: valid schedules: {valid}") from None
    spec = device(args.device)
    profile: tuple[LayerCost, ...] = ()
    if getattr(args, "profile", None) is not None:
        profile = profiled_layers(args.profile, spec, tp=args.tp)
    return SimJob(
        preset(args.model),
        spec,
        tp=args.tp,
        pp=args.pp,
        dp=args.dp,
        micro_batch=args.micro_batch,
        global_batch=args.global_batch,
        devices_per_node=args.devices_per_node,
        layout=layout,
        profile=profile,
        schedules=schedule.choices,
    )


def spot_nodes(args: argparse.Namespace, job: SimJob) -> int:
    """The nodes a --spot-hours cluster targets: --spot-nodes, or the job's plus 10%."""
    if args.spot_nodes is None:
        return job.num_nodes + max(1, math.ceil(job.num_nodes / 10))
    if args.spot_hours is None:
        raise ValueError("--spot-nodes: only with --spot-hours")
    if not 1 <= args.spot_nodes <= 1_000_000:
        raise ValueError(f"--spot-nodes {args.spot_nodes}: must be in 1..1000000")
    return int(args.spot_nodes)


def trace_from_args(args: argparse.Namespace, job: SimJob, span_ms: float) -> tuple[str, SlotTrace]:
    """(a description, the trace on the job's node slots) from --trace, --mtbf-hours,
    --every-s or --spot-hours; no source: every node there throughout."""
    _positive("mtbf-hours", args.mtbf_hours)
    _positive("every-s", args.every_s)
    _positive("repair-s", args.repair_s)
    _positive("spot-hours", args.spot_hours)
    capacity = spot_nodes(args, job)
    if args.trace is not None:
        try:
            text = args.trace.read_text()
        except OSError as exc:
            raise ValueError(f"--trace {str(args.trace)!r}: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise ValueError(f"--trace {str(args.trace)!r}: not a text file") from None
        slots = slot_trace(text, num_slots=job.num_nodes, source=str(args.trace))
        return f"trace {args.trace}, job from {slots.start_ms / 1000:.1f} s", slots
    if args.spot_hours is not None:
        if args.spot_hours > 10_000:
            raise ValueError(f"--spot-hours {args.spot_hours!r}: must be at most 10000")
        if not 0 <= args.spot_bursts_per_hour <= 1000:
            raise ValueError(
                f"--spot-bursts-per-hour {args.spot_bursts_per_hour!r}: must be in 0..1000"
            )
        if args.spot_burst_mean is not None and not 1 <= args.spot_burst_mean <= capacity:
            raise ValueError(
                f"--spot-burst-mean {args.spot_burst_mean!r}: must be in 1..{capacity} "
                "(the spot cluster's nodes)"
            )
        events = spot_trace(
            capacity=capacity,
            hours=args.spot_hours,
            seed=args.seed,
            bursts_per_hour=args.spot_bursts_per_hour,
            burst_mean=args.spot_burst_mean,
        )
        slots = to_slots(events, job.num_nodes, source="--spot-hours trace")
        where = (
            f"spot cluster of {capacity} nodes for {args.spot_hours:g} h, seed {args.seed}, "
            f"job from {slots.start_ms / 1000:.1f} s"
        )
        return where, slots
    if args.mtbf_hours is not None:
        events = poisson_failures(
            num_nodes=job.num_nodes,
            devices_per_node=job.devices_per_node,
            mtbf_hours=args.mtbf_hours,
            duration_ms=span_ms,
            seed=args.seed,
            repair_ms=None if args.repair_s is None else args.repair_s * 1000,
        )
        where = f"per-device MTBF {args.mtbf_hours:g} h, seed {args.seed}"
        return where, to_slots(events, job.num_nodes)
    if args.every_s is not None:
        if not 0 <= args.count <= job.num_nodes - 1:
            raise ValueError(
                f"--count {args.count}: must be in 0..{job.num_nodes - 1} (one node must survive)"
            )
        events = periodic_failures(
            num_nodes=job.num_nodes, interval_ms=args.every_s * 1000, count=args.count
        )
        where = f"{args.count} removals every {args.every_s:g} s, last node first"
        return where, to_slots(events, job.num_nodes)
    return "no events", to_slots(full_start(job.num_nodes), job.num_nodes)


def device_fraction(events: Sequence[TraceEvent], num_nodes: int, end_s: float) -> float:
    """Time-averaged fraction of the job's node slots filled over [0, end_s] s after the
    job's start, from the slot events after the start (:attr:`SlotTrace.events`)."""
    return filled_fraction(sorted(events, key=lambda e: e.time_ms), num_nodes, end_s)


def summarise(
    job: SimJob,
    timelines: Sequence[Timeline],
    trace: SlotTrace,
    *,
    description: str,
    costs: RecoveryCosts,
    model_name: str,
) -> dict[str, Any]:
    base = baseline(job)
    out: dict[str, Any] = {
        "job": {
            "model": model_name,
            "model_config": asdict(job.model),
            "device": job.device.name,
            "tp": job.tp,
            "pp": job.pp,
            "dp": job.dp,
            "micro_batch": job.micro_batch,
            "global_batch": job.global_batch,
            "devices": job.num_devices,
            "nodes": job.num_nodes,
            "devices_per_node": job.devices_per_node,
            "layout": job.layout.value,
        },
        "trace": {
            "source": description,
            "events": len(trace.events),
            "start_ms": trace.start_ms,
            "end_ms": trace.end_ms,
            "max_spares": max((n for _, n in trace.spares), default=0),
            "csv": format_trace(trace.published),
        },
        "assumptions": asdict(costs),
        "baseline": {"step_s": base.step_s, "samples_per_s": base.throughput, "schedule": "1f1b"},
        "elaswave_fault_free": _own_fault_free(job),
        "policies": {},
    }
    for tl in timelines:
        end = tl.span_s if tl.span_s is not None else (tl.steps[-1].end_s if tl.steps else 0.0)
        frac = device_fraction(trace.events, trace.num_slots, end)
        rel = tl.samples_per_s / base.throughput
        mttrs = [c.mttr_s for c in tl.changes if c.kind == "remove" and c.mttr_s is not None]
        own = out["elaswave_fault_free"] if tl.policy.is_elaswave else out["baseline"]
        out["policies"][tl.policy.value] = {
            "samples_per_s": tl.samples_per_s,
            "vs_fault_free": rel,
            "vs_own_fault_free": tl.samples_per_s / own["samples_per_s"],
            "device_fraction": frac,
            "linear_scaling_efficiency": rel / frac if frac > 0 else None,
            "steps": len(tl.steps),
            "simulated_s": end,
            "stopped": tl.stopped,
            "waited_s": tl.waited_s,
            "median_mttr_s": statistics.median(mttrs) if mttrs else None,
            "changes": [asdict(c) for c in tl.changes],
            "timeline": [
                [s.end_s, s.samples / (s.end_s - prev)]
                for s, prev in zip(tl.steps, [0.0] + [p.end_s for p in tl.steps], strict=False)
            ],
        }
    return out


def _own_fault_free(job: SimJob) -> dict[str, Any]:
    """ElasWave's own fault-free job: the plan it starts on (its ``--schedule``)."""
    plan = elaswave_start(job)
    step = plan_step_time(plan, job.layers, job.device).step_s
    return {
        "step_s": step,
        "samples_per_s": plan.global_batch / step,
        "schedule": str(plan.schedule),
    }


def lines(doc: dict[str, Any]) -> list[str]:
    job = doc["job"]
    head = (
        f"{job['model']} on {job['devices']} {job['device']} "
        f"devices (tp {job['tp']} pp {job['pp']} dp {job['dp']}, {job['layout']}); "
        f"{doc['trace']['source']} ({doc['trace']['events']} events); fault-free "
        f"{doc['baseline']['samples_per_s']:.1f} samples/s on 1F1B"
    )
    own = doc["elaswave_fault_free"]
    if own["schedule"] != doc["baseline"]["schedule"]:
        head += f", {own['samples_per_s']:.1f} on ElasWave's {own['schedule']}"
    out = [head, f"{'policy':<18}{'samples/s':>11}{'vs fault-free':>15}{'vs own':>8}{'LSE':>7}"
           f"{'median MTTR':>13}{'waited':>10}"]  # fmt: skip
    for name, p in doc["policies"].items():
        lse = p["linear_scaling_efficiency"]
        mttr = p["median_mttr_s"]
        out.append(
            f"{name:<18}{p['samples_per_s']:>11.1f}{p['vs_fault_free']:>15.3f}"
            f"{p['vs_own_fault_free']:>8.3f}"
            f"{'' if lse is None else f'{lse:.3f}':>7}"
            f"{'-' if mttr is None else f'{mttr:.1f} s':>13}{p['waited_s']:>9.0f}s"
        )
    return out


def render(doc: dict[str, Any], out: Path) -> None:
    """Throughput over time per policy, and their time-averaged throughput side by side."""
    try:
        import matplotlib  # noqa: F401  (the plot extra: optional)
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ValueError(f"matplotlib is not installed; {PLOT_EXTRA}") from None
    fig = Figure(figsize=(12, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2, width_ratios=[2.4, 1])
    fig.suptitle(lines(doc)[0] + " (SIMULATED)", fontsize=9)
    names = list(doc["policies"])
    for name in names:
        series = doc["policies"][name]["timeline"]
        if series:
            xs = [0.0] + [t / 3600 for t, _ in series]
            ys = [series[0][1]] + [r for _, r in series]
            left.step(xs, ys, where="pre", lw=1.2, label=name, color=COLOURS[SimPolicy(name)])
    left.set_xlabel("hours")
    left.set_ylabel("samples/s per step, recovery time included")
    left.set_ylim(bottom=0)
    left.grid(alpha=0.3)
    left.legend(fontsize=8, loc="lower left")
    rates = [doc["policies"][n]["samples_per_s"] for n in names]
    bars = right.bar(range(len(names)), rates, color=[COLOURS[SimPolicy(n)] for n in names])
    for bar, n in zip(bars, names, strict=True):
        p = doc["policies"][n]
        label = f"{p['vs_fault_free']:.2f}"
        right.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                       ha="center", va="bottom", fontsize=8)  # fmt: skip
    right.axhline(doc["baseline"]["samples_per_s"], color="black", ls=":", lw=1)
    right.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    right.set_ylabel("time-averaged samples/s (dotted: fault-free)")
    try:
        fig.savefig(out, format="png", dpi=100)
    except OSError as exc:
        raise ValueError(f"cannot write {str(out)!r}: {exc.strerror or exc}") from None


def span_s(args: argparse.Namespace, job: SimJob, trace: SlotTrace) -> float:
    """The stretch every policy is simulated over: --hours; else a published or
    generated spot trace's end from the job's start; else --steps fault-free steps."""
    if args.hours is not None:
        return float(args.hours) * 3600
    end_s = (trace.end_ms - trace.start_ms) / 1000
    if (args.trace is not None or args.spot_hours is not None) and end_s > 0:
        return end_s
    return baseline(job).step_s * args.steps


def run(args: argparse.Namespace) -> int:
    policies = parse_policies(args.policies)
    for name in ("steps", "checkpoint_every"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    job = job_from_args(args)
    _positive("hours", args.hours)
    costs = RecoveryCosts(checkpoint_every=args.checkpoint_every)
    span_ms = baseline(job).step_s * args.steps * 1000 * 1.5
    description, trace = trace_from_args(args, job, span_ms)
    until = span_s(args, job, trace)
    timelines = [simulate(job, p, trace.events, until_s=until, costs=costs) for p in policies]
    doc = summarise(
        job, timelines, trace, description=description, costs=costs, model_name=args.model
    )
    doc["job"]["profile"] = None if args.profile is None else str(args.profile)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sim.json").write_text(json.dumps(doc, indent=1) + "\n")
    except OSError as exc:
        raise ValueError(f"cannot write to {str(args.out)!r}: {exc.strerror or exc}") from None
    if not args.no_plot:
        render(doc, args.out / "sim.png")
    print("\n".join(lines(doc)))
    written = "sim.json" if args.no_plot else "sim.json and sim.png"
    print(f"wrote {written} to {args.out} (simulated; recovery times are assumptions, see JSON)")
    return 0
