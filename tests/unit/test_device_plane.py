"""Training traffic is device-resident: what reaches a device-plane operation (the DP
reduce-scatter, the loss reduction, the TP all-gather) lives on the parameters' device,
never in host memory, which NCCL refuses.

The device here is ``meta``: a tensor allocated without a device lands on the CPU
instead, and a ``.cpu()`` of a meta tensor raises, so each test fails where a buffer
leaves the device."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import pytest
import torch
from torch import nn

from elaswave.comm.group import DONE, CollectiveGroup, CollectiveWork
from elaswave.fabric.adamw import OptimizerConfig
from elaswave.fabric.zero import ZeroAdamW
from elaswave.runtime.worker.pipeline import LossSum
from elaswave.runtime.worker.tpgroup import TpLink, whole_param

pytestmark = pytest.mark.timeout(30)

META = torch.device("meta")


@dataclass
class RecordingGroup:
    """A collective group of ``size`` members that records the tensors it is handed."""

    size: int
    seen: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    name: str = "dp.s0"
    tainted: bool = False

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self.seen.append(("all_reduce", tensor))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self.seen += [("reduce_scatter", output), ("reduce_scatter", input)]

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self.seen += [("all_gather", output), ("all_gather", input)]

    def reduce_scatter_async(self, output: torch.Tensor, input: torch.Tensor) -> CollectiveWork:
        self.reduce_scatter(output, input)
        return DONE

    def all_gather_async(self, output: torch.Tensor, input: torch.Tensor) -> CollectiveWork:
        self.all_gather(output, input)
        return DONE

    def barrier(self) -> None:
        return None


def test_the_reduce_scatter_output_is_on_the_parameters_device() -> None:
    layers = [nn.Linear(6, 4, device=META), nn.Linear(4, 3, device=META)]
    group = RecordingGroup(size=2)
    opt = ZeroAdamW(
        layers,
        layer_ids=[0, 1],
        dp_group=cast("CollectiveGroup", group),
        replica=0,
        cfg=OptimizerConfig(),
    )
    opt.zero_grad()
    shard = opt.reduce_scatter_grads()
    assert shard.device == META
    assert [op for op, _ in group.seen] == ["reduce_scatter"] * 4
    assert all(t.device == META for _, t in group.seen)


def test_the_loss_sum_stays_on_the_device_until_read_after_its_reduction() -> None:
    loss = LossSum(META)
    for _ in range(3):  # a micro-batch's .cpu() would raise here
        loss.add(torch.ones(4, device=META))
    group = RecordingGroup(size=2)
    loss.reduce(cast("CollectiveGroup", group))
    [(op, reduced)] = group.seen
    assert op == "all_reduce" and reduced.device == META and reduced.dtype == torch.float64


def test_the_loss_sum_is_float64_and_exact_on_cpu() -> None:
    loss = LossSum(torch.device("cpu"))
    for value in (0.1, 0.2, 0.3):
        loss.add(torch.tensor([value], dtype=torch.float32))
    expected = torch.zeros(1, dtype=torch.float64)
    for value in (0.1, 0.2, 0.3):
        expected += torch.tensor([value], dtype=torch.float32).double().sum()
    assert loss.value() == float(expected)


class RecordingTp:
    """A TP link of two members that records what its all-gather is handed."""

    size = 2

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self.seen += [output, input]


def test_the_tp_all_gather_of_a_whole_parameter_runs_on_the_device() -> None:
    tp = RecordingTp()
    whole = whole_param("attn.wq.weight", torch.empty(4, 8, device=META), cast("TpLink", tp))
    assert whole.device == META
    assert len(tp.seen) == 2 and all(t.device == META for t in tp.seen)
