"""Recovery time of the communicator after a SIGKILL: dynamic edit vs partial vs full rebuild.

    .venv/bin/python scripts/bench_communicator.py [--ranks 8 16 32] [--repeats 3] [--out docs]

For each world size N = dp x pp (pp = 4 by default) it starts N real worker processes
(forked from a forkserver that has imported torch; the TCPStore lives in this process),
builds the groups the training runtime uses for that layout (one DP group per stage, a
pipeline link per activation route, a snapshot link per optimizer shard: the plan's own
``group_specs``), checks them with real collectives, SIGKILLs one worker (stage 1,
replica dp // 2), and lets the survivors carry their groups into the groups of the
recovery plan (micro-batch resizing: new fan-out routes, new snapshot holders) with one
strategy: ElasWave's dynamic edit (``elaswave.comm.dynamic``), or a baseline of
``benchmarks.rebuild``: the partial rebuild, or the full rebuild (``init_process_group``
over the survivors and ``new_group`` for every group, as a torch job initialises at
start-up). Every trial is a fresh job (new processes, new store): an idle gloo process
group costs about 1 ms of CPU per second here (its device loop wakes up), so groups kept
from earlier trials would slow the later ones on 2 cores.

Survivors start the change together, at a wall-clock instant this process announces
after the kill. Figures, per trial, from that instant: ``apply`` = until the slowest
survivor has returned from ``RebuildingCommunicator.apply_by``; ``ready`` = until the
slowest survivor has also run its first collective on its new DP group and one message
each way on each surviving link, i.e. until the groups are in use.
Writes ``<out>/communicator_bench.json`` (every sample, medians) and
``<out>/communicator_bench.png``, and prints a table.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import signal
import statistics
import sys
import time
import traceback
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from elaswave.comm.backend import GlooBackend
from elaswave.comm.dynamic import DynamicCommunicator
from elaswave.comm.group import Group
from elaswave.comm.links import PairGroup
from elaswave.comm.spec import GroupSpec
from elaswave.comm.store import connect_store, serve_store
from elaswave.engine.plan import Plan, initial_plan, snapshot_group_specs
from elaswave.engine.recovery import next_plan
from elaswave.logs import configure

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the baselines: benchmarks/ beside scripts/, not installed
from benchmarks.rebuild import RebuildingCommunicator, RebuildStrategy  # noqa: E402

STRATEGIES = list(RebuildStrategy)
MACHINE = "2-core CPU, gloo, N processes share 2 cores"
TIMEOUT = timedelta(seconds=60)
"""Group creation and collective waits inside the workers."""
TRIAL_DEADLINE_S = 60.0
START_DELAY_S = 0.3


def job_plan(dp: int, pp: int) -> Plan:
    """The runtime's static plan: rank = stage * dp + replica, micro-batches of 2."""
    return initial_plan(num_layers=pp, dp=dp, pp=pp, global_batch=2 * dp, micro_batch=2)


def groups_of(plan: Plan) -> list[GroupSpec]:
    """Every group the runtime builds for ``plan`` (one rank per node)."""
    return plan.group_specs() + snapshot_group_specs(plan, 1)


def victim_of(dp: int, pp: int) -> int:
    stage = 1 if pp > 2 else pp - 1
    return stage * dp + dp // 2


# --------------------------------------------------------------------------- worker


def _exchange(dyn: DynamicCommunicator, rank: int, tag: int) -> None:
    """One message each way on every link group (all sends posted before any receive)."""
    links = [dyn[n] for n in dyn.names if not n.startswith("dp.")]
    sends, recvs = [], []
    for link in links:
        assert isinstance(link, Group | PairGroup)
        peer = next(r for r in link.spec.ranks if r != rank)
        sends.append((link, link.isend(torch.full((2,), float(rank)), peer, tag)))
        recvs.append((link, peer, torch.empty(2)))
    for link, peer, buf in recvs:
        link.recv(buf, peer, tag)
        if buf.tolist() != [float(peer)] * 2:
            raise AssertionError(f"rank {rank}: link {link.name} delivered {buf.tolist()}")
    for link, work in sends:
        link.wait_send(work)


def _check_dp(dyn: DynamicCommunicator, rank: int) -> None:
    name = next(n for n in dyn.names if n.startswith("dp."))
    group = dyn[name]
    ones = torch.ones(4)
    group.all_reduce(ones)
    if ones.tolist() != [float(group.size)] * 4:
        raise AssertionError(f"rank {rank}: all_reduce on {name} gave {ones.tolist()}")


def _barrier(store: dist.Store, key: str, count: int) -> None:
    if store.add(key, 1) == count:
        store.set(f"{key}/all", "1")
    store.wait([f"{key}/all"], TIMEOUT)


def worker(rank: int, port: int, world: int, dp: int, pp: int, trial: dict, queue: Any) -> None:
    """One rank of one trial's job; leaves with ``os._exit`` (never tears groups down)."""
    configure()
    try:
        store = connect_store("127.0.0.1", port, timeout_s=TIMEOUT.total_seconds())
        _barrier(store, "up", world)
        dyn = RebuildingCommunicator(store, rank, GlooBackend(), timeout=TIMEOUT)
        plan = job_plan(dp, pp)
        dyn.build(groups_of(plan))
        _check_dp(dyn, rank)
        _exchange(dyn, rank, tag=1)
        store.add("ready", 1)
        store.wait(["go"], TIMEOUT)
        start_at = float(store.get("go"))
        time.sleep(max(0.0, start_at - time.time()))
        late = time.time() - start_at
        removed = {trial["victim"]}
        new_plan, _ = next_plan(plan, removed)
        strategy = RebuildStrategy(trial["strategy"])
        stats = dyn.apply_by(strategy, groups_of(new_plan), removed=removed)
        applied = time.time()
        _check_dp(dyn, rank)
        _exchange(dyn, rank, tag=2)
        ready = time.time()
        queue.put(
            {
                "rank": rank,
                "apply_s": applied - start_at,
                "ready_s": ready - start_at,
                "own_apply_s": stats.seconds,
                "late_s": late,
                "stats": stats.to_dict(),
            }
        )
        _barrier(store, "finished", world - 1)  # nobody leaves while a peer still talks to it
    except BaseException:
        queue.put({"rank": rank, "error": traceback.format_exc()})
    finally:
        queue.close()
        queue.join_thread()
        os._exit(0)


# --------------------------------------------------------------------------- parent


def _wait_count(store: dist.Store, key: str, count: int, deadline: float, procs: list) -> None:
    while store.add(key, 0) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{key}: {store.add(key, 0)} of {count} workers after deadline")
        dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0, -signal.SIGKILL)]
        if dead:
            raise RuntimeError(f"workers {dead} exited")
        time.sleep(0.005)


def run_trial(ctx: Any, world: int, dp: int, pp: int, trial: dict) -> dict:
    """A fresh job: start ``world`` workers, SIGKILL the victim once all are built, let the
    survivors recover, collect their reports. Every process is gone when it returns."""
    store = serve_store(timeout_s=TIMEOUT.total_seconds())
    queue = ctx.Queue()
    procs = [
        ctx.Process(
            target=worker,
            args=(rank, store.port, world, dp, pp, trial, queue),
            name=f"bench-rank{rank}",
        )
        for rank in range(world)
    ]
    try:
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + TRIAL_DEADLINE_S
        _wait_count(store, "ready", world, deadline, procs)
        victim = procs[trial["victim"]]
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(10)
        # Survivors start together at a wall-clock instant, so that the slowest
        # survivor's time is the recovery time, not the skew of waking them all up.
        store.set("go", repr(time.time() + START_DELAY_S))
        rows = []
        while len(rows) < world - 1:
            row = queue.get(timeout=max(0.1, deadline - time.monotonic()))
            if "error" in row:
                raise RuntimeError(f"rank {row['rank']} failed:\n{row['error']}")
            rows.append(row)
        for proc in procs:
            proc.join(max(0.1, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(10)
        queue.close()
    return _sample(trial, rows)


def run_world(ctx: Any, world: int, dp: int, pp: int, repeats: int) -> list[dict]:
    victim = victim_of(dp, pp)
    samples = []
    for repeat in range(repeats):
        for strategy in STRATEGIES:
            trial = {"strategy": str(strategy), "repeat": repeat, "victim": victim}
            s = run_trial(ctx, world, dp, pp, trial)
            samples.append(s)
            print(
                f"  N={world:2d} {strategy:7s} repeat {repeat}: "
                f"apply {s['apply_s'] * 1e3:8.2f} ms, ready {s['ready_s'] * 1e3:8.2f} ms "
                f"(longest own apply {s['max_own_apply_s'] * 1e3:.2f} ms, "
                f"last start {s['max_late_s'] * 1e3:.2f} ms late)",
                flush=True,
            )
    return samples


def _sample(trial: dict, rows: list[dict]) -> dict:
    rows.sort(key=lambda r: r["rank"])
    stats = [r["stats"] for r in rows]
    return {
        **trial,
        "apply_s": max(r["apply_s"] for r in rows),
        "ready_s": max(r["ready_s"] for r in rows),
        "max_own_apply_s": max(r["own_apply_s"] for r in rows),
        "max_late_s": max(r["late_s"] for r in rows),
        "connections_created": sum(s["links_created"] for s in stats) // 2,
        "connections_reused": sum(s["links_reused"] for s in stats) // 2,
        "groups_created": sum(s["groups_created"] for s in stats),
        "per_rank": {
            r["rank"]: {
                "apply_s": r["apply_s"],
                "ready_s": r["ready_s"],
                "own_apply_s": r["own_apply_s"],
                "late_s": r["late_s"],
                "links_created": r["stats"]["links_created"],
                "links_reused": r["stats"]["links_reused"],
                "groups_created": r["stats"]["groups_created"],
                "groups_reused": r["stats"]["groups_reused"],
            }
            for r in rows
        },
    }


def summarise(world: int, dp: int, pp: int, samples: list[dict]) -> list[dict]:
    out = []
    for strategy in STRATEGIES:
        mine = [s for s in samples if s["strategy"] == strategy]
        out.append(
            {
                "ranks": world,
                "dp": dp,
                "pp": pp,
                "strategy": str(strategy),
                "victim": mine[0]["victim"],
                "median_apply_s": statistics.median(s["apply_s"] for s in mine),
                "median_ready_s": statistics.median(s["ready_s"] for s in mine),
                "connections_created": mine[0]["connections_created"],
                "groups_created": mine[0]["groups_created"],
                "repeats": len(mine),
            }
        )
    return out


def plot(medians: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    colors = {"edit": "tab:green", "partial": "tab:blue", "full": "tab:gray"}
    labels = {"edit": "dynamic edit", "partial": "partial rebuild", "full": "full rebuild"}
    for strategy in STRATEGIES:
        rows = sorted((m for m in medians if m["strategy"] == strategy), key=lambda m: m["ranks"])
        xs = [m["ranks"] for m in rows]
        color = colors[str(strategy)]
        ax.plot(xs, [m["median_apply_s"] for m in rows], "o-", color=color, label=labels[strategy])
        ax.plot(xs, [m["median_ready_s"] for m in rows], "s--", color=color, alpha=0.6)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sorted({m["ranks"] for m in medians}))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("ranks (processes)")
    ax.set_ylabel("recovery seconds (median, slowest survivor)")
    ax.set_title("Communicator recovery after one SIGKILL\n" + MACHINE, fontsize=10)
    ax.plot([], [], "k-", label="apply")
    ax.plot([], [], "k--", alpha=0.6, label="apply + first collective")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _report(pp: int, medians: list[dict], samples: list[dict], *, started: float) -> dict:
    """What communicator_bench.json holds."""
    return {
        "machine": MACHINE,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "layout": f"rank = stage * dp + replica, pp = {pp}; the runtime's groups: "
        "dp.s{stage} (rings over links under edit), link.{src}-{dst} per activation route, "
        "snap.{owner}-{holder} per optimizer shard; after the kill, those of the recovery "
        "plan (micro-batch resizing)",
        "strategies": {
            "edit": "reuse every untouched group; re-form the DP ring over its links, "
            "connecting only the failed rank's two neighbours; create the new routes' links",
            "partial": "create every group whose members changed from scratch "
            "(a full gloo group); reuse the others",
            "full": "tear everything down; init_process_group over the survivors, then "
            "new_group for every group of the job, every rank in every call "
            "(as Megatron's initialize_model_parallel)",
        },
        "victim": "SIGKILL of stage 1, replica dp // 2, while every worker is idle",
        "method": "every trial is a fresh job (new processes forked from a forkserver with "
        "torch imported, new TCPStore in the parent); survivors start apply() together at "
        f"a wall-clock instant {START_DELAY_S} s after the kill; median over the repeats",
        "metrics": {
            "apply_s": "seconds from the common start instant until the slowest survivor "
            "returned from DynamicCommunicator.apply",
            "ready_s": "the same, until the slowest survivor also finished its first "
            "all_reduce on its new DP group and one message each way on each surviving link",
            "max_own_apply_s": "longest apply() as timed by the survivor itself",
            "max_late_s": "how late the last survivor woke after the start instant",
            "connections_created": "new pairwise connections over all survivors "
            "(a 2-rank link is 1, a new n-rank gloo group n(n-1)/2)",
            "connections_reused": "pairwise connections the survivors kept using",
            "groups_created": "group objects created, summed over survivors (a new ring or "
            "gloo group of n survivors counts n)",
        },
        "wall_s": time.monotonic() - started,
        "medians": medians,
        "samples": samples,
    }


def _print_table(medians: list[dict], repeats: int) -> None:
    print()
    print(f"Median over {repeats} repeats; {MACHINE}")
    print("| ranks | dp x pp | strategy | apply (ms) | apply + first collective (ms) | new conns |")
    print("|---|---|---|---|---|---|")
    for m in medians:
        print(
            f"| {m['ranks']} | {m['dp']} x {m['pp']} | {m['strategy']} | "
            f"{m['median_apply_s'] * 1e3:.2f} | {m['median_ready_s'] * 1e3:.2f} | "
            f"{m['connections_created']} |"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    args = parser.parse_args()
    for world in args.ranks:
        if world % args.pp or world // args.pp < 2:
            parser.error(f"--ranks {world}: needs a multiple of pp = {args.pp} with dp >= 2")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    configure()
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "benchmarks.rebuild"])

    started = time.monotonic()
    samples, medians = [], []
    for world in args.ranks:
        dp = world // args.pp
        print(f"N = {world} (dp {dp} x pp {args.pp}), victim rank {victim_of(dp, args.pp)}")
        mine = run_world(ctx, world, dp, args.pp, args.repeats)
        samples += [{"ranks": world, "dp": dp, "pp": args.pp, **s} for s in mine]
        medians += summarise(world, dp, args.pp, mine)

    report = _report(args.pp, medians, samples, started=started)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "communicator_bench.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(medians, args.out / "communicator_bench.png")

    _print_table(medians, args.repeats)
    print(
        f"wrote {args.out / 'communicator_bench.json'} and communicator_bench.png "
        f"in {report['wall_s']:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
