"""Node 0's view of the other hosts of a multi-host job: their agents over the bus.

A job of ``nnodes`` hosts runs one agent per host (:mod:`elaswave.runtime.host.nodeagent`),
as torchrun does; node 0's job host (:class:`~elaswave.runtime.host.launcher.JobHost`) also
runs the Core and the store. The Core asks the job host for workers by rank, as on one
host; :class:`RemoteNodes` starts those of other hosts through their agents
(:class:`~elaswave.bus.schema.SpawnWorker`) and hands the Core a process handle whose
exit is the agent's :class:`~elaswave.bus.schema.WorkerExited`. So the Core's change
protocol sees a remote worker exactly as a local one.

* **Place.** Worker ``r`` of the initial plan lives on node ``r // nproc_per_node``; a
  rank the Core adds goes to a host waiting for ranks (one that joined), else to node 0.
  With ``--tp N`` a rank is a TP group of N workers, kept on one host: a host of K slots
  offers K // N ranks.
* **A lost host.** An agent silent for the heartbeat timeout is lost with its host:
  every worker it ran is reported exited (``-SIGKILL``), so the Core answers a node
  failure, whichever of the workers' own signals (peers' broken links, their missing
  heartbeats) comes first.
* **A host that returns, or a new one.** An agent that announces itself
  (:class:`~elaswave.bus.schema.NodeJoined`) after the job started is offered to the
  Core as ``slots`` joining workers (a :class:`~elaswave.bus.schema.ScaleRequest`); the
  Core's join plan then starts them there.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from dataclasses import dataclass, field

import structlog

from elaswave.bus.client import BusClient
from elaswave.bus.schema import (
    NODES_SENDER,
    NodeHeartbeat,
    NodeJoined,
    ScaleRequest,
    SignalWorker,
    SpawnWorker,
    Topic,
    WorkerExited,
    WorkerSpawned,
)
from elaswave.runtime.job.config import JobConfig, JobSpec
from elaswave.runtime.job.hostlink import ProcessHandle

log = structlog.get_logger(__name__)

RENDEZVOUS_TIMEOUT_S = 300.0
"""How long node 0 waits for a host's agent before it gives up starting the job."""


class RemoteProcess(ProcessHandle):
    """A worker on another host, signalled through its agent."""

    def __init__(self, nodes: RemoteNodes, node: int, rank: int, pid: int) -> None:
        super().__init__(rank, pid)
        self._nodes = nodes
        self.node = node

    def _signal(self, signum: int) -> None:
        self._nodes.send(SignalWorker(sender="host", node=self.node, rank=self.rank, signal=signum))


@dataclass
class _Agent:
    node: int
    incarnation: str
    slots: int
    last_seen: float
    lost: bool = False
    ranks: set[int] = field(default_factory=set)


class RemoteNodes:
    """Node 0's link to the agents of hosts 1.. (see the module docstring)."""

    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg
        self.nproc = cfg.layout.ranks_per_node
        self.agents: dict[int, _Agent] = {}
        self.procs: dict[int, RemoteProcess] = {}
        self._registered: dict[int, asyncio.Event] = {}
        self._spawned: dict[int, asyncio.Future[WorkerSpawned]] = {}
        self._waiting_hosts: list[int] = []
        """One entry per place for a rank (a TP group: ``tp`` slots) of a host that
        joined after the start: who takes the Core's next joining ranks."""
        self._unit_nodes: dict[int, int] = {}
        """A joining TP group's host, while its members are being started."""
        self._client: BusClient | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._sending: set[asyncio.Task[object]] = set()
        """Publications under way (held: the loop keeps only weak references)."""

    def node_of(self, rank: int, *, join: bool) -> int:
        """The host worker ``rank`` starts on (0: this one). A joining TP group's
        members all start on the host its first member was given."""
        if not join and rank < self.cfg.layout.num_ranks:
            return rank // self.nproc
        unit, member = self.cfg.layout.unit_of(rank)
        node = self._unit_nodes.pop(unit, None) if member else None
        if node is None:
            node = self._waiting_hosts.pop(0) if self._waiting_hosts else 0
        if member + 1 < self.cfg.layout.tp:
            self._unit_nodes[unit] = node
        return node

    def offer(self, node: int) -> None:
        """``node``'s devices of a failed worker take the Core's next joining rank
        (:mod:`elaswave.runtime.host.restarts`)."""
        self._waiting_hosts.append(node)

    async def start(self, run_dir_spec: JobSpec) -> None:
        """Connect to the job's bus (the Core has bound it) and follow the agents."""
        ep = run_dir_spec.endpoints
        self._client = BusClient(
            NODES_SENDER, ep.bus_publish, ep.bus_subscribe, topics=(Topic.CONTROL, Topic.HEALTH),
            keys=self.cfg.network.keys(), log_rejected=False,
        )  # fmt: skip
        await self._client.connect()
        self._tasks = [
            asyncio.create_task(self._receive(), name="nodes-receive"),
            asyncio.create_task(self._watch(), name="nodes-watch"),
        ]

    def send(self, event: SignalWorker | SpawnWorker | ScaleRequest) -> None:
        assert self._client is not None, "the agents' bus is not connected"
        task = asyncio.get_running_loop().create_task(self._client.publish(event))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def spawn(self, rank: int, node: int, *, join: bool) -> RemoteProcess:
        """Start worker ``rank`` on ``node`` through its agent."""
        ready = self._registered.setdefault(node, asyncio.Event())
        try:
            await asyncio.wait_for(ready.wait(), RENDEZVOUS_TIMEOUT_S)
        except TimeoutError:
            raise RuntimeError(
                f"no agent of node {node} announced itself within {RENDEZVOUS_TIMEOUT_S:.0f} s "
                f"(start `elaswave run --node-rank {node} ...` on that host)"
            ) from None
        agent = self.agents[node]
        reply = self._spawned[rank] = asyncio.get_running_loop().create_future()
        self.send(SpawnWorker(sender="host", node=node, incarnation=agent.incarnation,
                              rank=rank, join=join))  # fmt: skip
        try:
            started = await asyncio.wait_for(reply, RENDEZVOUS_TIMEOUT_S)
        finally:
            self._spawned.pop(rank, None)
        if started.error:
            raise RuntimeError(f"node {node} could not start rank {rank}: {started.error}")
        proc = self.procs[rank] = RemoteProcess(self, node, rank, started.pid)
        agent.ranks.add(rank)
        return proc

    async def _receive(self) -> None:
        assert self._client is not None
        while True:
            event = await self._client.recv()
            match event:
                case NodeJoined():
                    self._joined(event)
                case NodeHeartbeat(node=node, incarnation=inc):
                    agent = self.agents.get(node)
                    if agent is not None and agent.incarnation == inc and not agent.lost:
                        agent.last_seen = time.monotonic()
                case WorkerSpawned(rank=rank):
                    future = self._spawned.get(rank)
                    if future is not None and not future.done():
                        future.set_result(event)
                case WorkerExited(rank=rank, code=code, node=node):
                    proc = self.procs.get(rank)
                    if proc is not None and proc.node == node:
                        proc.exited(code)

    def _joined(self, event: NodeJoined) -> None:
        old = self.agents.get(event.node)
        if old is not None and old.incarnation == event.incarnation:
            return  # a repeat
        self.agents[event.node] = _Agent(
            event.node, event.incarnation, event.slots, last_seen=time.monotonic()
        )
        if old is not None and not old.lost:
            self._lose(old, "it started again")
        self._registered.setdefault(event.node, asyncio.Event()).set()
        log.warning("host.node_joined", node=event.node, host=event.host, slots=event.slots)
        if event.node < self.cfg.layout.nnodes and old is None:
            return  # a host of the first plan: the Core asks for its ranks
        units = event.slots // self.cfg.layout.tp
        if units < 1:
            log.error("host.node_too_small", node=event.node, slots=event.slots,
                      tp=self.cfg.layout.tp)  # fmt: skip
            return
        self._waiting_hosts.extend([event.node] * units)
        self.send(ScaleRequest(sender="host", add=units,
                               reason=f"host {event.node} ({event.host}) joined"))  # fmt: skip

    def _lose(self, agent: _Agent, why: str) -> None:
        agent.lost = True
        log.warning("host.node_lost", node=agent.node, why=why, ranks=sorted(agent.ranks))
        for rank in agent.ranks:
            self.procs[rank].exited(-signal.SIGKILL)

    async def _watch(self) -> None:
        timeout = self.cfg.liveness.heartbeat_timeout_s
        while True:
            await asyncio.sleep(min(0.1, timeout / 4))
            now = time.monotonic()
            for agent in list(self.agents.values()):
                if not agent.lost and now - agent.last_seen > timeout:
                    self._lose(agent, f"no heartbeat for {now - agent.last_seen:.1f} s")

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._client is not None:
            await self._client.close()
