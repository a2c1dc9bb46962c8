"""Start the Core and N local workers, supervise them, and write the run's summary."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from elaswave.bus.schema import Event, RunFinished, RunStarted
from elaswave.comm.store import serve_store
from elaswave.runtime.config import Endpoints, JobConfig, JobSpec
from elaswave.runtime.core import EVENT_LOG, Core
from elaswave.runtime.summary import build_summary, write_summary

log = structlog.get_logger(__name__)

_RUN_OUTPUTS = ("workers", "params", "logs", EVENT_LOG, "summary.json", "job.json")


class JobFailed(RuntimeError):
    """The job could not complete; the message says which rank and why."""


def _prepare_run_dir(run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in _RUN_OUTPUTS:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    (run_dir / "logs").mkdir()


def _last_error(log_path: Path) -> str:
    """The worker's own account of its failure: the last 'error' field in its log."""
    import json

    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        with contextlib.suppress(ValueError):
            doc = json.loads(line)
            if isinstance(doc, dict) and doc.get("error"):
                return str(doc["error"])
    return lines[-1] if lines else ""


async def _spawn(run_dir: Path, rank: int) -> asyncio.subprocess.Process:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with (run_dir / "logs" / f"rank{rank}.log").open("wb") as out:
        return await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "elaswave.runtime.worker",
            "--run-dir",
            str(run_dir),
            "--rank",
            str(rank),
            stdout=out,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
        )


async def _supervise(run_dir: Path, procs: dict[int, asyncio.subprocess.Process]) -> None:
    """Wait for every worker; on the first failure stop the others and raise."""
    waits = {asyncio.ensure_future(p.wait()): rank for rank, p in procs.items()}
    try:
        pending = set(waits)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                rank, code = waits[fut], fut.result()
                if code != 0:
                    reason = _last_error(run_dir / "logs" / f"rank{rank}.log")
                    how = f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"
                    raise JobFailed(
                        f"rank {rank} exited with {how}: {reason or 'no message'} "
                        f"(log: {run_dir / 'logs' / f'rank{rank}.log'})"
                    )
    finally:
        for proc in procs.values():
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
        for fut in waits:
            with contextlib.suppress(BaseException):
                await fut


async def _run_workers(
    cfg: JobConfig, run_dir: Path, run_id: str, store_port: int, core: Core
) -> None:
    plan = cfg.plan()
    JobSpec(
        run_id=run_id,
        config=cfg,
        endpoints=Endpoints(
            store_host="127.0.0.1",
            store_port=store_port,
            bus_publish=core.publish_endpoint,
            bus_subscribe=core.subscribe_endpoint,
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
        procs = {rank: await _spawn(run_dir, rank) for rank in plan.ranks}
        await _supervise(run_dir, procs)
        # Workers publish WorkerFinished just before exiting; give the bus a moment.
        await core.wait_until(lambda: len(core.finished) == len(procs), timeout_s=5.0)
    except JobFailed as exc:
        ok, reason = False, str(exc)
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
    _prepare_run_dir(run_dir)
    plan = cfg.plan()
    store = serve_store(timeout_s=cfg.train.comm_timeout_s)
    run_id = uuid.uuid4().hex[:12]
    async with Core(run_dir, on_event=on_event) as core:
        listener = asyncio.create_task(core.listen())
        try:
            await _run_workers(cfg, run_dir, run_id, store.port, core)
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
    )
    write_summary(run_dir, summary)
    return summary
