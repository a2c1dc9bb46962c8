"""Migrating one layer's ZeRO optimizer state between stages: contiguous vs interleaved.

    .venv/bin/python scripts/bench_zero_migration.py [--dp 2 4 8] [--repeats 5] [--out docs]

For each DP width D it starts 2 x D real worker processes (forked from a forkserver that
has imported torch; the TCPStore lives in this process): stage S is ranks 0..D-1 and
stage S+1 ranks D..2D-1, each stage holding the fp32 optimizer state (master weight,
exp_avg, exp_avg_sq: 12 bytes per parameter) of four Llama-like blocks, the repository's
tiny model scaled to hidden 512 (ffn 1280, 8 heads: 3,015,680 parameters, 36.2 MB of
state per block). Each stage keeps it in both ZeRO layouts of
:mod:`benchmarks.contiguous`: contiguous (one block of the stage's concatenated
state per rank) and interleaved (shard j of every layer on rank j).

The last layer of stage S then moves to stage S+1 as its first layer, once per layout
per repeat: every rank executes the plan (:func:`benchmarks.migration_exec.
execute_migration`) over pooled gloo pair links, all sends posted before any receive,
and rebuilds its whole local state vector (its block, or its interleaved shard vector)
with the plan's local copies, done while its sends are in flight. The bytes reported are those the
ranks actually handed to their send calls, counted by a wrapper around each link; the
script also checks them against the plan, and every rank's new state element by element
against an oracle built from the new layouts. Time per repeat: from the earliest rank's
start to the latest rank's end after a gloo barrier of all ranks; median over repeats
after one warm-up, the two layouts alternating which goes first. Each repeat also times
the same sends and receives alone ("transfers only": into a preallocated frame, no
local copies, no rebuilt vector). Writes ``<out>/zero_migration_bench.json`` and
``<out>/zero_migration_bench.png`` and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import platform
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
from elaswave.comm.group import Group
from elaswave.comm.links import LinkPool, PairGroup, pair
from elaswave.comm.spec import GroupSpec
from elaswave.comm.store import connect_store, serve_store
from elaswave.fabric.layout import InterleavedLayout
from elaswave.fabric.remap import shard_bounds
from elaswave.logs import configure
from elaswave.model.config import ModelConfig
from elaswave.model.llama import TransformerBlock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the baselines: benchmarks/ beside scripts/, not installed
from benchmarks.contiguous import (  # noqa: E402
    STATE_BYTES_PER_ELEMENT,
    ContiguousLayout,
    MigrationPlan,
    TransferKind,
    ZeroScheme,
    paper_contiguous_numel,
    plan_contiguous_migration,
    plan_interleaved_stage_migration,
    reshard_numel_estimate,
)
from benchmarks.migration_exec import CountingLink, execute_migration  # noqa: E402

MACHINE = "2-core CPU, gloo over loopback, 2 x D processes share 2 cores; measured"
MODEL = ModelConfig(
    hidden_size=512, ffn_hidden_size=1280, num_heads=8, num_kv_heads=8, num_blocks=8, dropout=0.0
)
"""The tiny default model (hidden 64, ffn 160, 4 heads) scaled 8x in width."""
LAYERS_PER_STAGE = 4
TIMEOUT = timedelta(seconds=120)
"""Group creation and waits inside the workers."""
JOB_DEADLINE_S = 240.0
SCHEMES = (ZeroScheme.CONTIGUOUS, ZeroScheme.INTERLEAVED)


def block_numel(cfg: ModelConfig) -> int:
    """Parameters of one transformer block, counted on the meta device (no allocation)."""
    with torch.device("meta"):
        block = TransformerBlock(cfg, 1)
    return sum(p.numel() for p in block.parameters())


def stages(numel: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(layer, elements) of stage S (blocks 1..4) and stage S+1 (blocks 5..8)."""
    first = [(1 + k, numel) for k in range(LAYERS_PER_STAGE)]
    second = [(1 + LAYERS_PER_STAGE + k, numel) for k in range(LAYERS_PER_STAGE)]
    return first, second


def plans(dp: int, numel: int) -> dict[ZeroScheme, MigrationPlan]:
    """Both layouts' plans for moving stage S's last layer to stage S+1."""
    src, dst = stages(numel)
    src_ranks, dst_ranks = list(range(dp)), list(range(dp, 2 * dp))
    moved = src[-1][0]
    return {
        ZeroScheme.CONTIGUOUS: plan_contiguous_migration(
            ContiguousLayout.build(src, dp),
            ContiguousLayout.build(dst, dp),
            moved,
            src_ranks,
            dst_ranks,
        ),
        ZeroScheme.INTERLEAVED: plan_interleaved_stage_migration(
            InterleavedLayout.build(src, dp),
            InterleavedLayout.build(dst, dp),
            moved,
            src_ranks,
            dst_ranks,
        ),
    }


# --------------------------------------------------------------------------- state


def layer_rows(layer: int, lo: int, hi: int) -> torch.Tensor:
    """Elements [lo, hi) of ``layer``'s state as [hi - lo, 3] fp32: (index, layer, index + 0.5),
    exact for indices below 2^23, so any misplaced element is seen."""
    index = torch.arange(lo, hi, dtype=torch.float32)
    return torch.stack([index, torch.full_like(index, float(layer)), index + 0.5], dim=1)


def contiguous_frame(layout: ContiguousLayout, replica: int) -> torch.Tensor:
    """Replica's block of the stage array, built layer by layer (the oracle)."""
    blo, bhi = layout.block_bounds(replica)
    parts = [torch.zeros(0, 3)]
    for entry in layout.layers:
        lo, hi = max(blo, entry.offset), min(bhi, entry.end)
        if lo < hi:
            parts.append(layer_rows(entry.layer, lo - entry.offset, hi - entry.offset))
    return torch.cat(parts)


def interleaved_frame(layout: InterleavedLayout, replica: int) -> torch.Tensor:
    """Replica's interleaved shard vector: shard ``replica`` of every layer, zero-padded."""
    parts = [torch.zeros(0, 3)]
    for shards in layout.layers:
        lo, hi = shard_bounds(shards.numel, layout.dp, replica)
        piece = torch.zeros(shards.shard, 3)
        piece[: hi - lo] = layer_rows(shards.layer, lo, hi)
        parts.append(piece)
    return torch.cat(parts)


# --------------------------------------------------------------------------- worker


def _store_barrier(store: dist.Store, key: str, count: int) -> None:
    if store.add(key, 1) == count:
        store.set(f"{key}/all", "1")
    store.wait([f"{key}/all"], TIMEOUT)


class Rank:
    """One worker's stage, layouts and frames before and after the move, in both schemes."""

    def __init__(self, rank: int, dp: int, numel: int) -> None:
        self.rank = rank
        self.plans = plans(dp, numel)
        src, dst = stages(numel)
        self.src = rank < dp
        replica = rank % dp
        mine = src if self.src else dst
        after = src[:-1] if self.src else [src[-1], *dst]
        self.old = {
            ZeroScheme.CONTIGUOUS: contiguous_frame(ContiguousLayout.build(mine, dp), replica),
            ZeroScheme.INTERLEAVED: interleaved_frame(InterleavedLayout.build(mine, dp), replica),
        }
        self.want = {
            ZeroScheme.CONTIGUOUS: contiguous_frame(ContiguousLayout.build(after, dp), replica),
            ZeroScheme.INTERLEAVED: interleaved_frame(InterleavedLayout.build(after, dp), replica),
        }

    def migrate(self, scheme: ZeroScheme, link: Any, generation: int, step: int) -> torch.Tensor:
        """Move the layer and rebuild this rank's whole local state vector."""
        return execute_migration(
            self.plans[scheme],
            rank=self.rank,
            old=self.old[scheme],
            link=link,
            generation=generation,
            step=step,
        )

    def transfer_only(
        self, scheme: ZeroScheme, link: Any, generation: int, step: int, out: torch.Tensor
    ) -> None:
        """The same sends and receives into a preallocated frame, with no rank-local copying
        and no allocation: the wire part alone."""
        execute_migration(
            dataclasses.replace(self.plans[scheme], local_copies=()),
            rank=self.rank,
            old=self.old[scheme],
            link=link,
            generation=generation,
            step=step,
            out=out,
        )

    def transfer_frame(self, scheme: ZeroScheme) -> torch.Tensor:
        """A receive frame for :meth:`transfer_only`, allocated and touched once."""
        return torch.zeros(self.plans[scheme].new_numel[self.rank], 3)


def worker(rank: int, port: int, dp: int, numel: int, repeats: int, queue: Any) -> None:
    """One rank; leaves with ``os._exit`` (never tears a process group down)."""
    configure()
    torch.set_num_threads(1)
    world = 2 * dp
    try:
        store = connect_store("127.0.0.1", port, timeout_s=TIMEOUT.total_seconds())
        _store_barrier(store, "up", world)
        me = Rank(rank, dp, numel)
        backend = GlooBackend()
        spec = GroupSpec("world", tuple(range(world)))
        world_pg = backend.create(dist.PrefixStore("world", store), rank, world, TIMEOUT)
        everyone = Group(spec, world_pg, rank, TIMEOUT)
        pairs = {p for plan in me.plans.values() for p in plan.pairs() if rank in p}
        pool = LinkPool(store, rank, backend, timeout=TIMEOUT)
        pool.connect(pairs, generation=0)
        links = {
            p: CountingLink(
                PairGroup(GroupSpec(f"zero.{p[0]}-{p[1]}", p), rank, pool, timeout=TIMEOUT)
            )
            for p in pairs
        }

        def link(a: int, b: int) -> CountingLink:
            return links[pair(a, b)]

        samples: dict[str, list[dict]] = {str(scheme): [] for scheme in SCHEMES}
        frames = {scheme: me.transfer_frame(scheme) for scheme in SCHEMES}
        for step in range(repeats + 1):  # step 0 warms the links up, untimed
            # Alternate which layout goes first, so that drift in the machine's load
            # does not favour one of them.
            order = SCHEMES if step % 2 == 0 else SCHEMES[::-1]
            for scheme in order:
                index = SCHEMES.index(scheme)
                for counter in links.values():
                    counter.reset()
                everyone.barrier()
                start = time.time()
                new = me.migrate(scheme, link, 2 * index, step)
                end = time.time()
                if not torch.equal(new, me.want[scheme]):
                    bad = (new != me.want[scheme]).any(dim=1).nonzero()[:5].flatten().tolist()
                    raise AssertionError(
                        f"rank {rank} {scheme}: new state differs from the oracle at rows {bad}"
                    )
                del new
                sent = {peer: n for c in links.values() for peer, n in c.sent_bytes.items()}
                everyone.barrier()
                wire_start = time.time()
                me.transfer_only(scheme, link, 2 * index + 1, step, frames[scheme])
                wire_end = time.time()
                if step:
                    samples[str(scheme)].append(
                        {
                            "start": start,
                            "end": end,
                            "wire_start": wire_start,
                            "wire_end": wire_end,
                            "sent": sent,
                        }
                    )
        report = {"rank": rank, "schemes": samples}
        everyone.barrier()
        queue.put(report)
        _store_barrier(store, "finished", world)  # nobody leaves while a peer still talks to it
    except BaseException:
        queue.put({"rank": rank, "error": traceback.format_exc()})
    finally:
        queue.close()
        queue.join_thread()
        os._exit(0)


# --------------------------------------------------------------------------- parent


def run_job(ctx: Any, dp: int, numel: int, repeats: int) -> list[dict]:
    """Start 2 x dp workers, collect their reports; every process is gone on return."""
    world = 2 * dp
    store = serve_store(timeout_s=TIMEOUT.total_seconds())
    queue = ctx.Queue()
    procs = [
        ctx.Process(
            target=worker,
            args=(rank, store.port, dp, numel, repeats, queue),
            name=f"zero-rank{rank}",
        )
        for rank in range(world)
    ]
    reports: list[dict] = []
    try:
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + JOB_DEADLINE_S
        while len(reports) < world:
            report = queue.get(timeout=max(0.1, deadline - time.monotonic()))
            if "error" in report:
                raise RuntimeError(f"rank {report['rank']} failed:\n{report['error']}")
            reports.append(report)
        for proc in procs:
            proc.join(max(0.1, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(10)
        queue.close()
    return sorted(reports, key=lambda r: r["rank"])


def kind_of(src: int, dst: int, dp: int) -> TransferKind:
    """Which part of the migration a send between two global ranks belongs to."""
    if (src < dp) != (dst < dp):
        return TransferKind.CROSS
    return TransferKind.RESHARD_SRC if src < dp else TransferKind.RESHARD_DST


def summarise(dp: int, numel: int, reports: list[dict]) -> list[dict]:
    """Per scheme: counted bytes by kind (checked against the plan), times, predictions."""
    out = []
    layer_bytes = STATE_BYTES_PER_ELEMENT * numel
    rest = (LAYERS_PER_STAGE - 1) * numel, LAYERS_PER_STAGE * numel
    for scheme, plan in plans(dp, numel).items():
        per_repeat = list(zip(*(r["schemes"][str(scheme)] for r in reports), strict=True))
        seconds = [max(s["end"] for s in row) - min(s["start"] for s in row) for row in per_repeat]
        wire = [
            max(s["wire_end"] for s in row) - min(s["wire_start"] for s in row)
            for row in per_repeat
        ]
        counted = []
        for row in per_repeat:
            by_kind = {str(k): 0 for k in TransferKind}
            for report, sample in zip(reports, row, strict=True):
                for peer, n in sample["sent"].items():
                    by_kind[str(kind_of(report["rank"], peer, dp))] += n
            counted.append(by_kind)
        if any(c != counted[0] for c in counted):
            raise RuntimeError(f"dp {dp} {scheme}: counted bytes differ between repeats {counted}")
        by_kind = counted[0]
        planned = {str(k): plan.bytes(k) for k in TransferKind}
        if by_kind != planned:
            raise RuntimeError(f"dp {dp} {scheme}: counted {by_kind} but the plan sends {planned}")
        moved = sum(by_kind.values())
        if scheme is ZeroScheme.CONTIGUOUS:
            estimate = numel + sum(reshard_numel_estimate(r, numel, dp) for r in rest)
        else:
            estimate = numel
        out.append(
            {
                "layout": str(scheme),
                "dp": dp,
                "ranks": 2 * dp,
                "layer_numel": numel,
                "layer_bytes": layer_bytes,
                "bytes_moved": moved,
                "bytes_by_kind": by_kind,
                "ratio": moved / layer_bytes,
                "paper_ratio": paper_contiguous_numel(numel, dp) / numel
                if scheme is ZeroScheme.CONTIGUOUS
                else 1.0,
                "closed_form_ratio": estimate / numel,
                "transfers": len(plan.transfers),
                "local_copy_numel": sum(c.numel for c in plan.local_copies),
                "median_s": statistics.median(seconds),
                "median_transfer_s": statistics.median(wire),
                "seconds": seconds,
                "transfer_seconds": wire,
            }
        )
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    colors = {"contiguous": "tab:red", "interleaved": "tab:green"}
    dps = sorted({r["dp"] for r in rows})
    for scheme in SCHEMES:
        mine = sorted((r for r in rows if r["layout"] == scheme), key=lambda r: r["dp"])
        xs = [r["dp"] for r in mine]
        color = colors[str(scheme)]
        left.plot(xs, [r["ratio"] for r in mine], "o-", color=color, label=f"{scheme} (counted)")
        right.plot(xs, [r["median_s"] for r in mine], "o-", color=color, label=f"{scheme}")
        right.plot(
            xs,
            [r["median_transfer_s"] for r in mine],
            "s--",
            color=color,
            alpha=0.6,
            label=f"{scheme}, transfers only",
        )
    left.plot(dps, [(d + 1) / 2 for d in dps], "k--", alpha=0.6, label="paper (D+1)/2")
    contiguous = sorted((r for r in rows if r["layout"] == "contiguous"), key=lambda r: r["dp"])
    left.plot(
        [r["dp"] for r in contiguous],
        [r["closed_form_ratio"] for r in contiguous],
        "kx:",
        alpha=0.6,
        label="closed form, both stages reshard",
    )
    left.set_ylabel("bytes moved / |O_i|")
    right.set_ylabel("migration seconds (median, all ranks)")
    for ax in (left, right):
        ax.set_xlabel("D (DP ranks per stage)")
        ax.set_xticks(dps)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    layer_mb = rows[0]["layer_bytes"] / 1e6
    fig.suptitle(
        f"Moving one layer's ZeRO state (|O_i| = {layer_mb:.1f} MB) from stage S to S+1\n"
        + MACHINE,
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _report(rows: list[dict], *, numel: int, repeats: int, started: float) -> dict:
    """What zero_migration_bench.json holds."""
    return {
        "machine": MACHINE,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "model": {
            "hidden_size": MODEL.hidden_size,
            "ffn_hidden_size": MODEL.ffn_hidden_size,
            "num_heads": MODEL.num_heads,
            "block_numel": numel,
            "layers_per_stage": LAYERS_PER_STAGE,
        },
        "setup": "stage S = ranks 0..D-1 holds blocks 1-4, stage S+1 = ranks D..2D-1 holds "
        "blocks 5-8; block 4 moves to stage S+1 as its first layer; fp32 master + exp_avg + "
        "exp_avg_sq, 12 bytes per parameter, stored element-major ([numel, 3])",
        "method": "2 x D worker processes forked from a forkserver with torch imported, "
        "TCPStore in the parent, one torch thread each; transfers over pooled 2-rank gloo "
        "links (elaswave.comm.links), all sends posted before any receive; every rank "
        "rebuilds its whole local state vector and is checked against an oracle; bytes "
        "are counted around the send calls; seconds from the earliest rank's start to the "
        f"latest rank's end after a barrier; median of {repeats} repeats after 1 warm-up, "
        "the layouts alternating which goes first",
        "metrics": {
            "bytes_moved": "bytes handed to send calls, summed over ranks (counters)",
            "ratio": "bytes_moved / |O_i|",
            "paper_ratio": "the paper's (D+1)/2 for contiguous (|O_i| + (D-1)/2 |O_i|), 1 for "
            "interleaved",
            "median_s": "whole migration: transfers plus rebuilding every rank's local vector",
            "median_transfer_s": "the plan's sends and receives alone, into preallocated frames "
            "(no allocation, no rank-local copies)",
            "closed_form_ratio": "1 + sum over both stages of sum_{k=1}^{D-1} min(R/D, k n/D) / n "
            "(R: elements staying in the stage; reshard_numel_estimate)",
        },
        "wall_s": time.monotonic() - started,
        "rows": rows,
    }


def _print_table(rows: list[dict], repeats: int) -> None:
    print()
    print(f"Median over {repeats} repeats; {MACHINE}")
    print(
        "| layout | D | layer bytes |O_i| (MB) | bytes moved (MB, counted) | ratio to |O_i| "
        "| paper (D+1)/2 | closed form | median s | median s, transfers only |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['layout']} | {r['dp']} | {r['layer_bytes'] / 1e6:.1f} | "
            f"{r['bytes_moved'] / 1e6:.1f} | {r['ratio']:.3f} | {r['paper_ratio']:.2f} | "
            f"{r['closed_form_ratio']:.3f} | {r['median_s']:.4f} | {r['median_transfer_s']:.4f} |"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    args = parser.parse_args()
    if any(dp < 1 for dp in args.dp) or args.repeats < 1:
        parser.error("--dp values and --repeats must be at least 1")
    configure()
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "elaswave.comm.links"])
    numel = block_numel(MODEL)

    started = time.monotonic()
    rows: list[dict] = []
    for dp in args.dp:
        print(f"D = {dp}: {2 * dp} processes", flush=True)
        mine = summarise(dp, numel, run_job(ctx, dp, numel, args.repeats))
        for row in mine:
            parts = ", ".join(f"{k} {n / 1e6:.1f}" for k, n in row["bytes_by_kind"].items())
            print(
                f"  {row['layout']:11s} {row['bytes_moved'] / 1e6:8.1f} MB moved ({parts}), "
                f"median {row['median_s'] * 1e3:6.1f} ms (transfers only "
                f"{row['median_transfer_s'] * 1e3:6.1f} ms) over {row['transfers']} transfers",
                flush=True,
            )
        rows += mine

    report = _report(rows, numel=numel, repeats=args.repeats, started=started)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "zero_migration_bench.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(rows, args.out / "zero_migration_bench.png")

    _print_table(rows, args.repeats)
    print(f"wrote {args.out / 'zero_migration_bench.json'} and .png in {report['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
