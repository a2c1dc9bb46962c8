"""The agent of one host (node 1, 2, ...) of a multi-host job.

``elaswave run --nnodes N --node-rank R --rdzv-endpoint HOST:PORT --nproc-per-node K``
on a host other than node 0 runs this: it meets node 0 at the store it serves on
HOST:PORT, takes the job's spec from it (written into this host's run directory, where
its workers read it), joins the job's bus, announces its ``K`` slots
(:class:`~elaswave.bus.schema.NodeJoined`) and its heartbeat, and owns the workers node
0's job host asks it for: it starts them, signals them, and reports their exits. Its
workers die with it (they hold ``PR_SET_PDEATHSIG``), so killing an agent is losing its
host. It leaves when the run has finished and its workers have exited.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import uuid
from pathlib import Path

import structlog

from elaswave import rundir
from elaswave.bus.client import BusClient
from elaswave.bus.keys import load_keys
from elaswave.bus.schema import (
    CORE_SENDER,
    NODES_SENDER,
    NodeHeartbeat,
    NodeJoined,
    RunFinished,
    SignalWorker,
    SpawnWorker,
    Topic,
    WorkerExited,
    WorkerSpawned,
)
from elaswave.comm.backend import backend_for, check_capacity
from elaswave.comm.store import connect_store
from elaswave.runtime.host.workers import start_worker
from elaswave.runtime.host.zygote import ForkedProcess, Zygote
from elaswave.runtime.job.config import JobConfig, JobSpec
from elaswave.runtime.job.localrank import LocalRanks

log = structlog.get_logger(__name__)

AGENT_TOPICS = (Topic.CONTROL, Topic.LIFECYCLE)
AGENT_SENDERS = (CORE_SENDER, NODES_SENDER)
"""Whose messages an agent takes: node 0's job host asks it for workers
(SpawnWorker, SignalWorker, from :data:`~elaswave.bus.schema.NODES_SENDER`), the
Core ends the run (RunFinished). Taking the Core's alone, an agent never heard a
request, and no worker started on another host."""

JOB_KEY = "elaswave/job"
"""The store key under which node 0 publishes RUN_DIR/job.json for the other hosts."""


class RendezvousFailed(RuntimeError):
    """Node 0 did not serve the job at the agent's ``--rdzv-endpoint`` in time: it is not
    running there, is not reachable, or refused its job before serving it."""


def parse_endpoint(text: str) -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port); ValueError naming the value."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--rdzv-endpoint {text!r}: expected HOST:PORT, e.g. 10.0.0.1:29500")
    return host, int(port)


async def run_agent(
    run_dir: Path,
    *,
    node: int,
    slots: int | None,
    endpoint: str,
    keys_dir: str | None,
    zygote: Zygote | None = None,
    timeout_s: float = 300.0,
) -> int:
    """Serve as node ``node``'s agent until the run finishes; 0 when it finished well.
    ``slots``: the workers this host offers (None: the job's ``--nproc-per-node``).
    ``zygote``: forks this host's workers (:mod:`elaswave.runtime.host.workers`).
    RendezvousFailed when node 0 has not served the job within ``timeout_s``;
    ValueError naming the flag when this host cannot run the workers it offers."""
    host, port = parse_endpoint(endpoint)
    unserved = RendezvousFailed(
        f"node 0 did not serve the job at {endpoint} within {timeout_s:g} s: is node 0's "
        "`elaswave train` running there and reachable, and did it accept its job?"
    )
    if not await asyncio.to_thread(_reachable, host, port, timeout_s):
        raise unserved
    try:
        store = await asyncio.to_thread(connect_store, host, port, timeout_s=timeout_s)
        text = (await asyncio.to_thread(store.get, JOB_KEY)).decode()
    except RuntimeError:  # torch's DistNetworkError, DistStoreError: node 0 went away
        raise unserved from None
    spec = _take_spec(run_dir, text, node)
    slots = host_slots(spec.config, node, slots)
    ep = spec.endpoints
    keys = load_keys(Path(keys_dir)) if keys_dir else spec.config.network.keys()
    client = BusClient(
        f"node{node}", ep.bus_publish, ep.bus_subscribe,
        topics=AGENT_TOPICS, senders=AGENT_SENDERS, keys=keys,
        log_rejected=False,
    )  # fmt: skip
    await client.connect()
    agent = _Agent(
        spec.config, run_dir, node=node, client=client, zygote=zygote, devices=LocalRanks(slots)
    )
    beating = asyncio.create_task(agent.heartbeat(), name="node-heartbeat")
    joined = NodeJoined(
        sender=client.sender, node=node, slots=slots, incarnation=agent.incarnation,
        host=socket.gethostname(),
    )  # fmt: skip
    await client.publish(joined)
    log.warning("agent.joined", node=node, slots=slots, run_id=spec.run_id)
    try:
        return 0 if await agent.serve() else 1
    finally:
        agent.kill_workers()
        beating.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beating
        await client.close()


class _Agent:
    """This host's side of the job: its workers, started and signalled as node 0 asks,
    their exits reported, and its heartbeat."""

    def __init__(
        self,
        cfg: JobConfig,
        run_dir: Path,
        *,
        node: int,
        client: BusClient,
        zygote: Zygote | None,
        devices: LocalRanks,
    ) -> None:
        self.cfg, self.run_dir, self.node = cfg, run_dir, node
        self.client, self.zygote = client, zygote
        self.devices = devices
        """This host's devices and the workers holding them."""
        self.incarnation = uuid.uuid4().hex[:12]
        self.procs: dict[int, asyncio.subprocess.Process | ForkedProcess] = {}
        self.reapers: list[asyncio.Task[None]] = []

    async def heartbeat(self) -> None:
        beat = NodeHeartbeat(
            sender=self.client.sender, node=self.node, incarnation=self.incarnation
        )
        while True:
            await self.client.publish(beat)
            await asyncio.sleep(self.cfg.liveness.heartbeat_interval_s)

    async def serve(self) -> bool:
        """Answer node 0's requests until the run finishes; whether it finished well.
        The workers leave on their own once the run is over: wait for them."""
        while True:
            match await self.client.recv():
                case SpawnWorker(node=n, incarnation=inc, rank=rank, join=join) if (
                    n == self.node and inc == self.incarnation
                ):
                    await self._spawn(rank, join=join)
                case SignalWorker(node=n, rank=rank, signal=signum) if n == self.node:
                    self._signal(rank, signum)
                case RunFinished(ok=ok):
                    break
        for task in self.reapers:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), 30.0)
        return ok

    async def _spawn(self, rank: int, *, join: bool) -> None:
        sender, node = self.client.sender, self.node
        try:
            proc = await start_worker(
                self.cfg, self.run_dir, rank, join=join, zygote=self.zygote, devices=self.devices
            )
        except OSError as exc:
            await self.client.publish(
                WorkerSpawned(sender=sender, node=node, rank=rank, error=str(exc))
            )
            return
        self.procs[rank] = proc
        self.reapers.append(asyncio.create_task(self._reap(rank, proc)))
        await self.client.publish(WorkerSpawned(sender=sender, node=node, rank=rank, pid=proc.pid))

    async def _reap(self, rank: int, proc: asyncio.subprocess.Process | ForkedProcess) -> None:
        code = await proc.wait()
        self.devices.release(rank)
        exited = WorkerExited(sender=self.client.sender, node=self.node, rank=rank, code=code)
        await self.client.publish(exited)

    def _signal(self, rank: int, signum: int) -> None:
        target = self.procs.get(rank)
        if target is not None and target.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                target.send_signal(signum)

    def kill_workers(self) -> None:
        for proc in self.procs.values():
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()


def host_slots(cfg: JobConfig, node: int, slots: int | None) -> int:
    """The workers this host offers (``--nproc-per-node``; None: the job's): a host of
    the first plan runs the job's number, a host that joins later any number of whole
    tensor-parallel groups; each needs a device of its own where the job's device has
    them."""
    lay = cfg.layout
    if node < lay.nnodes and slots not in (None, lay.ranks_per_node):
        raise ValueError(
            f"--nproc-per-node {slots} on node {node}: the job places "
            f"{lay.ranks_per_node} workers on each of its first {lay.nnodes} hosts; use "
            f"--nproc-per-node {lay.ranks_per_node} (or leave it out) on this host"
        )
    offered = lay.ranks_per_node if slots is None else slots
    if offered % lay.tp:
        whole = max(lay.tp, offered // lay.tp * lay.tp)
        raise ValueError(
            f"--nproc-per-node {offered} on node {node}: the job's tensor-parallel groups "
            f"are {lay.tp} workers, each on one host, so a host offers a multiple of "
            f"{lay.tp} workers; use --nproc-per-node {whole}"
        )
    check_capacity(backend_for(lay.device), offered, str(lay.device))
    return offered


def _reachable(host: str, port: int, timeout_s: float) -> bool:
    """Whether node 0's store accepts a connection within ``timeout_s``: waited for
    here, where torch's store client logs a C++ backtrace for every retry."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.5)


def _take_spec(run_dir: Path, text: str, node: int) -> JobSpec:
    """Write node 0's job.json into this host's run directory (where a shared run
    directory holds it already, leave it), and read it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / rundir.LOGS).mkdir(exist_ok=True)
    path = run_dir / rundir.JOB
    if not path.is_file() or path.read_text() != text:
        tmp = path.with_suffix(f".{node}.tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return JobSpec.read(run_dir)
