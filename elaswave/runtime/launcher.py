"""Start the Core and N local workers, supervise them, and write the run's summary."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
import torch.distributed as dist

from elaswave.bus.schema import Event, RunFinished, RunStarted
from elaswave.comm.backend import backend_for, check_capacity
from elaswave.comm.store import serve_store
from elaswave.fabric.checkpoint import CHECKPOINTS
from elaswave.runtime.config import Endpoints, JobConfig, JobSpec
from elaswave.runtime.core import EVENT_LOG, Core
from elaswave.runtime.summary import build_summary, write_summary
from elaswave.runtime.supervisor import JobFailed, Supervisor

log = structlog.get_logger(__name__)

_RUN_OUTPUTS = ("workers", "params", "logs", "faults", EVENT_LOG, "summary.json", "job.json")


def _prepare_run_dir(run_dir: Path, *, resume_dir: str | None) -> None:
    """Clear a previous run's outputs; its checkpoints too unless resuming from them."""
    keep_checkpoints = resume_dir is not None and Path(resume_dir).resolve() == run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    names = _RUN_OUTPUTS if keep_checkpoints else (*_RUN_OUTPUTS, CHECKPOINTS)
    for name in names:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    (run_dir / "logs").mkdir()


async def _spawn(
    cfg: JobConfig, run_dir: Path, rank: int, *, join: bool = False
) -> asyncio.subprocess.Process:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with (run_dir / "logs" / f"rank{rank}.log").open("wb") as out:
        return await asyncio.create_subprocess_exec(
            *cfg.train.worker_command(rank),
            sys.executable,
            "-m",
            "elaswave.runtime.worker",
            "--run-dir",
            str(run_dir),
            "--rank",
            str(rank),
            *(["--join"] if join else []),
            stdout=out,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
        )


async def _run_workers(
    cfg: JobConfig, run_dir: Path, run_id: str, store: dist.TCPStore, core: Core
) -> list[dict[str, Any]]:
    """Run the workers to the end, recovering from failures; returns the recoveries."""
    plan = cfg.plan()
    JobSpec(
        run_id=run_id,
        config=cfg,
        endpoints=Endpoints(
            store_host=cfg.train.bus_host,
            store_port=store.port,
            bus_publish=core.publish_endpoint,
            bus_subscribe=core.subscribe_endpoint,
            bus_fetch=core.fetch_endpoint,
        ),
    ).write(run_dir)
    t = cfg.train
    await core.publish(
        RunStarted(
            sender="core",
            run_id=run_id,
            world_size=t.num_ranks,
            dp=t.dp,
            pp=t.pp,
            steps=t.steps,
            global_batch=t.global_batch,
            device=t.device,
        )
    )
    ok, reason = True, ""
    try:
        procs = {rank: await _spawn(cfg, run_dir, rank) for rank in plan.ranks}
        supervisor = Supervisor(
            cfg,
            run_dir,
            core,
            procs,
            spawn=lambda rank: _spawn(cfg, run_dir, rank, join=True),
            store=store,
        )
        await supervisor.run()
        # Workers publish WorkerFinished just before exiting; give the bus a moment.
        survivors = set(supervisor.plan.ranks)
        await core.wait_until(lambda: survivors <= set(core.finished), timeout_s=5.0)
        return supervisor.recoveries
    except JobFailed as exc:
        ok, reason = False, str(exc)
        raise
    except BaseException as exc:  # interrupted (Ctrl-C, cancelled) or a Core bug
        ok, reason = False, f"the Core stopped: {type(exc).__name__}: {exc}".rstrip(": ")
        raise
    finally:
        await core.publish(
            RunFinished(sender="core", steps_completed=t.steps if ok else 0, ok=ok, reason=reason)
        )
        await core.wait_until(lambda: core.run_finished is not None, timeout_s=2.0)


async def run_job(
    cfg: JobConfig,
    run_dir: Path,
    *,
    on_event: Callable[[Event], None] | None = None,
) -> dict[str, Any]:
    """Train ``cfg`` with dp x pp local worker processes; return the summary."""
    check_capacity(backend_for(cfg.train.device), cfg.train.num_ranks, cfg.train.device)
    keys = cfg.train.keys()  # a missing key stops the job here, before anything starts
    _prepare_run_dir(run_dir, resume_dir=cfg.train.resume_dir)
    plan = cfg.plan()
    store = serve_store(cfg.train.bus_host, timeout_s=cfg.train.comm_timeout_s)
    run_id = uuid.uuid4().hex[:12]
    faults = cfg.train.bus_fault_spec()
    async with Core(
        run_dir, on_event=on_event, host=cfg.train.bus_host, keys=keys, faults=faults
    ) as core:
        listener = asyncio.create_task(core.listen())
        try:
            recoveries = await _run_workers(cfg, run_dir, run_id, store, core)
        finally:
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener
    summary = build_summary(
        run_dir=run_dir,
        plan=plan,
        steps=cfg.train.steps,
        num_events=core.num_events,
        device=cfg.train.device,
        recoveries=recoveries,
        bus=core.client.delivery(),
    )
    write_summary(run_dir, summary)
    return summary
