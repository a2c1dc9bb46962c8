"""Process-group backends by device: gloo (cpu), nccl (cuda), hccl (npu via torch_npu).

Groups are built directly from a store, never through torch's global default group, so
that any number of them coexist and a membership change can replace exactly the ones it
touches. torch_npu is imported only when an npu backend is asked for.
"""

from __future__ import annotations

import enum
import importlib
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist


class Device(enum.StrEnum):
    CPU = "cpu"
    CUDA = "cuda"
    NPU = "npu"
    EMULATED = "emulated"
    """CPU processes over gloo that keep the time of a modelled accelerator."""


DEVICES = tuple(d.value for d in Device)


def parse_device(value: str) -> Device:
    try:
        return Device(value)
    except ValueError:
        raise ValueError(f"unknown device {value!r}; valid devices: {', '.join(DEVICES)}") from None


class GroupBackend(Protocol):
    """Creates one process group over ``size`` members from a (prefixed) store."""

    name: str

    def create(
        self, store: dist.Store, rank: int, size: int, timeout: timedelta
    ) -> dist.ProcessGroup: ...

    def device_for(self, local_rank: int) -> torch.device: ...


class GlooBackend:
    name = "gloo"

    def create(
        self, store: dist.Store, rank: int, size: int, timeout: timedelta
    ) -> dist.ProcessGroup:
        return dist.ProcessGroupGloo(store, rank, size, timeout)

    def device_for(self, local_rank: int) -> torch.device:
        return torch.device("cpu")


class NcclBackend:
    name = "nccl"

    def create(
        self, store: dist.Store, rank: int, size: int, timeout: timedelta
    ) -> dist.ProcessGroup:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)

    def device_for(self, local_rank: int) -> torch.device:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device


class HcclBackend:
    """Ascend NPUs. Written against torch_npu's documented API; needs CANN at run time."""

    name = "hccl"

    def __init__(self) -> None:
        try:
            self._torch_npu = importlib.import_module("torch_npu")
        except Exception as exc:  # ImportError, or OSError when CANN's libhccl.so is missing
            raise ValueError(
                f"device 'npu' needs torch_npu with Ascend CANN installed ({exc}); "
                "use --device cpu or cuda on this machine"
            ) from None

    def create(
        self, store: dist.Store, rank: int, size: int, timeout: timedelta
    ) -> dist.ProcessGroup:
        c10d = self._torch_npu._C._distributed_c10d
        opts = c10d.ProcessGroupHCCL.Options()
        opts._timeout = timeout
        return c10d.ProcessGroupHCCL(store, rank, size, opts)

    def device_for(self, local_rank: int) -> torch.device:
        device = torch.device("npu", local_rank % self._torch_npu.npu.device_count())
        self._torch_npu.npu.set_device(device)
        return device


def backend_for(device: Device | str) -> GroupBackend:
    device = parse_device(str(device))
    if device in (Device.CPU, Device.EMULATED):
        return GlooBackend()
    if device is Device.CUDA:
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' asked for, but torch sees no CUDA device")
        return NcclBackend()
    return HcclBackend()
