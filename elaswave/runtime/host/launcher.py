"""The job host: serve the store, run the workers, and run (and restart) the Core.

The workers and the store belong to this process, so a lost Core loses neither: the
host starts a new Core, which binds the same bus endpoints and resumes from the event
log and its persisted state, while the workers train on (:mod:`elaswave.runtime.core.process`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from elaswave import logs
from elaswave.bus.client import BusClient, BusError
from elaswave.bus.eventlog import read_event_log
from elaswave.bus.schema import Event, RunFinished, ScaleRequest, Topic
from elaswave.comm.backend import backend_for, check_capacity
from elaswave.comm.store import serve_store
from elaswave.engine.change import State, state_from_json
from elaswave.fabric.checkpoint import latest_complete
from elaswave.rundir import (
    CHECKPOINTS,
    CORE_PID,
    CORE_RESULT,
    CORE_STATE,
    EVENT_LOG,
    HOST_SPEC,
    JOB,
    LOGS,
    OUTPUTS,
    PROFILE,
    core_log,
)
from elaswave.runtime.core.process import JOB_FAILED
from elaswave.runtime.core.summary import build_summary
from elaswave.runtime.core.supervisor import CORE_FAULT_ENV, JobFailed, exit_text
from elaswave.runtime.host.nodeagent import JOB_KEY, parse_endpoint
from elaswave.runtime.host.nodes import RemoteNodes
from elaswave.runtime.host.profile import LayerProfile
from elaswave.runtime.host.restarts import Offer, Restarts
from elaswave.runtime.host.tensorboard import ScalarLog
from elaswave.runtime.host.workers import start_worker
from elaswave.runtime.host.zygote import Zygote
from elaswave.runtime.job.config import Endpoints, JobConfig, JobSpec
from elaswave.runtime.job.hostlink import LINK_FD_ENV, HostLink, LinkOp
from elaswave.runtime.job.localrank import LocalRanks
from elaswave.runtime.job.results import Summary, read_summary, write_summary

log = structlog.get_logger(__name__)

RESTARTS_SENDER = "host-restarts"
"""The job host's name on the bus where it offers failed workers' devices again."""

OBSERVED = (Topic.LIFECYCLE, Topic.METRICS, Topic.RECOVERY)
"""What ``on_event`` is given: heartbeats (HEALTH) are the Core's business, and each
observed message costs this process's CPU beside the workers'."""


def _prepare_run_dir(run_dir: Path, *, resume_dir: str | None) -> None:
    """Clear a previous run's outputs; its checkpoints too unless resuming from them."""
    keep_checkpoints = resume_dir is not None and Path(resume_dir).resolve() == run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    names = OUTPUTS if keep_checkpoints else (*OUTPUTS, CHECKPOINTS)
    for name in names:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    (run_dir / LOGS).mkdir()


class JobHost:
    """Owns what must outlive a Core: the store (held by the caller), the workers, and
    their exit codes. Runs the Core as a child process over the host link and starts it
    again, up to ``core_restarts`` times, when it is lost."""

    def __init__(
        self,
        cfg: JobConfig,
        run_dir: Path,
        on_event: Callable[[Event], None] | None,
        zygote: Zygote | None = None,
        store: Any = None,
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.nodes = RemoteNodes(cfg) if cfg.layout.nnodes > 1 else None
        """The other hosts' agents (a multi-host job; :mod:`elaswave.runtime.host.nodes`)."""
        self.zygote = zygote
        self.run_dir = run_dir
        self.on_event = on_event
        self.workers: dict[int, Any] = {}
        """rank -> its process (``asyncio.subprocess.Process`` or ``ForkedProcess``)."""
        self.codes: dict[int, int | None] = {}
        self.devices = LocalRanks(cfg.layout.local_processes)
        """This host's devices and the local workers holding them."""
        self.restarts = Restarts(cfg.layout.tp, cfg.elastic.max_restarts)
        """Which failed workers' devices are offered again (``--max-restarts``)."""
        self._offers: BusClient | None = None
        """Publishes those offers (connected at the first)."""
        self._offering = asyncio.Lock()
        """One offer at a time: the first connects the client, and they go in order."""
        self._reapers: list[asyncio.Task[None]] = []
        self._link: HostLink | None = None
        self._observer: asyncio.Task[None] | None = None
        self._observing = asyncio.Event()
        """Set once the observer's bus client has subscribed."""
        self._seen_finish = asyncio.Event()
        """Set once the observer has passed the run's end (RunFinished) on."""

    async def run(self) -> None:
        """Run Cores until one finishes the job (or fails it: JobFailed)."""
        try:
            for incarnation in itertools.count():
                code = await self._run_core(incarnation)
                if code == 0:
                    return
                result = self._result()
                if code == JOB_FAILED and result is not None:
                    raise JobFailed(self._with_resume(result["reason"]))
                lost = f"the Core was lost ({exit_text(code)}; see logs/core{incarnation}.log)"
                state = self._state()
                if state is not None and self._all_finished(state):
                    self._summarise(state, lost)  # the job ended while no Core was there
                    return
                if incarnation >= (allowed := self.cfg.liveness.core_restarts):
                    raise JobFailed(
                        f"{lost}, and --core-restarts {allowed} allows no further restart; "
                        f"{self._resume()}"
                    )
                if state is None:
                    raise JobFailed(f"{lost} before it had started the job; {self._resume()}")
                log.warning("host.core_lost", code=code, incarnation=incarnation)
                await asyncio.sleep(self.cfg.liveness.core_restart_delay_s)
        finally:
            await self._stop_workers()

    def _state(self) -> State | None:
        """The lost Core's persisted state; None when it had not started the job."""
        with contextlib.suppress(OSError, ValueError):
            return state_from_json(json.loads((self.run_dir / CORE_STATE).read_text()))
        return None

    def _all_finished(self, state: State) -> bool:
        """Every worker of the last plan exited cleanly: the training is done."""
        ranks = state.plan.ranks
        tp = self.cfg.layout.tp  # a plan rank is its TP group's processes
        return bool(ranks) and all(
            self.codes.get(self.cfg.layout.physical(r, m)) == 0 for r in ranks for m in range(tp)
        )

    def _summarise(self, state: State, lost: str) -> None:
        """Write the summary a Core would have, from the workers' results on disk."""
        log.warning("host.summarising", reason=f"{lost} after every worker had finished")
        summary = build_summary(
            run_dir=self.run_dir,
            plan=self.cfg.plan(),
            steps=self.cfg.schedule.steps,
            num_events=sum(1 for _ in read_event_log(self.run_dir / EVENT_LOG)),
            device=self.cfg.layout.device,
            recoveries=state.recoveries,
            layers=self.cfg.layer_costs,
            cost_device=self.cfg.cost_device,
            tp=self.cfg.layout.tp,
            optim=self.cfg.optim,
        )
        write_summary(self.run_dir, summary)

    def _result(self) -> dict[str, Any] | None:
        with contextlib.suppress(OSError, ValueError):
            return json.loads((self.run_dir / CORE_RESULT).read_text())
        return None

    def _with_resume(self, reason: str) -> str:
        """The Core's reason for stopping the job, with how to continue it where the run
        directory holds a complete checkpoint the reason does not name already (a job
        whose last worker died, or with recovery off, stops at its failure)."""
        if "--resume" in reason:
            return reason
        step = latest_complete(self.run_dir, self.cfg.model.num_layers, self.cfg.layout.tp)
        return reason if step is None else f"{reason}; {self._resume()}"

    def _resume(self) -> str:
        """How to continue the job: its latest complete checkpoint (every TP member's
        pieces of it) and the ``--resume`` that starts from it."""
        step = latest_complete(self.run_dir, self.cfg.model.num_layers, self.cfg.layout.tp)
        if step is None:
            return "it wrote no complete checkpoint (train with --checkpoint-every K to resume)"
        return f"resume from the checkpoint of step {step} with --resume {self.run_dir}"

    async def _run_core(self, incarnation: int) -> int:
        host_end, core_end = socket.socketpair()
        argv = ["--run-dir", str(self.run_dir), "--incarnation", str(incarnation)]
        env: dict[str, str | None] = {
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }
        if incarnation:
            env[CORE_FAULT_ENV] = None  # an injected Core fault strikes once
        if self.zygote is not None:
            read_fd, write_fd = os.pipe()
            try:
                pid = await self.zygote.spawn("core", argv, env, [core_end.fileno(), write_fd])
            finally:
                os.close(write_fd)
                core_end.close()
            output = asyncio.StreamReader()
            transport, _ = await asyncio.get_running_loop().connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(output), os.fdopen(read_fd, "rb")
            )
            exited = self.zygote.wait(pid)
        else:
            full = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "elaswave.runtime.core.process", *argv,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                env={**full, LINK_FD_ENV: str(core_end.fileno())},
                pass_fds=(core_end.fileno(),),
            )  # fmt: skip
            core_end.close()
            assert proc.stdout is not None
            pid, output, transport, exited = proc.pid, proc.stdout, None, proc.wait()
        (self.run_dir / CORE_PID).write_text(str(pid))
        relay = asyncio.create_task(_relay(output, core_log(self.run_dir, incarnation)))
        link = self._link = HostLink(host_end)
        await link.open({r: {"pid": p.pid, "code": self.codes[r]} for r, p in self.workers.items()})
        serving = asyncio.create_task(self._serve(link), name="host-requests")
        try:
            code = await exited
            await relay
            return code
        finally:
            serving.cancel()
            relay.cancel()
            for task in (serving, relay):
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if transport is not None:
                transport.close()
            link.close()
            self._link = None

    async def _serve(self, link: HostLink) -> None:
        async for request in link.requests():
            op, rank = request.get("op"), request.get("rank")
            if op == LinkOp.OBSERVE:
                if self.nodes is not None and self.store is not None:
                    # the Core has written job.json with the bus: follow the agents, then
                    # let them meet it (an agent that read the job before announced itself
                    # to no one: chaos seed 62207, case 14)
                    await self.nodes.start(JobSpec.read(self.run_dir))
                    self.store.set(JOB_KEY, (self.run_dir / JOB).read_text())
                if self.on_event is not None and self._observer is None:
                    self._observer = asyncio.create_task(self._observe(), name="host-observer")
                    await _first(self._observing.wait(), self._observer, OBSERVER_WAIT_S)
                link.send({"op": LinkOp.OBSERVING})
            elif not isinstance(rank, int):
                log.error("host.bad_core_request", request=request)
            elif op == LinkOp.SPAWN:
                try:
                    proc = await self._spawn(rank, join=bool(request["join"]))
                except (OSError, RuntimeError) as exc:
                    link.send({"op": LinkOp.SPAWN_FAILED, "rank": rank, "error": str(exc)})
                    continue
                self.workers[rank], self.codes[rank] = proc, None
                self._reapers.append(asyncio.create_task(self._reap(rank, proc)))
                link.send({"op": LinkOp.STARTED, "rank": rank, "pid": proc.pid})
            elif op == LinkOp.SIGNAL and rank in self.workers:
                if request["signal"] == signal.SIGTERM:  # sent away: the job is over
                    self.restarts.sent_away(rank)
                if self.codes[rank] is None:
                    with contextlib.suppress(ProcessLookupError):
                        self.workers[rank].send_signal(int(request["signal"]))
            else:
                log.error("host.bad_core_request", request=request)

    async def _spawn(self, rank: int, *, join: bool) -> Any:
        """Start worker ``rank``: on another host through its agent, forked by the
        zygote, or exec'd with its prefix."""
        if self.nodes is not None and (node := self.nodes.node_of(rank, join=join)) != 0:
            return await self.nodes.spawn(rank, node, join=join)
        return await start_worker(
            self.cfg, self.run_dir, rank, join=join, zygote=self.zygote, devices=self.devices
        )

    async def _reap(self, rank: int, proc: Any) -> None:
        code = await proc.wait()
        self.devices.release(rank)
        self.codes[rank] = code
        if self._link is not None:
            self._link.send({"op": LinkOp.EXITED, "rank": rank, "code": code})
        node = getattr(proc, "node", 0)
        up = node == 0 or (self.nodes is not None and not self.nodes.agents[node].lost)
        offer = self.restarts.exited(rank, code, node=node, host_up=up)
        if offer is not None:
            await self._offer(offer)

    async def _offer(self, offer: Offer) -> None:
        """Ask the Core for a worker in place of ``offer``'s unit, on its host."""
        log.warning("host.restart", rank=offer.unit, node=offer.node, count=offer.count,
                    of=offer.budget)  # fmt: skip
        if self.nodes is not None and offer.node != 0:
            self.nodes.offer(offer.node)
        async with self._offering:
            try:
                if self._offers is None:
                    ep = JobSpec.read(self.run_dir).endpoints
                    self._offers = BusClient(
                        RESTARTS_SENDER, ep.bus_publish, ep.bus_subscribe, topics=(),
                        keys=self.cfg.network.keys(),
                    )  # fmt: skip
                    await self._offers.connect()
                request = ScaleRequest(sender=RESTARTS_SENDER, add=1, reason=offer.reason)
                await self._offers.publish(request)
            except (BusError, OSError) as exc:  # the Core is down: the device stays idle
                self._offers = None
                log.error("host.restart_not_offered", rank=offer.unit, error=str(exc))

    async def _observe(self) -> None:
        """Feed ``on_event`` the observed events (whichever Core incarnation runs the bus)."""
        assert self.on_event is not None
        ep = JobSpec.read(self.run_dir).endpoints
        client = BusClient(  # the Core logs what fails to decode; no need to say it twice
            "host",
            ep.bus_publish,
            ep.bus_subscribe,
            topics=OBSERVED,
            keys=self.cfg.network.keys(),
            log_rejected=False,
        )
        await client.connect()
        self._observing.set()
        try:
            while True:
                event = await client.recv()
                try:
                    self.on_event(event)
                except Exception:
                    log.exception("host.on_event_failed", kind=str(event.KIND))
                if isinstance(event, RunFinished):
                    self._seen_finish.set()
        finally:
            await client.close()

    async def _stop_workers(self) -> None:
        self.restarts.ending = True
        for rank, proc in self.workers.items():
            if self.codes[rank] is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
        for task in self._reapers:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(task, 10.0)
        if self.nodes is not None:
            await self.nodes.close()
        if self._offers is not None:
            await self._offers.close()
        if self._observer is not None:
            # the last events (RunFinished) on their way
            await _first(self._seen_finish.wait(), self._observer, OBSERVER_WAIT_S)
            self._observer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._observer


OBSERVER_WAIT_S = 0.2
"""The longest the host waits for its observer to subscribe, or, at the end, to pass
the run's last event on (a job that failed has none)."""


async def _first(awaitable: Any, task: asyncio.Task[None], within_s: float) -> None:
    """Wait for ``awaitable``, for at most ``within_s``, or until ``task`` ends."""
    waiter = asyncio.ensure_future(awaitable)
    try:
        await asyncio.wait({waiter, task}, timeout=within_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()


async def _relay(stream: asyncio.StreamReader, path: Path) -> None:
    """The Core's log (JSON lines): to logs/coreN.log, and to this process's stderr as
    this process renders its own log (:func:`elaswave.logs.relay`)."""
    with path.open("wb") as out:
        async for line in stream:
            out.write(line)
            out.flush()
            logs.relay(line)


async def run_job(
    cfg: JobConfig,
    run_dir: Path,
    *,
    on_event: Callable[[Event], None] | None = None,
    zygote: Zygote | None = None,
    profile: LayerProfile | None = None,
) -> Summary:
    """Train ``cfg`` with dp x pp local worker processes; return the summary.

    This process is the job host: it serves the store and owns the workers; the Core
    runs in a child process (:mod:`elaswave.runtime.core.process`), restarted when lost.
    ``on_event`` sees every lifecycle, metrics and recovery event on the bus (not the
    heartbeats), in this process. ``zygote``: forks the
    Core without a second start-up of Python and torch (:mod:`elaswave.runtime.host.zygote`).
    ``profile``: the measurements ``cfg.profile`` was priced from, written to
    RUN_DIR/profile.json.
    """
    local = cfg.layout.ranks_per_node if cfg.layout.nnodes > 1 else cfg.layout.num_ranks
    check_capacity(backend_for(cfg.layout.device), local, cfg.layout.device)
    cfg.network.keys()  # a missing key stops the job here, before anything starts
    _prepare_run_dir(run_dir, resume_dir=cfg.state.resume_dir)
    if profile is not None:
        if profile.costs(cfg.cost_device) != cfg.profile:
            raise ValueError("the profile to write is not the one the job was priced with")
        (run_dir / PROFILE).write_text(json.dumps(profile.to_dict(), indent=1) + "\n")
    port = parse_endpoint(cfg.layout.rdzv_endpoint)[1] if cfg.layout.nnodes > 1 else 0
    store = serve_store(cfg.network.bus_host, port, timeout_s=cfg.liveness.comm_timeout_s)
    run_id = uuid.uuid4().hex[:12]
    JobSpec(  # the Core completes it with the bus endpoints, as RUN_DIR/job.json
        run_id=run_id,
        config=cfg,
        endpoints=Endpoints(
            store_host=cfg.network.bus_host, store_port=store.port, bus_publish="", bus_subscribe=""
        ),
    ).write(run_dir, HOST_SPEC)
    scalars = ScalarLog(run_dir)  # TensorBoard, beside summary.json

    def observe(event: Event) -> None:
        scalars(event)
        if on_event is not None:
            on_event(event)

    try:
        await JobHost(cfg, run_dir, observe, zygote, store).run()
    finally:
        scalars.close()
    return read_summary(run_dir)
