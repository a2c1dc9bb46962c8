"""A worker process: one (stage, replica) of the hybrid-parallel job.

Started by the launcher as ``python -m elaswave.runtime.worker.process --run-dir D --rank R``. The
training loop runs on the main thread; the bus runs in a :class:`Session` event-loop
thread beside it, so publishing an event never blocks a step.
"""

from __future__ import annotations

import argparse
import os
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import structlog
import torch
import torch.distributed as dist
from torch import nn

from elaswave import logs, osthreads
from elaswave.bus.schema import (
    CORE_SENDER,
    Event,
    EventKind,
    FailureDetected,
    PauseRequest,
    RecoveryFinished,
    Topic,
    WorkerFinished,
    sender_name,
)
from elaswave.bus.session import Session
from elaswave.comm.abort import AbortSignal
from elaswave.comm.backend import backend_for
from elaswave.comm.idle import IDLE
from elaswave.comm.spec import Device, parse_device
from elaswave.comm.store import connect_store, fresh_client
from elaswave.comm.strict import StrictViolation
from elaswave.data.corpus import SampleLoader, open_heldout, open_source
from elaswave.engine.cost import device as device_spec
from elaswave.model.protocol import pipeline_model
from elaswave.model.rng import make_rng
from elaswave.model.tensor_parallel import TpShard
from elaswave.runtime.job.child import RULE_BROKEN, die_with_parent, exit_now
from elaswave.runtime.job.config import EMULATED_DEVICE, JobConfig, JobSpec
from elaswave.runtime.job.faults import validate_faults
from elaswave.runtime.job.localrank import local_rank_of
from elaswave.runtime.worker.early_release import EarlyRelease, device_groups
from elaswave.runtime.worker.emulation import Pacer
from elaswave.runtime.worker.evaluation import HeldOutEval
from elaswave.runtime.worker.executor import Mailbox, PauseBox, dump_unless_stopped
from elaswave.runtime.worker.faults import FaultInjector
from elaswave.runtime.worker.frequency import EmulatedFrequency
from elaswave.runtime.worker.heartbeat import HeartbeatSender
from elaswave.runtime.worker.outage import CoreWatch
from elaswave.runtime.worker.script import run_script
from elaswave.runtime.worker.steploop import StepLoop, run_to_the_end
from elaswave.runtime.worker.tpgroup import TpLink, plane_store
from elaswave.runtime.worker.trainer import WorkerContext

log = structlog.get_logger(__name__)


def _place_idle_work(local_processes: int) -> None:
    """The fabric's idle work (:mod:`elaswave.comm.idle`) runs in the training thread's
    waits for communication; on a host with more cores than training processes, on a
    thread of its own too."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if (cores or 1) > local_processes:
        IDLE.start_helper()
    log.debug("worker.idle_work", cores=cores, processes=local_processes, helper=IDLE.has_helper)


def run_worker(run_dir: Path, process: int, *, join: bool = False) -> None:
    """Run process rank ``process`` of the job in ``run_dir``; ``join``: a worker added
    to the running job, which waits for the Core's plan that gives it a place.

    With ``--tp N`` the process is member ``process % N`` of the plan's rank
    ``process // N`` (:mod:`elaswave.runtime.worker.tpgroup`); without, the two are the same."""
    spec = JobSpec.read(run_dir)
    ep = spec.endpoints
    torch.set_num_threads(1)
    _place_idle_work(spec.config.layout.local_processes)
    rank, member = spec.config.layout.unit_of(process)
    structlog.contextvars.bind_contextvars(rank=rank, joined=join)
    if spec.config.layout.tp > 1:
        structlog.contextvars.bind_contextvars(member=member)
    sender = sender_name(rank, member)
    # Workers act on the Core's control and recovery events only: metrics are for the
    # Core and users, other processes' messages for the Core.
    session = Session(
        sender, ep.bus_publish, ep.bus_subscribe, topics=[Topic.CONTROL, Topic.RECOVERY],
        senders=[CORE_SENDER],
        keys=spec.config.network.keys(), fetch_endpoint=ep.bus_fetch or None,
        faults=spec.config.injection.bus_fault_spec(),
    )  # fmt: skip
    abort = AbortSignal()
    inbox = Mailbox()
    pauses = PauseBox()
    heartbeat = HeartbeatSender(
        session, rank, interval_s=spec.config.liveness.heartbeat_interval_s, sender=sender
    )
    watch = CoreWatch(spec.config.liveness.core_outage_s)
    session.subscribe(watch.heard)

    held: list[StepLoop] = []  # the step loop, once built: whose device groups a failure stalls
    early = EarlyRelease(lambda: device_groups(getattr(held[0], "trainer", None)) if held else [])

    def on_recovery_event(event: Event) -> None:  # on the session's thread
        # A repeat announcement (a widened failure set) for a generation this worker
        # is already leaving must not abort the recovery itself.
        if isinstance(event, FailureDetected) and event.generation == abort.generation:
            abort.set(f"ranks {event.ranks} failed ({event.source})", event.ranks)
            early.failed(event.ranks)
            dump_unless_stopped()
        if isinstance(event, RecoveryFinished):  # no roll-back reaches that change now
            inbox.settled.note(event.generation)
            return
        if isinstance(event, PauseRequest):
            if event.generation == abort.generation:
                pauses.put(event)
                if heartbeat.step > event.after_step:  # already past the pause point
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
            EventKind.RECOVERY_FINISHED,
        ],
    )
    session.start()
    heartbeat.start()
    try:
        ctx = _context(run_dir, process, spec, abort)
        loop = StepLoop(ctx, session, abort, inbox, heartbeat, pauses, watch, join=join)
        held.append(loop)
        if spec.config.schedule.script:
            run_script(loop, spec.config.schedule.script)
        else:
            run_to_the_end(loop)
    except BaseException as exc:
        session.publish(
            WorkerFinished(
                sender=sender, rank=rank, ok=False, reason=f"{type(exc).__name__}: {exc}"
            )
        )
        raise
    finally:
        heartbeat.close()
        session.close()


def _context(run_dir: Path, process: int, spec: JobSpec, abort: AbortSignal) -> WorkerContext:
    cfg, ep = spec.config, spec.endpoints
    rank, member = cfg.layout.unit_of(process)
    backend = backend_for(cfg.layout.device, cfg.liveness.comm_timeout_s)
    local_rank = local_rank_of(process)  # which of its host's devices the host gave it
    device = backend.device_for(local_rank)
    store = connect_store(ep.store_host, ep.store_port, timeout_s=cfg.liveness.comm_timeout_s)
    store.set(f"pid/{process}", str(os.getpid()))  # a kill-node fault kills node peers by pid
    tp = None
    if cfg.layout.tp > 1:
        tp = TpLink(
            store, unit=rank, member=member, size=cfg.layout.tp, backend=backend,
            timeout=timedelta(seconds=cfg.liveness.comm_timeout_s), abort=abort,
            device=device,
        )  # fmt: skip
    shard = TpShard(member, cfg.layout.tp, tp)
    plan = cfg.plan()
    initial = (
        plan.stages[plan.locate(rank)[0]].layers if rank in plan.ranks else range(0)
    )  # a joining rank gets its layers with its plan
    model = pipeline_model(cfg.model)
    layers = nn.ModuleList(
        model.build_layer(i, seed=cfg.schedule.seed, tp=shard) for i in initial
    ).to(device)
    source = open_source(cfg.data, vocab_size=cfg.model.vocab_size, seq_len=cfg.model.seq_len)
    faults = validate_faults(
        cfg.injection.faults,
        world_size=cfg.layout.num_ranks,
        ranks_per_node=cfg.layout.ranks_per_node,
        steps=cfg.schedule.steps,
    )
    costs = {c.index: c for c in cfg.layer_costs}  # the planners' costs: measured or formulas
    if parse_device(cfg.layout.device) is Device.EMULATED:
        emulated = device_spec(EMULATED_DEVICE)
        clock = EmulatedFrequency(
            base_mhz=emulated.base_mhz, min_mhz=emulated.min_mhz, max_mhz=emulated.max_mhz
        )
        pacer = Pacer(emulated, costs, clock, queued=tp is None)
    else:
        pacer = Pacer(
            None, costs, reference=cfg.cost_device, waited=None if tp is None else tp.waited
        )
    return WorkerContext(
        cfg=cfg,
        rank=rank,
        run_dir=run_dir,
        store=store,
        plane_store=plane_store(store, member, cfg.layout.tp),
        member=member,
        tp=tp,
        backend=backend,
        device=device,
        layers=layers,
        loader=SampleLoader(source, seed=cfg.data.seed),
        rng=make_rng(cfg.schedule.rng, seed=cfg.schedule.seed, rank=rank),
        abort=abort,
        faults=FaultInjector(
            process,
            cfg.layout.ranks_per_node,
            faults,
            run_dir,
            pid_of=pid_lookup(store),
        ),
        pacer=pacer,
        evaluation=_evaluation(cfg),
        local_rank=local_rank,
    )


def _evaluation(cfg: JobConfig) -> HeldOutEval | None:
    """What ``--eval-every`` evaluates (None: nothing)."""
    schedule = cfg.schedule
    if not schedule.eval_every:
        return None
    held = open_heldout(
        cfg.data, vocab_size=cfg.model.vocab_size, seq_len=cfg.model.seq_len,
        windows=schedule.eval_batches * schedule.global_batch,
    )  # fmt: skip
    return HeldOutEval(held, schedule.eval_batches, schedule.evaluates)


def pid_lookup(store: dist.Store) -> Callable[[int], int | None]:
    """The process id a rank registered, None if no such rank has started (a rank that
    does not exist must not hold a kill-node for the store's timeout); looked up on a
    connection of its own, opened at the first lookup: a group creation a torn apply
    abandoned holds the worker's own connection in its wait until the store's timeout,
    and a kill-node behind it took the node 27 s late (chaos seed 44357, case 24)."""
    own: list[dist.Store] = []

    def pid_of(rank: int) -> int | None:
        if not own:
            own.append(fresh_client(store))
        key = f"pid/{rank}"
        return int(own[0].get(key)) if own[0].check([key]) else None

    return pid_of


def main(argv: list[str] | None = None) -> int:
    die_with_parent()
    parser = argparse.ArgumentParser(prog="elaswave-worker")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--join", action="store_true", help="join the running job")
    args = parser.parse_args(argv)
    logs.configure(json=True)
    osthreads.name_new_threads()
    try:
        run_worker(args.run_dir, args.rank, join=args.join)
    except Exception as exc:
        log.error("worker.failed", error=str(exc), traceback=traceback.format_exc())
        return RULE_BROKEN if isinstance(exc, StrictViolation) else 1
    return 0


if __name__ == "__main__":
    exit_now(main())
