"""A worker process: one (stage, replica) of the hybrid-parallel job.

Started by the launcher as ``python -m elaswave.runtime.worker --run-dir D --rank R``. The
training loop runs on the main thread; the bus runs in a :class:`Session` event-loop
thread beside it, so publishing an event never blocks a step.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import structlog
import torch
from torch import nn

from elaswave import logs
from elaswave.bus.schema import StepCompleted, Topic, WorkerFinished, WorkerStarted
from elaswave.comm.backend import backend_for
from elaswave.comm.communicator import Communicator
from elaswave.comm.store import connect_store
from elaswave.data.corpus import SampleLoader, open_source
from elaswave.engine.plan import (
    Plan,
    dp_group_name,
    snapshot_group_specs,
    snapshot_placements,
)
from elaswave.fabric.snapshot import (
    SnapshotKeeper,
    SnapshotSender,
    snapshot_link_name,
    state_digest,
)
from elaswave.fabric.zero import ZeroAdamW
from elaswave.model.llama import build_layer
from elaswave.model.rng import CounterRng
from elaswave.runtime.config import JobConfig, JobSpec
from elaswave.runtime.pipeline import StageRunner
from elaswave.runtime.session import Session

log = structlog.get_logger(__name__)


def worker_result_path(run_dir: Path, rank: int) -> Path:
    return run_dir / "workers" / f"rank{rank}.json"


def stage_params_path(run_dir: Path, stage: int) -> Path:
    return run_dir / "params" / f"stage{stage}.pt"


def run_worker(run_dir: Path, rank: int) -> None:
    spec = JobSpec.read(run_dir)
    cfg, ep = spec.config, spec.endpoints
    torch.set_num_threads(1)
    plan = cfg.plan()
    stage, replica = plan.locate(rank)
    structlog.contextvars.bind_contextvars(rank=rank, stage=stage, replica=replica)

    # Workers act on control and recovery events only; metrics are for the Core and users.
    session = Session(
        f"rank{rank}", ep.bus_publish, ep.bus_subscribe, topics=[Topic.CONTROL, Topic.RECOVERY]
    )
    session.start()
    try:
        _train(run_dir, rank, spec, session)
    except BaseException as exc:
        session.publish(
            WorkerFinished(
                sender=f"rank{rank}", rank=rank, ok=False, reason=f"{type(exc).__name__}: {exc}"
            )
        )
        raise
    finally:
        session.close()


def _train(run_dir: Path, rank: int, spec: JobSpec, session: Session) -> None:
    cfg, ep = spec.config, spec.endpoints
    plan = cfg.plan()
    stage, replica = plan.locate(rank)
    sender = f"rank{rank}"
    backend = backend_for(cfg.train.device)
    device = backend.device_for(rank)
    store = connect_store(ep.store_host, ep.store_port, timeout_s=cfg.train.comm_timeout_s)
    comm = Communicator(store, rank, backend, timeout=timedelta(seconds=cfg.train.comm_timeout_s))
    rpn = cfg.train.ranks_per_node
    snapshot_specs = snapshot_group_specs(plan, rpn) if cfg.train.snapshots else []
    comm.build(plan.group_specs() + snapshot_specs)
    session.publish(
        WorkerStarted(
            sender=sender,
            rank=rank,
            stage=stage,
            replica=replica,
            pid=os.getpid(),
            host=socket.gethostname(),
        )
    )

    stage_plan = plan.stages[stage]
    layers = nn.ModuleList(
        build_layer(cfg.model, i, seed=cfg.train.seed) for i in stage_plan.layers
    ).to(device)
    optimizer = ZeroAdamW(
        layers,
        layer_ids=list(stage_plan.layers),
        dp_group=comm[dp_group_name(stage)],
        replica=replica,
        cfg=cfg.optim,
    )
    keepers = _attach_snapshots(cfg, plan, rank, comm, optimizer) if cfg.train.snapshots else []
    source = open_source(cfg.data, vocab_size=cfg.model.vocab_size, seq_len=cfg.model.seq_len)
    runner = StageRunner(
        plan=plan,
        rank=rank,
        layers=layers,
        optimizer=optimizer,
        comm=comm,
        loader=SampleLoader(source, seed=cfg.data.seed),
        rng=CounterRng(cfg.train.seed),
        model=cfg.model,
        device=device,
    )
    reporter = runner.is_last and replica == 0
    step_times: list[float] = []
    losses: list[float] = []
    traces: list[dict] = []
    optimizer_digests: list[str] = []
    for step in range(cfg.train.steps):
        for keeper in keepers:
            keeper.expect(step)
        result = runner.run_step(step)
        step_times.append(result.seconds)
        if cfg.train.verify_snapshots:
            optimizer_digests.append(state_digest(optimizer.state))
        if step < cfg.train.trace_steps:
            traces.append({"step": step, "actions": result.trace})
        if reporter:
            assert result.loss_sum is not None
            loss = result.loss_sum / plan.global_batch
            losses.append(loss)
            session.publish(
                StepCompleted(
                    sender=sender,
                    rank=rank,
                    step=step,
                    loss=loss,
                    step_time_s=result.seconds,
                    samples=plan.global_batch,
                )
            )

    if optimizer.snapshot is not None:
        optimizer.snapshot.flush()
    for keeper in keepers:
        keeper.wait(cfg.train.steps - 1, timeout_s=cfg.train.comm_timeout_s)
        keeper.close()

    if replica == 0:
        path = stage_params_path(run_dir, stage)
        path.parent.mkdir(exist_ok=True)
        torch.save(
            {
                layer.index: {n: p.detach().cpu() for n, p in layer.named_parameters()}
                for layer in layers
            },
            path,
        )
    result_doc = {
        "rank": rank,
        "stage": stage,
        "replica": replica,
        "step_time_s": step_times,
        "loss": losses if reporter else None,
        "traces": traces,
        "optimizer_shard_numel": optimizer.state.numel(),
        "stage_param_numel": sum(p.numel() for p in layers.parameters()),
        "optimizer_digests": optimizer_digests,
        "snapshot_digests": {str(k.owner): k.digests for k in keepers},
    }
    path = worker_result_path(run_dir, rank)
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(result_doc))
    session.publish(WorkerFinished(sender=sender, rank=rank, ok=True))


def _die_with_parent() -> None:
    """Have the kernel SIGKILL this worker if its launcher dies, so no orphan trains on."""
    import ctypes
    import signal

    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux: the launcher's own cleanup is all there is
    if os.getppid() != parent:  # the launcher died before prctl took effect
        os._exit(1)


def _attach_snapshots(
    cfg: JobConfig, plan: Plan, rank: int, comm: Communicator, optimizer: ZeroAdamW
) -> list[SnapshotKeeper]:
    """Make this rank send its shard's gradients to its holder and keep its owners' copies."""
    stage, _ = plan.locate(rank)
    placement = snapshot_placements(plan, cfg.train.ranks_per_node)[plan.stages[stage].stage]
    if not placement.node_safe and placement.holder:
        log.warning("snapshot.not_node_safe", stage=stage, ranks_per_node=placement.holder)
    holder = placement.holder.get(rank)
    if holder is not None:
        optimizer.snapshot = SnapshotSender(comm[snapshot_link_name(rank, holder)], holder)
    keepers = []
    for owner in placement.holds(rank):
        keeper = SnapshotKeeper(
            owner=owner, link=comm[snapshot_link_name(owner, rank)], cfg=cfg.optim,
            initial=optimizer.initial_state_of(plan.stages[stage].ranks.index(owner)),
            record_digests=cfg.train.verify_snapshots,
        )
        keeper.start()
        keepers.append(keeper)
    return keepers


def main(argv: list[str] | None = None) -> int:
    _die_with_parent()
    parser = argparse.ArgumentParser(prog="elaswave-worker")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--rank", type=int, required=True)
    args = parser.parse_args(argv)
    logs.configure(json=True)
    try:
        run_worker(args.run_dir, args.rank)
    except Exception as exc:
        log.error("worker.failed", error=str(exc), traceback=traceback.format_exc())
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    # Results are on disk and the bus session has flushed and closed. Interpreter
    # teardown of gloo pairs, the store client and torch takes seconds on a loaded host
    # and protects nothing, so leave at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
