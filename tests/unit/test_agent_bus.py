"""A host's agent hears what node 0 asks of it: its bus takes the requests' sender."""

from __future__ import annotations

import asyncio

import pytest

from elaswave.bus.broker import Broker
from elaswave.bus.client import BusClient
from elaswave.bus.schema import CORE_SENDER, NODES_SENDER, RunFinished, SignalWorker, SpawnWorker
from elaswave.runtime.host.nodeagent import AGENT_SENDERS, AGENT_TOPICS

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
