"""Every worker a host starts is told which of the host's devices is its own
(``LOCAL_RANK``): the lowest no running worker of the host holds, so a replacement or a
joiner takes a freed device, not the device of its process rank (which the host may
not have). A joining TP group's members start together on one joined host."""

from __future__ import annotations

import asyncio
import shlex

import pytest

from elaswave.bus.schema import NodeJoined, ScaleRequest
from elaswave.runtime.host.nodes import RemoteNodes
from elaswave.runtime.host.workers import start_worker
from elaswave.runtime.job.config import JobConfig
from elaswave.runtime.job.localrank import (
    LOCAL_RANK_ENV,
    LOCAL_WORLD_SIZE_ENV,
    LocalRanks,
    local_rank_of,
)


def test_a_worker_takes_the_lowest_free_device_and_gives_it_back_when_it_exits() -> None:
    devices = LocalRanks(4)
    assert [devices.take(r) for r in range(4)] == [0, 1, 2, 3]
    devices.release(1)
    devices.release(3)
    assert devices.take(9) == 1  # a replacement: rank 9 on an 4-device host takes device 1
    assert devices.take(9) == 1  # asked again: the same
    assert devices.env(10) == {LOCAL_RANK_ENV: "3", LOCAL_WORLD_SIZE_ENV: "4"}
    assert devices.take(11) == 4  # every device held: the backend refuses it, naming both
    assert devices.held == {0: 0, 2: 2, 9: 1, 10: 3, 11: 4}
    devices.release(7)  # never held: nothing
    with pytest.raises(ValueError, match="a host's devices = 0: must be at least 1"):
        LocalRanks(0)


def test_a_workers_local_rank_is_its_hosts_word_else_its_process_rank() -> None:
    assert local_rank_of(5, {LOCAL_RANK_ENV: "1"}) == 1
    assert local_rank_of(5, {}) == 5
    for bad in ("-1", "one"):
        with pytest.raises(ValueError, match=f"LOCAL_RANK={bad!r}: must be a non-negative"):
            local_rank_of(5, {LOCAL_RANK_ENV: bad})


def test_a_worker_that_could_not_start_gives_its_device_back(tmp_path) -> None:
    cfg = JobConfig.from_dict({"layout": {"worker_prefix": "/nonexistent/launcher"}})
    (tmp_path / "logs").mkdir()
    devices = LocalRanks(2)
    with pytest.raises(FileNotFoundError, match="/nonexistent/launcher"):
        asyncio.run(start_worker(cfg, tmp_path, 0, join=False, zygote=None, devices=devices))
    assert devices.held == {}


def test_a_started_worker_is_told_its_device(tmp_path) -> None:
    """The exec'd worker's environment carries LOCAL_RANK and LOCAL_WORLD_SIZE (a prefix
    that prints them stands in for the worker)."""
    show = shlex.join(["sh", "-c", "echo $LOCAL_RANK $LOCAL_WORLD_SIZE"])
    cfg = JobConfig.from_dict({"layout": {"worker_prefix": show}})
    (tmp_path / "logs").mkdir()
    devices = LocalRanks(3)
    devices.take(0)

    async def go() -> int:
        proc = await start_worker(cfg, tmp_path, 4, join=True, zygote=None, devices=devices)
        return await proc.wait()

    assert asyncio.run(go()) == 0
    assert (tmp_path / "logs" / "rank4.log").read_text().split() == ["1", "3"]


def _nodes(tp: int) -> tuple[RemoteNodes, list[ScaleRequest]]:
    layout = {"dp": 1, "pp": 2, "tp": tp, "nnodes": 2, "ranks_per_node": tp}
    cfg = JobConfig.from_dict({"layout": {**layout, "rdzv_endpoint": "127.0.0.1:1"}})
    nodes = RemoteNodes(cfg)
    sent: list[ScaleRequest] = []
    nodes.send = sent.append  # type: ignore[method-assign,assignment]
    return nodes, sent


def _join(nodes: RemoteNodes, node: int, slots: int) -> None:
    nodes._joined(NodeJoined(sender="", node=node, slots=slots, incarnation=f"i{node}", host="h"))


def test_a_joined_host_offers_whole_tp_groups_and_each_starts_on_one_host() -> None:
    nodes, sent = _nodes(tp=2)
    assert [nodes.node_of(r, join=False) for r in range(4)] == [0, 0, 1, 1]
    _join(nodes, 1, 2)  # a host of the first plan: the Core asks for its ranks
    _join(nodes, 2, 5)  # a new host of five slots: two TP groups of two
    _join(nodes, 3, 1)  # too small for a TP group: offers none
    assert [(s.add, s.reason) for s in sent] == [(2, "host 2 (h) joined")]
    # plan ranks 2 and 3 join: workers 4, 5 and 6, 7; a third group goes to node 0
    assert [nodes.node_of(r, join=True) for r in (4, 6, 5, 7, 8, 9)] == [2, 2, 2, 2, 0, 0]


def test_without_tp_a_joined_host_offers_a_rank_a_slot() -> None:
    nodes, sent = _nodes(tp=1)
    _join(nodes, 1, 1)
    _join(nodes, 2, 2)
    assert [s.add for s in sent] == [2]
    assert [nodes.node_of(r, join=True) for r in (2, 3, 4)] == [2, 2, 0]
