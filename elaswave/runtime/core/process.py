"""The Core process: the bus, the event log, the supervisor and its planners.

The job host (:mod:`elaswave.runtime.host.launcher`) starts it with one end of the host link
(:mod:`elaswave.runtime.job.hostlink`) and starts it again when it is lost. Incarnation 0
binds the bus, writes RUN_DIR/job.json (the host's RUN_DIR/host.json completed with the
bus endpoints), announces the run and has the host start the workers. A later
incarnation binds the same endpoints, reads back the event log and
:data:`~elaswave.rundir.CORE_STATE`, adopts the workers the host still has,
and finishes or redoes the change its predecessor left under way; the workers train on
meanwhile.

Its outcome is RUN_DIR/core_result.json: ``{"ok": true}``, or ``{"ok": false,
"reason": ...}`` with exit code :data:`JOB_FAILED`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import traceback
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import structlog

from elaswave import logs, osthreads
from elaswave.bus.schema import CORE_SENDER, RunFinished, RunStarted
from elaswave.comm.store import connect_store
from elaswave.engine.record import RecoveryRecord
from elaswave.rundir import CORE_RESULT, CORE_STATE, HOST_SPEC, JOB
from elaswave.runtime.core.recorder import Core, CorePorts
from elaswave.runtime.core.restorepoint import RESTORE_EVERY
from elaswave.runtime.core.summary import build_summary
from elaswave.runtime.core.supervisor import (
    CORE_RESTORE_EVERY_ENV,
    JobFailed,
    Supervisor,
    fault_point,
    load_state,
)
from elaswave.runtime.core.units import WorkerProcess, group_units, spawn_unit
from elaswave.runtime.job.child import die_with_parent, exit_now
from elaswave.runtime.job.config import JobConfig, JobSpec
from elaswave.runtime.job.hostlink import LINK_FD_ENV, CoreLink
from elaswave.runtime.job.results import write_summary

log = structlog.get_logger(__name__)

JOB_FAILED = 3
"""The Core's exit code when the job failed (the reason is in RUN_DIR/core_result.json)."""


def write_result(run_dir: Path, doc: dict[str, Any]) -> None:
    path = run_dir / CORE_RESULT
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


async def serve(run_dir: Path, link: CoreLink, incarnation: int) -> None:
    """Run the job's control plane to the end (raises JobFailed)."""
    restart = incarnation > 0
    spec = JobSpec.read(run_dir, JOB if restart else HOST_SPEC)
    cfg, ep = spec.config, spec.endpoints
    state, taken = load_state(run_dir / CORE_STATE) if restart else (None, 0)
    ports = CorePorts.of(ep.bus_publish, ep.bus_subscribe, ep.bus_fetch) if restart else None
    store = connect_store(ep.store_host, ep.store_port, timeout_s=cfg.liveness.comm_timeout_s)
    procs = group_units(await link.connect(), cfg.layout.tp)  # by plan rank: a TP group is one
    async with Core(
        run_dir,
        host=cfg.network.bus_host,
        keys=cfg.network.keys(),
        faults=cfg.injection.bus_fault_spec(),
        ports=ports,
        nonce=f"core-{spec.run_id}",  # every incarnation continues one numbering
        restore=restart,
        taken=taken,
        restore_every=int(os.environ.get(CORE_RESTORE_EVERY_ENV, RESTORE_EVERY)),
        health_keep_bytes=cfg.liveness.health_log_mib << 20,
    ) as core:
        listener = asyncio.create_task(core.listen())
        ok, reason = True, ""
        try:
            if not restart:
                procs = await _start_job(run_dir, spec, core, link)
            else:
                log.warning("core.restarted", incarnation=incarnation, workers=sorted(procs))
            supervisor = Supervisor(
                cfg,
                run_dir,
                core,
                procs,
                spawn=lambda rank: spawn_unit(partial(link.spawn, join=True), rank, cfg.layout.tp),
                store=store,
                state=state,
                taken=taken,
            )
            await supervisor.run()
            fault_point("finished")
            # Workers publish WorkerFinished just before exiting; give the bus a moment.
            survivors = set(supervisor.plan.ranks)
            await core.wait_until(lambda: survivors <= set(core.finished), timeout_s=5.0)
        except JobFailed as exc:
            ok, reason = False, str(exc)
            raise
        except BaseException as exc:
            ok, reason = False, f"the Core stopped: {type(exc).__name__}: {exc}".rstrip(": ")
            raise
        finally:
            await core.publish(
                RunFinished(
                    sender=CORE_SENDER,
                    steps_completed=cfg.schedule.steps if ok else 0,
                    ok=ok,
                    reason=reason,
                )
            )
            await core.wait_until(lambda: core.run_finished is not None, timeout_s=2.0)
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener
            await link.close()
    _summarise(run_dir, cfg, core, supervisor.recoveries, incarnation)


async def _start_job(
    run_dir: Path, spec: JobSpec, core: Core, link: CoreLink
) -> dict[int, WorkerProcess]:
    """Incarnation 0: complete the job's spec with the bus endpoints, announce the run
    and have the host start the workers."""
    lay, sch = spec.config.layout, spec.config.schedule
    endpoints = dataclasses.replace(
        spec.endpoints,
        bus_publish=core.publish_endpoint,
        bus_subscribe=core.subscribe_endpoint,
        bus_fetch=core.fetch_endpoint,
    )
    dataclasses.replace(spec, endpoints=endpoints).write(run_dir)
    await link.observe()
    await core.publish(
        RunStarted(
            sender=CORE_SENDER,
            run_id=spec.run_id,
            world_size=lay.num_ranks,
            dp=lay.dp,
            pp=lay.pp,
            steps=sch.steps,
            global_batch=sch.global_batch,
            device=lay.device,
            tp=lay.tp,
        )
    )
    start = partial(link.spawn, join=False)
    return {r: await spawn_unit(start, r, lay.tp) for r in spec.config.plan().ranks}


def _summarise(
    run_dir: Path,
    cfg: JobConfig,
    core: Core,
    recoveries: Sequence[RecoveryRecord],
    incarnation: int,
) -> None:
    """Write the run's summary.json."""
    summary = build_summary(
        run_dir=run_dir,
        plan=cfg.plan(),
        steps=cfg.schedule.steps,
        num_events=core.num_events + core.restored,
        device=cfg.layout.device,
        recoveries=recoveries,
        bus=core.client.delivery(),
        layers=cfg.layer_costs,
        cost_device=cfg.cost_device,
        tp=cfg.layout.tp,
        optim=cfg.optim,
    )
    write_summary(run_dir, dataclasses.replace(summary, core_incarnations=incarnation + 1))


def main(argv: list[str] | None = None) -> int:
    die_with_parent()  # the job host: without it there is no one to serve
    parser = argparse.ArgumentParser(prog="elaswave-core")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--incarnation", type=int, default=0)
    args = parser.parse_args(argv)
    logs.configure(json=True)  # RUN_DIR/logs/coreN.log; the job host renders what it relays
    structlog.contextvars.bind_contextvars(core=args.incarnation)
    osthreads.name_new_threads()
    link = CoreLink.from_fd(int(os.environ[LINK_FD_ENV]))
    import uvloop

    try:
        uvloop.run(serve(args.run_dir, link, args.incarnation))
    except JobFailed as exc:
        write_result(args.run_dir, {"ok": False, "reason": str(exc)})
        return JOB_FAILED
    except KeyboardInterrupt:
        write_result(args.run_dir, {"ok": False, "reason": "the Core was interrupted"})
        return 130
    except Exception as exc:
        log.error("core.failed", error=str(exc), traceback=traceback.format_exc())
        write_result(
            args.run_dir, {"ok": False, "reason": f"the Core failed: {type(exc).__name__}: {exc}"}
        )
        return JOB_FAILED
    write_result(args.run_dir, {"ok": True})
    return 0


if __name__ == "__main__":
    exit_now(main())
