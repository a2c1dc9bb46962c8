"""A host's agent hears what node 0 asks of it (its bus takes the requests' sender), and
says so in one line when node 0 never serves it."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import pytest

from elaswave.bus.broker import Broker
from elaswave.bus.client import BusClient
from elaswave.bus.schema import CORE_SENDER, NODES_SENDER, RunFinished, SignalWorker, SpawnWorker
from elaswave.cli.main import main
from elaswave.runtime.host import nodeagent
from elaswave.runtime.host.nodeagent import AGENT_SENDERS, AGENT_TOPICS, RendezvousFailed, run_agent

pytestmark = pytest.mark.timeout(30)


def test_an_agent_hears_node_zeros_requests_and_the_cores_end_of_the_run() -> None:
    """node 0's view of the hosts asks an agent to start and signal workers, the Core
    ends the run: the agent's subscription takes all three (taking the Core's alone,
    no worker ever started on another host), and not a worker's messages."""

    async def go() -> list[object]:
        with Broker() as broker:
            ends = broker.publish_endpoint, broker.subscribe_endpoint
            async with (
                BusClient("node1", *ends, topics=AGENT_TOPICS, senders=AGENT_SENDERS) as agent,
                BusClient(NODES_SENDER, *ends) as nodes,
                BusClient(CORE_SENDER, *ends) as core,
                BusClient("rank0", *ends) as worker,
            ):
                await worker.publish(SignalWorker(sender="", node=1, rank=9, signal=15))
                await nodes.publish(SpawnWorker(sender="", node=1, incarnation="a", rank=2))
                await nodes.publish(SignalWorker(sender="", node=1, rank=2, signal=15))
                await core.publish(RunFinished(sender="", steps_completed=3, ok=True))
                return [await asyncio.wait_for(agent.recv(), 10) for _ in range(3)]

    got = {type(e): e for e in asyncio.run(go())}  # two senders: in either order
    assert set(got) == {SpawnWorker, SignalWorker, RunFinished}
    assert got[SignalWorker].rank == 2  # the worker's message was not taken


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])  # closed again: nothing listens there


def test_an_agent_whose_node_0_never_serves_says_so_without_a_backtrace(capfd) -> None:
    """Node 0 not running there (or it refused its job before serving it): the agent
    gives up at its timeout naming the endpoint, and torch's store client, which logs
    a C++ backtrace for every retry, is not asked before node 0's port answers."""
    endpoint = f"127.0.0.1:{_closed_port()}"
    started = time.monotonic()
    with pytest.raises(RendezvousFailed, match=f"node 0 did not serve the job at {endpoint}"):
        asyncio.run(
            run_agent(Path("/nonexistent"), node=1, slots=1, endpoint=endpoint, keys_dir=None,
                      timeout_s=1.0)
        )  # fmt: skip
    assert time.monotonic() - started < 10
    assert "frame #" not in capfd.readouterr().err


def test_elaswave_says_in_one_line_that_node_0_did_not_serve(monkeypatch, capsys) -> None:
    monkeypatch.setattr(nodeagent, "_reachable", lambda host, port, timeout_s: False)
    argv = ["train", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "127.0.0.1:9"]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "elaswave: node 1 agent: node 0 did not serve the job at 127.0.0.1:9 within 300 s: "
        "is node 0's `elaswave train` running there and reachable, and did it accept its job?"
    ]


def test_a_host_offers_the_jobs_workers_or_is_told_the_number_in_one_line(monkeypatch) -> None:
    """A host of the first plan runs the job's --nproc-per-node (left out: the job's),
    a host joining later any number of whole TP groups; a host without the job's devices
    is refused."""
    from elaswave.runtime.job.config import JobConfig

    layout = {"dp": 2, "pp": 2, "nnodes": 2, "ranks_per_node": 2, "rdzv_endpoint": "h:1"}
    cfg = JobConfig.from_dict({"layout": layout})
    assert [nodeagent.host_slots(cfg, 1, s) for s in (None, 2)] == [2, 2]
    assert nodeagent.host_slots(cfg, 2, 5) == 5  # a new host
    with pytest.raises(ValueError, match=r"^--nproc-per-node 3 on node 1: the job places 2 "):
        nodeagent.host_slots(cfg, 1, 3)
    tp = JobConfig.from_dict({"layout": {**layout, "tp": 2, "ranks_per_node": 4}})
    assert [nodeagent.host_slots(tp, 2, s) for s in (None, 2, 6)] == [4, 2, 6]
    for slots, use in ((1, 2), (3, 2), (5, 4)):  # a joining host offers whole TP groups
        with pytest.raises(ValueError, match=rf"^--nproc-per-node {slots} on node 2: .*groups "
                           rf"are 2 workers, .*; use --nproc-per-node {use}$"):  # fmt: skip
            nodeagent.host_slots(tp, 2, slots)
    cuda = JobConfig.from_dict({"layout": {**layout, "device": "cuda"}})
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)  # a host without GPUs
    with pytest.raises(ValueError, match="torch sees no CUDA device"):
        nodeagent.host_slots(cuda, 1, None)
