"""Steady-state throughput of ElasWave against torch's own engines, from interleaved pairs.

    .venv/bin/python scripts/bench_steady_state.py [--pairs 5] [--steps 20] [--out docs]

The comparisons, on the 6.6M-parameter model of the issue (hidden 256, 8 blocks, sequence
128, vocabulary 512, SwiGLU 688, dropout 0; global batch 32, micro-batch 4):

* ``elaswave train --dp 2 --pp 1`` against torch DDP (gloo, 2 processes, gradient
  accumulation over the micro-batches under ``no_sync``);
* ``elaswave train --dp 1 --pp 2`` against ``torch.distributed.pipelining``
  (``PipelineStage`` + ``Schedule1F1B``, 2 processes), the layers split as ElasWave's
  initial plan splits them;
* ``--layouts pp2zb``: the same pipeline, ``elaswave train --schedule zb-h1`` against
  torch's ``ScheduleInterleavedZeroBubble`` at one stage per rank.

The baselines train the same layers (``pipeline_model(cfg).build_layer(i, seed=0)``: the
same initial parameters as ElasWave's seed 0), on the same samples (ElasWave's
``SampleLoader``: step s reads global sample ids [32 s, 32 s + 32)), with the loss
``per_sample_loss(...).sum() / global_batch`` and ``torch.optim.AdamW`` with ElasWave's
``OptimizerConfig`` (lr, betas, eps, weight decay on matrices only, linear warm-up), so
the losses should agree to float reduction order. Each pair runs ElasWave with snapshots,
ElasWave with ``--no-snapshots`` and the baseline, the order rotating from pair to pair
so that drift of the shared machine hits every side alike. A run's samples/s is the
global batch over its median step time, after the first 3 steps (ElasWave: the
summary's ``step_time_s``; baselines: rank 0's wall time per step, no extra barrier).
Writes DIR/steady_state.{md,json}.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from elaswave.data.corpus import DataConfig, SampleLoader, open_source
from elaswave.data.sampler import GlobalBatchSampler
from elaswave.fabric.adamw import OptimizerConfig
from elaswave.model.config import ModelConfig
from elaswave.model.llama import StepContext, per_sample_loss
from elaswave.model.protocol import pipeline_model
from elaswave.model.rng import make_rng
from elaswave.runtime.job.config import JobConfig
from elaswave.runtime.job.results import read_summary
from elaswave.runtime.job.sections import LayoutConfig, ScheduleConfig

ROOT = Path(__file__).resolve().parents[1]
SKIP_STEPS = 3
GLOBAL_BATCH = 32
MICRO_BATCH = 4
SEED = 0
MODEL = ModelConfig(
    vocab_size=512,
    hidden_size=256,
    num_blocks=8,
    num_heads=4,
    num_kv_heads=4,
    ffn_hidden_size=688,
    seq_len=128,
    dropout=0.0,
)
MODEL_TOML = "[model]\n" + "".join(  # the fields MODEL sets, for elaswave train --config
    f"{name} = {getattr(MODEL, name)!r}\n"
    for name in ModelConfig.field_names()
    if getattr(MODEL, name) != getattr(ModelConfig(), name)
)
LAYOUTS = {"dp2": (2, 1), "dp4": (4, 1), "pp2": (1, 2), "pp2zb": (1, 2)}
BASELINE_NAME = {
    "dp2": "DDP",
    "dp4": "DDP",
    "pp2": "pipelining 1F1B",
    "pp2zb": "pipelining zero bubble",
}
ZERO_BUBBLE = {"pp2zb"}
"""Layouts where ElasWave runs ``--schedule zb-h1`` and the baseline torch's
``ScheduleInterleavedZeroBubble`` at one stage per rank (the closest torch zero-bubble
schedule to ZB-H1: ``ScheduleZBVZeroBubble`` needs two stages per rank)."""


def job_config(dp: int, pp: int, steps: int) -> JobConfig:
    return JobConfig(
        model=MODEL,
        layout=LayoutConfig(dp=dp, pp=pp),
        schedule=ScheduleConfig(
            steps=steps, global_batch=GLOBAL_BATCH, micro_batch=MICRO_BATCH, seed=SEED
        ),
    )


def stage_split(dp: int, pp: int) -> list[tuple[int, int]]:
    """[start, stop) of each stage's layers in ElasWave's initial plan."""
    plan = job_config(dp, pp, 1).plan()
    return [(s.layer_start, s.layer_stop) for s in plan.stages]


def steady_throughput(step_times: list[float]) -> float:
    return GLOBAL_BATCH / statistics.median(step_times[SKIP_STEPS:])


# ---------------------------------------------------------------- ElasWave


def run_elaswave(
    work: Path,
    config: Path,
    dp: int,
    pp: int,
    steps: int,
    snapshots: bool,
    copies: int = 1,
    zero_bubble: bool = False,
) -> dict[str, Any]:
    out = work / f"elaswave-{dp}x{pp}-{'on' if snapshots else 'off'}"
    cmd = [
        sys.executable,
        "-m",
        "elaswave.cli.main",
        "train",
        "--config",
        str(config),
        "--dp",
        str(dp),
        "--pp",
        str(pp),
        "--steps",
        str(steps),
        "--global-batch",
        str(GLOBAL_BATCH),
        "--micro-batch",
        str(MICRO_BATCH),
        "--seed",
        str(SEED),
        "--out",
        str(out),
        "--overwrite",
    ]
    cmd += ["--schedule", "zb-h1" if zero_bubble else "1f1b"]  # as its baseline runs
    if not snapshots:
        cmd.append("--no-snapshots")
    elif copies > 1:
        cmd += ["--snapshot-copies", str(copies)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    summary = read_summary(out)
    times = list(summary.step_time_s)
    return {
        "samples_per_s": steady_throughput(times),
        "step_time_s": times,
        "loss": list(summary.loss),
    }


# ---------------------------------------------------------------- baselines


class Stack(nn.Module):
    """Layers [start, stop) of the model, each called as ``layer(x, ctx)``."""

    def __init__(self, start: int, stop: int) -> None:
        super().__init__()
        model = pipeline_model(MODEL)
        self.layers = nn.ModuleList(model.build_layer(i, seed=SEED) for i in range(start, stop))
        self.ctx = StepContext(step=0, sample_ids=(), rng=make_rng("counter", seed=SEED, rank=0))

    def forward(self, x: torch.Tensor, ctx: StepContext | None = None) -> torch.Tensor:
        ctx = ctx or self.ctx  # dropout 0: the context's ids and rng draw nothing
        for layer in self.layers:
            x = layer(x, ctx)
        return x


def make_optimizer(
    module: nn.Module,
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW with ElasWave's defaults: decay on matrices, not on norm gains; warm-up."""
    cfg = OptimizerConfig()
    decay = [p for p in module.parameters() if p.dim() >= 2]
    no_decay = [p for p in module.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: cfg.lr_at(step) / cfg.lr)
    return opt, sched


def _loader() -> SampleLoader:
    data = DataConfig()
    source = open_source(data, vocab_size=MODEL.vocab_size, seq_len=MODEL.seq_len)
    return SampleLoader(source, seed=data.seed)


def _init(rank: int, store_path: str, world: int = 2) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)


def _leave() -> None:
    """Exit once both ranks have written their results, without tearing the process
    group down: gloo's teardown under DDP's reducer sometimes aborts the process
    ("terminate called without an active exception"), which loses a measured run."""
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def ddp_worker(rank: int, store_path: str, steps: int, result: str, world: int = 2) -> None:
    _init(rank, store_path, world)
    model = nn.parallel.DistributedDataParallel(Stack(0, MODEL.num_layers))
    opt, sched = make_optimizer(model)
    loader = _loader()
    num_micro = GLOBAL_BATCH // (world * MICRO_BATCH)
    sampler = GlobalBatchSampler(GLOBAL_BATCH, num_micro)
    rng = make_rng("counter", seed=SEED, rank=rank)
    times, losses = [], []
    for step in range(steps):
        start = time.perf_counter()
        slots = sampler.slots(step, [MICRO_BATCH] * world)[rank]
        total = torch.zeros(())
        for mb, slot in enumerate(slots):
            ids = tuple(slot.sample_ids)
            x, y = loader.batch(ids)
            ctx = StepContext(step=step, sample_ids=ids, rng=rng)
            sync = model.no_sync() if mb < len(slots) - 1 else contextlib.nullcontext()
            with sync:
                per_sample = per_sample_loss(model(x, ctx), y)
                # DDP averages over its replicas; x world makes it the global batch's sum.
                (per_sample.sum() * world / GLOBAL_BATCH).backward()
            total += per_sample.detach().sum()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(total)  # the logged loss, as ElasWave reports it
        losses.append(total.item() / GLOBAL_BATCH)
        times.append(time.perf_counter() - start)
    if rank == 0:
        Path(result).write_text(json.dumps({"step_time_s": times, "loss": losses}))
    _leave()


def pipe_worker(
    rank: int,
    store_path: str,
    steps: int,
    result: str,
    split: list[tuple[int, int]],
    zero_bubble: bool = False,
) -> None:
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleInterleavedZeroBubble,
    )

    _init(rank, store_path)
    start_layer, stop_layer = split[rank]
    module = Stack(start_layer, stop_layer)
    stage = PipelineStage(module, rank, 2, torch.device("cpu"))
    num_micro = GLOBAL_BATCH // MICRO_BATCH

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return per_sample_loss(logits, targets).sum() / GLOBAL_BATCH

    schedule: Any = (
        ScheduleInterleavedZeroBubble([stage], num_micro, loss_fn=loss_fn, scale_grads=False)
        if zero_bubble
        else Schedule1F1B(stage, num_micro, loss_fn=loss_fn, scale_grads=False)
    )
    opt, sched = make_optimizer(module)
    loader = _loader()
    sampler = GlobalBatchSampler(GLOBAL_BATCH, num_micro)
    times, losses = [], []
    for step in range(steps):
        start = time.perf_counter()
        x, y = loader.batch(tuple(sampler.step_ids(step)))
        if rank == 0:
            schedule.step(x)
        else:
            mb_losses: list[torch.Tensor] = []
            schedule.step(target=y, losses=mb_losses)
            losses.append(float(sum(t.item() for t in mb_losses)))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    Path(f"{result}.{rank}").write_text(json.dumps({"step_time_s": times, "loss": losses}))
    _leave()


def run_baseline(work: Path, kind: str, steps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        store = str(Path(tmp) / "store")
        result = str(Path(tmp) / "result.json")
        os.environ["OMP_NUM_THREADS"] = "1"
        if kind in ("dp2", "dp4"):
            world = LAYOUTS[kind][0]
            mp.start_processes(
                ddp_worker, args=(store, steps, result, world), nprocs=world, start_method="spawn"
            )
            raw = json.loads(Path(result).read_text())
            times, loss = raw["step_time_s"], raw["loss"]
        else:
            split = stage_split(1, 2)
            mp.start_processes(
                pipe_worker,
                args=(store, steps, result, split, kind in ZERO_BUBBLE),
                nprocs=2,
                start_method="spawn",
            )
            times = json.loads(Path(f"{result}.0").read_text())["step_time_s"]
            loss = json.loads(Path(f"{result}.1").read_text())["loss"]
    return {"samples_per_s": steady_throughput(times), "step_time_s": times, "loss": loss}


# ---------------------------------------------------------------- report


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(pairs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    on = [p["elaswave_on"]["samples_per_s"] for p in pairs]
    off = [p["elaswave_off"]["samples_per_s"] for p in pairs]
    base = [p["baseline"]["samples_per_s"] for p in pairs]
    return {
        "elaswave_on_samples_per_s": spread(on),
        "elaswave_off_samples_per_s": spread(off),
        "baseline_samples_per_s": spread(base),
        "ratio_on": spread([a / b for a, b in zip(on, base, strict=True)]),
        "ratio_off": spread([a / b for a, b in zip(off, base, strict=True)]),
        "snapshot_overhead": spread([1 - a / b for a, b in zip(on, off, strict=True)]),
        "max_loss_rel_diff": spread([p["max_loss_rel_diff"] for p in pairs]),
    }


def fmt(s: dict[str, float], pct: bool = False) -> str:
    if pct:
        return f"{s['median']:+.1%} ({s['min']:+.1%} .. {s['max']:+.1%})"
    return f"{s['median']:.3f} ({s['min']:.3f} .. {s['max']:.3f})"


def write_markdown(path: Path, report: dict[str, Any], argv: str) -> None:
    params = report["model"]["params"]
    lines = [
        "# Steady-state throughput against torch's engines",
        "",
        f"    {argv}",
        "",
        f"Model: ElasWave's built-in decoder, {params / 1e6:.2f}M parameters "
        f"(hidden 256, 8 blocks, 4 heads, SwiGLU 688, vocabulary 512, sequence 128, "
        f"dropout 0); global batch {GLOBAL_BATCH}, micro-batch {MICRO_BATCH}; "
        f"{report['steps']} steps per run, samples/s from the median step time after "
        f"step {SKIP_STEPS}; {report['pairs']} interleaved triples per layout "
        "(ElasWave with snapshots, without, baseline; the order rotates).",
        "",
        "Baselines: torch DDP (gloo, `no_sync` accumulation over 4 micro-batches per "
        "replica) for dp2; `torch.distributed.pipelining` `Schedule1F1B` over 8 "
        f"micro-batches for pp2, split as ElasWave's initial plan ({report['pp2_split']}). "
        "Same layers, same initial parameters (seed 0), same samples, AdamW with "
        "ElasWave's lr, betas, eps, weight decay (matrices only) and warm-up; 1 thread per "
        "process, as ElasWave's workers run.",
        "",
        "| layout | ElasWave/baseline, snapshots on | ElasWave/baseline, snapshots off "
        "| snapshot overhead | ElasWave on samples/s | ElasWave off samples/s "
        "| baseline samples/s | max loss rel. diff vs baseline |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, s in report["summary"].items():
        lines.append(
            f"| {name} vs {BASELINE_NAME[name]} | {fmt(s['ratio_on'])} | {fmt(s['ratio_off'])} "
            f"| {fmt(s['snapshot_overhead'], pct=True)} "
            f"| {fmt(s['elaswave_on_samples_per_s'])} | {fmt(s['elaswave_off_samples_per_s'])} "
            f"| {fmt(s['baseline_samples_per_s'])} "
            f"| {s['max_loss_rel_diff']['max']:.1e} |"
        )
    lines += [
        "",
        "Cells: median (min .. max) over pairs. Snapshot overhead = 1 - (samples/s on) / "
        "(samples/s off), per pair. Loss diff: the largest relative difference of any "
        "step's loss between ElasWave (snapshots on) and the baseline in the same pair.",
        "",
        "Host caveat: 2 CPU cores shared by both workers (and, for ElasWave, its Core, bus "
        "and snapshot threads); timings can vary 20-40 % between identical runs (the "
        "ranges above show this run's spread), so only medians of interleaved pairs mean "
        "anything. Raw per-pair numbers: "
        "`steady_state.json`.",
        "",
        "Where a snapshot's cost goes on this host, and what keeps it small: each step "
        "the owner sends its reduced gradient shard to the holder (a TCP copy on each "
        "side) and the holder applies one AdamW pass to its copy of the owner's shard. "
        "The holder keeps one state and the gradients since, applied in place once the "
        "version before them is no longer needed (no copy of the state per step; "
        "`elaswave/fabric/snapshot.py`); the weight decay runs inside the fused AdamW "
        "kernel; and the holder's updates, like the owner's copy of its committed shard "
        "for the next out-of-place update, run in pieces of 0.1-0.2 ms while the "
        "training thread waits for communication past a millisecond (the tail of the "
        "reduce-scatter, the all-gather, a pipeline bubble), where it would otherwise "
        "sleep, instead of on a thread that takes its CPU time from the step "
        "(`elaswave/comm/idle.py`).",
        "",
    ]
    path.write_text("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    parser.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=["dp2", "pp2"])
    parser.add_argument(
        "--snapshot-copies",
        dest="copies",
        type=int,
        default=1,
        help="copies of every snapshot on the snapshots-on side (dp2 has one other rank "
        "only: use dp4 for two)",
    )
    args = parser.parse_args()
    if args.steps <= SKIP_STEPS + 1:
        raise SystemExit(f"--steps must exceed {SKIP_STEPS + 1}")
    args.out.mkdir(parents=True, exist_ok=True)
    params = sum(
        p.numel()
        for i in range(MODEL.num_layers)
        for p in pipeline_model(MODEL).build_layer(i, seed=SEED).parameters()
    )
    report: dict[str, Any] = {
        "model": {**dataclasses.asdict(MODEL), "params": params},
        "global_batch": GLOBAL_BATCH,
        "micro_batch": MICRO_BATCH,
        "steps": args.steps,
        "skip_steps": SKIP_STEPS,
        "pairs": args.pairs,
        "pp2_split": stage_split(1, 2),
        "snapshot_copies": args.copies,
        "host_cpus": os.cpu_count(),
        "torch": torch.__version__,
        "runs": {},
        "summary": {},
    }
    with tempfile.TemporaryDirectory(prefix="steady-") as tmp:
        work = Path(tmp)
        config = work / "model.toml"
        config.write_text(MODEL_TOML)
        for name in args.layouts:
            dp, pp = LAYOUTS[name]
            pairs = []
            for index in range(args.pairs):
                order = ["on", "off", "baseline"]
                order = order[index % 3 :] + order[: index % 3]
                pair: dict[str, Any] = {"order": order}
                for side in order:
                    if side == "baseline":
                        pair["baseline"] = run_baseline(work, name, args.steps)
                    else:
                        pair[f"elaswave_{side}"] = run_elaswave(
                            work, config, dp, pp, args.steps, snapshots=side == "on",
                            copies=args.copies, zero_bubble=name in ZERO_BUBBLE,
                        )  # fmt: skip
                ref, mine = pair["baseline"]["loss"], pair["elaswave_on"]["loss"]
                pair["max_loss_rel_diff"] = max(
                    abs(a - b) / abs(b) for a, b in zip(mine, ref, strict=True)
                )
                pairs.append(pair)
                print(
                    f"{name} pair {index}: on {pair['elaswave_on']['samples_per_s']:.2f} "
                    f"off {pair['elaswave_off']['samples_per_s']:.2f} "
                    f"{BASELINE_NAME[name]} {pair['baseline']['samples_per_s']:.2f} samples/s; "
                    f"loss diff {pair['max_loss_rel_diff']:.1e}",
                    flush=True,
                )
            report["runs"][name] = pairs
            report["summary"][name] = summarise(pairs)
    (args.out / "steady_state.json").write_text(json.dumps(report, indent=1) + "\n")
    argv = " ".join([".venv/bin/python scripts/bench_steady_state.py", *sys.argv[1:]])
    write_markdown(args.out / "steady_state.md", report, argv)
    print(f"wrote {args.out / 'steady_state.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
