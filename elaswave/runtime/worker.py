"""A worker process: one (stage, replica) of the hybrid-parallel job.

Started by the launcher as ``python -m elaswave.runtime.worker --run-dir D --rank R``. The
training loop runs on the main thread; the bus runs in a :class:`Session` event-loop
thread beside it, so publishing an event never blocks a step.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import socket
import time
import traceback
from functools import partial
from pathlib import Path

import structlog
import torch
import torch.distributed as dist
from torch import nn

from elaswave import logs, rundir
from elaswave.bus.schema import (
    Event,
    EventKind,
    FailureDetected,
    MigrationDone,
    PauseRequest,
    StepCompleted,
    StepTiming,
    Topic,
    WorkerFinished,
    WorkerStarted,
)
from elaswave.comm.abort import AbortSignal, StepAborted
from elaswave.comm.backend import Device, backend_for, parse_device
from elaswave.comm.group import CommError
from elaswave.comm.store import connect_store
from elaswave.data.corpus import SampleLoader, open_source
from elaswave.engine.cost import device as device_spec
from elaswave.engine.cost import layer_costs
from elaswave.fabric.checkpoint import shard_pieces, write_pieces
from elaswave.fabric.remap import FP32_BYTES
from elaswave.fabric.snapshot import state_digest
from elaswave.model.llama import layer_index
from elaswave.model.protocol import pipeline_model
from elaswave.model.rng import make_rng
from elaswave.runtime import executor
from elaswave.runtime.agent import Agent
from elaswave.runtime.child import die_with_parent, exit_now
from elaswave.runtime.config import EMULATED_DEVICE, JobSpec
from elaswave.runtime.emulation import Pacer
from elaswave.runtime.executor import Mailbox, PauseBox
from elaswave.runtime.faults import FaultInjector, validate_faults
from elaswave.runtime.frequency import EmulatedFrequency
from elaswave.runtime.outage import CoreWatch
from elaswave.runtime.session import Session
from elaswave.runtime.trainer import (
    WorkerContext,
    initial_trainer,
)

log = structlog.get_logger(__name__)


def run_worker(run_dir: Path, rank: int, *, join: bool = False) -> None:
    """Run rank ``rank`` of the job in ``run_dir``; ``join``: a worker added to the
    running job, which waits for the Core's plan that gives it a place."""
    spec = JobSpec.read(run_dir)
    ep = spec.endpoints
    torch.set_num_threads(1)
    structlog.contextvars.bind_contextvars(rank=rank, joined=join)
    # Workers act on control and recovery events only; metrics are for the Core and users.
    session = Session(
        f"rank{rank}", ep.bus_publish, ep.bus_subscribe, topics=[Topic.CONTROL, Topic.RECOVERY],
        keys=spec.config.train.keys(), fetch_endpoint=ep.bus_fetch or None,
        faults=spec.config.train.bus_fault_spec(),
    )  # fmt: skip
    abort = AbortSignal()
    inbox = Mailbox()
    pauses = PauseBox()
    agent = Agent(session, rank, interval_s=spec.config.train.heartbeat_interval_s)
    watch = CoreWatch(spec.config.train.core_outage_s)
    session.subscribe(watch.heard)

    def on_recovery_event(event: Event) -> None:  # on the session's thread
        # A repeat announcement (a widened failure set) for a generation this worker
        # is already leaving must not abort the recovery itself.
        if isinstance(event, FailureDetected) and event.generation == abort.generation:
            abort.set(f"ranks {event.ranks} failed ({event.source})")
        if isinstance(event, PauseRequest):
            if event.generation == abort.generation:
                pauses.put(event)
                if agent.step > event.after_step:  # already past the pause point
                    abort.set(f"pause after step {event.after_step}: {event.reason}")
            return
        inbox.put(event)

    session.subscribe(
        on_recovery_event,
        kinds=[
            EventKind.FAILURE_DETECTED,
            EventKind.RECOVERY_PLAN,
            EventKind.PAUSE_REQUEST,
            EventKind.PLAN_COMMIT,
            EventKind.WAITING_FOR_NODES,
            EventKind.CHECKPOINT_REQUEST,
        ],
    )
    session.start()
    agent.start()
    try:
        _train(run_dir, rank, spec, session, abort, inbox, agent, pauses, watch, join=join)
    except BaseException as exc:
        session.publish(
            WorkerFinished(
                sender=f"rank{rank}", rank=rank, ok=False, reason=f"{type(exc).__name__}: {exc}"
            )
        )
        raise
    finally:
        agent.close()
        session.close()


def _context(run_dir: Path, rank: int, spec: JobSpec, abort: AbortSignal) -> WorkerContext:
    cfg, ep = spec.config, spec.endpoints
    backend = backend_for(cfg.train.device)
    device = backend.device_for(rank)
    plan = cfg.plan()
    initial = (
        plan.stages[plan.locate(rank)[0]].layers if rank in plan.ranks else range(0)
    )  # a joining rank gets its layers with its plan
    model = pipeline_model(cfg.model)
    layers = nn.ModuleList(model.build_layer(i, seed=cfg.train.seed) for i in initial).to(device)
    source = open_source(cfg.data, vocab_size=cfg.model.vocab_size, seq_len=cfg.model.seq_len)
    faults = validate_faults(
        cfg.train.faults,
        world_size=cfg.train.num_ranks,
        ranks_per_node=cfg.train.ranks_per_node,
        steps=cfg.train.steps,
    )
    costs = {c.index: c for c in layer_costs(cfg.model, dtype_bytes=FP32_BYTES)}
    if parse_device(cfg.train.device) is Device.EMULATED:
        emulated = device_spec(EMULATED_DEVICE)
        clock = EmulatedFrequency(
            base_mhz=emulated.base_mhz, min_mhz=emulated.min_mhz, max_mhz=emulated.max_mhz
        )
        pacer = Pacer(emulated, costs, clock)
    else:
        pacer = Pacer(None, costs, reference=cfg.cost_device)
    store = connect_store(ep.store_host, ep.store_port, timeout_s=cfg.train.comm_timeout_s)
    store.set(f"pid/{rank}", str(os.getpid()))  # a kill-node fault kills node peers by pid
    return WorkerContext(
        cfg=cfg,
        rank=rank,
        run_dir=run_dir,
        store=store,
        backend=backend,
        device=device,
        layers=layers,
        loader=SampleLoader(source, seed=cfg.data.seed),
        rng=make_rng(cfg.train.rng, seed=cfg.train.seed, rank=rank),
        abort=abort,
        faults=FaultInjector(
            rank,
            cfg.train.ranks_per_node,
            faults,
            run_dir,
            pid_of=partial(_registered_pid, store),
        ),
        pacer=pacer,
    )


def _registered_pid(store: dist.Store, rank: int) -> int | None:
    """The process id ``rank`` registered, None if no such rank has started: a rank
    that does not exist must not hold a kill-node for the store's timeout."""
    key = f"pid/{rank}"
    return int(store.get(key)) if store.check([key]) else None


class _PausedAtBoundary(Exception):
    """The training loop reached the step boundary a PauseRequest asked for."""


def _train(
    run_dir: Path,
    rank: int,
    spec: JobSpec,
    session: Session,
    abort: AbortSignal,
    inbox: Mailbox,
    agent: Agent,
    pauses: PauseBox,
    watch: CoreWatch,
    *,
    join: bool = False,
) -> None:
    cfg = spec.config
    sender = f"rank{rank}"
    ctx = _context(run_dir, rank, spec, abort)
    watch.store = ctx.store
    if join:
        session.publish(
            WorkerStarted(
                sender=sender,
                rank=rank,
                stage=-1,
                replica=-1,
                pid=os.getpid(),
                host=socket.gethostname(),
                joining=True,
            )
        )
        trainer = executor.join(ctx, session, inbox)
    else:
        trainer = initial_trainer(ctx)
        stage, replica = trainer.plan.locate(rank)
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
    step_times: dict[int, float] = {}
    losses: dict[int, float] = {}
    traces: list[dict] = []
    optimizer_digests: dict[int, str] = {}
    writer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt")
    writes: list[concurrent.futures.Future] = []
    step = trainer.committed_step + 1 if join else cfg.train.first_step
    first_step = step
    cpu_started = time.process_time()
    while step < cfg.train.steps:
        agent.step = step  # before looking for a pause: see on_recovery_event
        ctx.pacer.slowdown = ctx.faults.slowdown(step)
        if hasattr(ctx.rng, "begin_step"):
            ctx.rng.begin_step(step)
        pause = pauses.pending(trainer.plan.generation)
        try:
            if pause is not None and step > pause.after_step:
                raise _PausedAtBoundary
            if watch.pause_before(step):  # the Core is away: wait for it, state kept
                watch.wait(step, abort.is_set)
                abort.check()  # the returned Core announced a failure meanwhile
            result = trainer.runner.run_step(step)
        except (StepAborted, CommError, _PausedAtBoundary) as exc:
            cause = None if isinstance(exc, _PausedAtBoundary) else exc
            trainer = executor.recover(ctx, trainer, session, inbox, cause, pauses)
            step = trainer.committed_step + 1
            if hasattr(ctx.rng, "rewind"):
                ctx.rng.rewind(step)
            for record in (step_times, losses, optimizer_digests):
                for later in [s for s in record if s >= step]:
                    del record[later]
            continue
        step_times[step] = result.seconds
        if (shadow := result.migration) is not None:
            session.publish(
                MigrationDone(
                    sender=sender,
                    generation=trainer.plan.generation,
                    rank=rank,
                    step=step,
                    early=shadow.transition.early,
                    bytes_streamed=shadow.bytes_streamed,
                    waited_s=shadow.waited_s,
                )
            )
        clock = ctx.pacer.clock
        session.publish(
            StepTiming(
                sender=sender,
                generation=trainer.plan.generation,
                rank=rank,
                step=step,
                compute_s=clock.compute_s,
                expected_s=clock.expected_s,
                micro_batches=clock.micro_batches,
                overruns=clock.overruns,
            )
        )
        every = cfg.train.checkpoint_every
        if every and (step + 1) % every == 0:  # committed: snapshot the shard, write later
            _, replica = trainer.plan.locate(rank)
            pieces = shard_pieces(trainer.optimizer.layout, replica, trainer.optimizer.state)
            writes.append(writer.submit(write_pieces, run_dir, step, rank, pieces))
        if step < cfg.train.trace_steps and trainer.plan.generation == 0:
            traces.append({"step": step, "actions": result.trace})
        if cfg.train.verify_snapshots:
            optimizer_digests[step] = state_digest(trainer.optimizer.state)
        if result.loss_sum is not None:
            losses[step] = result.loss_sum / trainer.plan.global_batch
            if trainer.plan.stages[-1].ranks[0] == rank:
                session.publish(
                    StepCompleted(
                        sender=sender,
                        rank=rank,
                        step=step,
                        loss=losses[step],
                        step_time_s=result.seconds,
                        samples=trainer.plan.global_batch,
                    )
                )
        step += 1

    cpu_s = time.process_time() - cpu_started  # every thread: training, snapshots, bus
    writer.shutdown(wait=True)
    for write in writes:
        write.result()  # surface a failed checkpoint write
    if trainer.optimizer.snapshot is not None:
        trainer.optimizer.snapshot.flush(cfg.train.comm_timeout_s)
    for keeper in trainer.keepers:
        keeper.wait(cfg.train.steps - 1, timeout_s=cfg.train.comm_timeout_s)
        keeper.close()
    stage, replica = trainer.plan.locate(rank)
    if replica == 0:
        path = rundir.stage_params(run_dir, stage)
        path.parent.mkdir(exist_ok=True)
        torch.save(
            {
                layer_index(layer): {n: p.detach().cpu() for n, p in layer.named_parameters()}
                for layer in trainer.layers
            },
            path,
        )
    result_doc = {
        "rank": rank,
        "stage": stage,
        "replica": replica,
        "step_time_s": [step_times[s] for s in sorted(step_times)],
        "loss": [losses[s] for s in sorted(losses)] if losses else None,
        "loss_steps": sorted(losses),
        "traces": traces,
        "optimizer_shard_numel": trainer.optimizer.state.numel(),
        "stage_param_numel": sum(p.numel() for p in trainer.layers.parameters()),
        "optimizer_digests": [optimizer_digests[s] for s in sorted(optimizer_digests)],
        "snapshot_digests": {str(k.owner): k.digests for k in trainer.keepers},
        "generation": trainer.plan.generation,
        "first_step": first_step,
        "bus": session.client.delivery(),
        "cpu_s": cpu_s,
        "snapshot_cpu_s": sum(k.cpu_s for k in trainer.keepers)
        + (trainer.optimizer.snapshot.cpu_s if trainer.optimizer.snapshot is not None else 0.0),
    }
    path = rundir.worker_result(run_dir, rank)
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(result_doc))
    session.publish(WorkerFinished(sender=sender, rank=rank, ok=True))


def main(argv: list[str] | None = None) -> int:
    die_with_parent()
    parser = argparse.ArgumentParser(prog="elaswave-worker")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--join", action="store_true", help="join the running job")
    args = parser.parse_args(argv)
    logs.configure(json=True)
    try:
        run_worker(args.run_dir, args.rank, join=args.join)
    except Exception as exc:
        log.error("worker.failed", error=str(exc), traceback=traceback.format_exc())
        return 1
    return 0


if __name__ == "__main__":
    exit_now(main())
