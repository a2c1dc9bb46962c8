"""The paper's 96-device shrink experiment and the 10^4 / 10^5-device timings, simulated.

    .venv/bin/python scripts/sim_paper.py [--out docs]

Workloads (paper §7): Llama2-7B (TP4 PP3 DP8, micro-batch 4, global batch 8192), 13B
(TP4 PP6 DP4, 2, 2048) and 34B (TP4 PP8 DP3, 1, 768) on 96 Ascend-910B-like devices,
8 per node, replica-major (a replica's stages on consecutive nodes, so that 3 nodes of
7B and of 13B are whole replicas, as the paper reports). Each loses nodes 0..k-1 for
k = 1, 2, 3 (and, as a second table, the last k nodes); every policy answers with its
plan, and the table gives its steady throughput after the change relative to the
fault-free job, with ElasWave's linear scaling efficiency (throughput ratio over device
ratio). A stage-major 34B run shows ReCycle's out-of-memory case. Then jobs of about
10^4 and 10^5 H100-like devices run 1,000 steps under a Poisson failure trace with every
policy, timed.

Everything here is simulated (the runtime's planners and cost model, no device);
recovery control-plane times are the assumptions of RecoveryCosts. Writes
OUT/sim_paper.{md,json} and OUT/sim_paper_100k.png.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

from elaswave.cli.sim import render, summarise
from elaswave.engine.cost import device
from elaswave.fabric.errors import Unrecoverable
from elaswave.model.config import PRESETS
from elaswave.sim.mttr import RecoveryCosts
from elaswave.sim.policies import Layout, SimJob, SimPolicy, answer, baseline
from elaswave.sim.recycle import OutOfMemory
from elaswave.sim.timeline import simulate
from elaswave.sim.trace import poisson_failures, to_slots

WORKLOADS = {
    "llama2-7b": (4, 3, 8, 4, 8192),
    "llama2-13b": (4, 6, 4, 2, 2048),
    "llama2-34b": (4, 8, 3, 1, 768),
}
SHOWN = [SimPolicy.ELASWAVE, SimPolicy.ELASWAVE_MIGRATE, SimPolicy.ELASWAVE_RESIZE,
         SimPolicy.RECYCLE, SimPolicy.TORCHFT, SimPolicy.RESTART]  # fmt: skip
PAPER_34B = {"recycle": 1.35, "torchft": 1.60}


def job(name: str, layout: Layout = Layout.REPLICA_MAJOR) -> SimJob:
    tp, pp, dp, mb, gb = WORKLOADS[name]
    return SimJob(PRESETS[name], device("ascend-910b"), tp=tp, pp=pp, dp=dp, micro_batch=mb,
                  global_batch=gb, layout=layout)  # fmt: skip


def shrink(j: SimJob, nodes: list[int]) -> dict:
    base = baseline(j)
    failed = [r for n in nodes for r in j.ranks_of_node(n)]
    row: dict = {"nodes": nodes, "failed_ranks": failed}
    for policy in SHOWN:
        try:
            out = answer(policy, j, base.plan, failed)
        except OutOfMemory as exc:
            row[policy.value] = {"oom": str(exc)}
            continue
        except Unrecoverable as exc:
            row[policy.value] = {"stopped": str(exc)}
            continue
        row[policy.value] = {
            "vs_fault_free": out.throughput / base.throughput,
            "global_batch": out.samples_per_step,
            "reason": out.reason,
        }
    lost = len(nodes) * j.devices_per_node
    row["device_ratio"] = (j.num_devices - lost) / j.num_devices
    ew = row["elaswave"].get("vs_fault_free")
    row["elaswave_lse"] = ew / row["device_ratio"] if ew is not None else None
    return row


def cell(entry: dict) -> str:
    if "oom" in entry:
        return "OOM"
    if "stopped" in entry:
        return "stopped"
    return f"{entry['vs_fault_free']:.3f}"


def ordering(row: dict) -> str:
    e, r, t = (row[p].get("vs_fault_free") for p in ("elaswave", "recycle", "torchft"))
    if r is None:
        return "ReCycle OOM" if "oom" in row["recycle"] else "ReCycle stopped"
    tol = 1e-9
    ok = e >= r - tol and r >= t - tol
    return "yes" if ok else f"**no** ({'E<R' if e < r - tol else ''}{'R<T' if r < t - tol else ''})"


def table(rows: dict) -> list[str]:
    head = "| model | nodes lost | " + " | ".join(p.value for p in SHOWN)
    out = [head + " | ElasWave LSE | E >= R >= T |", "|---" * (len(SHOWN) + 4) + "|"]
    for name, cases in rows.items():
        for row in cases:
            cells = " | ".join(cell(row[p.value]) for p in SHOWN)
            lse = row["elaswave_lse"]
            out.append(
                f"| {name} | {len(row['nodes'])} (nodes {row['nodes'][0]}..{row['nodes'][-1]}) "
                f"| {cells} | {lse:.3f} | {ordering(row)} |"
            )
    return out


def scale_runs(costs: RecoveryCosts) -> list[dict]:
    out = []
    for dp, mtbf in ((78, 100.0), (781, 1000.0)):
        j = SimJob(PRESETS["llama2-7b"], device("h100"), tp=8, pp=16, dp=dp, micro_batch=1,
                   global_batch=dp * 64)  # fmt: skip
        span = baseline(j).step_s * 1000 * 1500
        published = poisson_failures(num_nodes=j.num_nodes, devices_per_node=8,
                                     mtbf_hours=mtbf, duration_ms=span, seed=1,
                                     repair_ms=600_000)  # fmt: skip
        trace = to_slots(published, j.num_nodes)
        started = time.perf_counter()
        timelines = [simulate(j, p, trace.events, steps=1000, costs=costs) for p in SHOWN]
        elapsed = time.perf_counter() - started
        where = f"per-device MTBF {mtbf:g} h, repair 600 s, seed 1"
        doc = summarise(j, timelines, trace, costs=costs, model_name="llama2-7b",
                        description=where)  # fmt: skip
        doc["wall_s_all_policies"] = elapsed
        out.append(doc)
    return out


def misses(rows: dict, which: str) -> list[str]:
    """One line per case whose ordering or ElasWave LSE check fails."""
    out = []
    for name, cases in rows.items():
        for row in cases:
            bad = []
            if row["elaswave_lse"] < 0.89:
                bad.append(f"ElasWave LSE {row['elaswave_lse']:.3f} < 0.89")
            if ordering(row).startswith("**no**"):
                e, r, t = (row[p]["vs_fault_free"] for p in ("elaswave", "recycle", "torchft"))
                bad.append(
                    f"order broken {ordering(row)[7:]}: ElasWave {e:.3f}, ReCycle {r:.3f}, "
                    f"TorchFT {t:.3f}"
                )
            if bad:
                out.append(f"- {name}, {which} {len(row['nodes'])} node(s): " + "; ".join(bad))
    return out


def lse_range(rows: dict, policy: str) -> str:
    """Lowest and highest LSE of ``policy`` over the table's cases."""
    values = [
        row[policy]["vs_fault_free"] / row["device_ratio"]
        for cases in rows.values()
        for row in cases
        if "vs_fault_free" in row[policy]
    ]
    return f"{min(values):.3f} to {max(values):.3f}"


def _brief(doc: dict) -> dict:
    """A scale run without its per-step timeline and change list."""
    keep = {k: doc[k] for k in ("job", "trace", "baseline", "wall_s_all_policies")}
    keep["policies"] = {
        name: {k: v for k, v in p.items() if k not in ("timeline", "changes")}
        for name, p in doc["policies"].items()
    }
    return keep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs"))
    args = parser.parse_args()
    costs = RecoveryCosts()
    jobs = {n: job(n) for n in WORKLOADS}
    first = {n: [shrink(j, list(range(k))) for k in (1, 2, 3)] for n, j in jobs.items()}
    last = {
        n: [shrink(j, list(range(j.num_nodes - k, j.num_nodes))) for k in (1, 2, 3)]
        for n, j in jobs.items()
    }
    stage_major = {"llama2-34b": [shrink(job("llama2-34b", Layout.STAGE_MAJOR), [0])]}
    one = first["llama2-34b"][0]
    ratios = {
        p: one["elaswave"]["vs_fault_free"] / one[p]["vs_fault_free"]
        for p in ("recycle", "torchft")
        if "vs_fault_free" in one[p]
    }
    scale = scale_runs(costs)
    doc = {
        "simulated": True,
        "assumptions": asdict(costs),
        "first_nodes": first,
        "last_nodes": last,
        "stage_major_34b": stage_major,
        "ratios_34b_one_node": ratios,
        "paper_34b_one_node": PAPER_34B,
        "scale": [_brief(d) for d in scale],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sim_paper.json").write_text(json.dumps(doc, indent=1) + "\n")
    render(scale[-1], args.out / "sim_paper_100k.png")

    md = [
        "# Paper-scale evaluation, simulated",
        "",
        "All figures are **simulated**: the runtime's own planners and cost model "
        "(`elaswave.sim`), no device. Command: `.venv/bin/python scripts/sim_paper.py`.",
        "",
        "## 96 devices, steady throughput after losing k nodes (relative to fault-free)",
        "",
        "Replica-major layout; nodes 0..k-1 fail. LSE = ElasWave's throughput ratio over "
        "the device ratio (88/96, 80/96, 72/96).",
        "",
        *table(first),
        "",
        "The same with the last k nodes failing:",
        "",
        *table(last),
        "",
        "Stage-major 34B (node 0 holds replicas 0 and 1 of stage 0), one node lost:",
        "",
        *table(stage_major),
        "",
        f"ReCycle there: {stage_major['llama2-34b'][0]['recycle'].get('oom', 'no OOM')}",
        "",
        "## Acceptance checks (ElasWave >= ReCycle >= TorchFT, ElasWave LSE >= 0.89)",
        "",
        *(misses(first, "first") + misses(last, "last") or ["Every case above passes."]),
        "",
        "How ElasWave gets there. It keeps the global batch by re-splitting every global "
        "micro-batch over a stage's survivors; when they do not divide it (34B's 3-sample "
        "micro-batches over 2 survivors), the shares rotate from one micro-batch to the "
        "next (2+1, then 1+2), which the runtime runs. Step times are simulated replica by "
        "replica (each replica's share of each micro-batch, each route's transfer), the "
        "model that matches emulated runs of rotated plans within 10%: a rotating stage "
        "costs near its mean share (1.5) when its neighbours do not rotate, but two "
        "adjacent rotating stages run near the largest (2): in 1F1B a stage's slot pairs "
        "the forward of micro-batch i + w with the backward of i, and across two adjacent "
        "stages the loop that ties them repeats the same replica's larger share. Losing "
        "several nodes of one replica (34B, 3 nodes: stages 0..5) makes such chains "
        "(ReCycle's model spreads its re-routed micro-batches evenly, as its planner "
        "intends, so it is not charged that loop). The planner prices rotating stages at "
        "the largest share, halfway and the mean, and also regroups the global batch into "
        "micro-batches of another size that no stage rotates on (34B, 3 nodes: 2 samples, "
        "1 + 1, one replica of each full stage idle; 6 samples, 3 + 3 and 2 + 2 + 2, do "
        "not fit in memory without moving layers onto the full stages, which is slower); "
        "rotating shares are also held for blocks of 2, 3, 4 or 8 micro-batches, which "
        "breaks the lockstep between adjacent rotating stages (7B, last node: 32 samples "
        "over 7 on stages 1 and 2, with no multiple of 7 to regroup to; blocks of 3 lift "
        "it from 0.875 to 0.895), kept when the step is more than 1% shorter; "
        "it keeps the plan whose simulated step is shortest. The full policy (the "
        "elaswave column; not its ablations) also prices pipelines of fewer, equally wide "
        "stages over the survivors, partitioned by the graph planner within memory, "
        "and takes one when its step over 100 steps plus the bytes its ranks receive "
        "costs less: 7B, 1-2 nodes (3 stages become 2 of 11 or 10), 13B, 2 nodes (6 "
        "stages become 5 of 4) and 34B, 3 nodes (18 survivors as 6 stages of 3, 0.791, "
        "where 8 stages of 2 or 3 "
        "regrouped to 2-sample micro-batches reached 0.703, below ReCycle's 0.707). The "
        "runtime re-pipelines only when fewer ranks than stages are left, not for speed "
        "alone yet, and the churn timeline keeps the stages while every one has a rank: "
        "nodes come back within minutes there. What none of these "
        "removes: 34B, last 2 nodes: four adjacent stages rotate, "
        "the 6-sample regrouping (2 + 2 + 2 on the first four stages) passes memory there, "
        "and 20 survivors make no shorter pipeline that fits. Layer migration then moves "
        "layers off the resized stages within every "
        "stage's memory. DVFS up-clocks the stages still tied as the slowest (whole layers "
        "are too coarse to balance them) towards the next-slowest, within a power budget "
        "of the job's launch size in ranks at base clock (power cubic in the clock): the "
        "survivors spend what the lost ranks no longer draw, which is why the full policy "
        "can pass linear scaling (LSE > 1) while the fault-free job runs every device at "
        "base clock. The elaswave-migrate column is the same without DVFS: its LSE is "
        f"{lse_range(first, 'elaswave-migrate')} over the first-nodes table.",
        "",
        "## Llama2-34B, one node: ElasWave over the baselines",
        "",
        "| over | simulated | paper |",
        "|---|---|---|",
        *[f"| {p} | {r:.2f}x | {PAPER_34B[p]:.2f}x |" for p, r in ratios.items()],
        "",
        "## 10^4 and 10^5 devices, 1,000 steps, every policy",
        "",
        "| devices | trace | events | wall s (6 policies) | "
        + " | ".join(p.value for p in SHOWN)
        + " |",
        "|---" * (len(SHOWN) + 4) + "|",
    ]
    for d in scale:
        cells = " | ".join(f"{d['policies'][p.value]['vs_fault_free']:.3f}" for p in SHOWN)
        md.append(
            f"| {d['job']['devices']} | {d['trace']['source']} | {d['trace']['events']} | "
            f"{d['wall_s_all_policies']:.1f} | {cells} |"
        )
    md += [
        "",
        "Cells: time-averaged throughput relative to fault-free. Plot of the 10^5 run: "
        "`docs/sim_paper_100k.png`.",
        "",
        "Recovery assumptions (`RecoveryCosts`; seconds unless named): "
        + ", ".join(f"{k} {v:g}" for k, v in asdict(costs).items()),
    ]
    (args.out / "sim_paper.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
