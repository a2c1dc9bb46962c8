"""Process-group backends by device: gloo (cpu), nccl (cuda), hccl (npu via torch_npu).

Groups are built directly from a store, never through torch's global default group, so
that any number of them coexist and a membership change can replace exactly the ones it
touches. torch_npu is imported only when an npu backend is asked for.
"""

from __future__ import annotations

import importlib
import os
import socket
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from elaswave.comm.spec import Device, parse_device


class GroupBackend(Protocol):
    """Creates one process group over ``size`` members from a (prefixed) store."""

    name: str

    def create(
        self, store: dist.Store, rank: int, size: int, timeout: timedelta
    ) -> dist.ProcessGroup: ...

    def device_for(self, local_rank: int) -> torch.device: ...

    def devices(self) -> int | None:
        """Accelerators one host offers its ranks (one rank each); None: no limit."""
        ...


class GlooBackend:
    name = "gloo"

    def create(
        self, store: dist.Store, rank: int, size: int, timeout: timedelta
    ) -> dist.ProcessGroup:
        # torch's stubs declare ProcessGroupGloo a bare Backend, without the collective
        # and point-to-point methods it has at runtime (and that Group calls).
        return dist.ProcessGroupGloo(store, rank, size, timeout)  # type: ignore[return-value]

    def device_for(self, local_rank: int) -> torch.device:
        return torch.device("cpu")

    def devices(self) -> int | None:
        return None


class NcclBackend:
    name = "nccl"

    def create(
        self, store: dist.Store, rank: int, size: int, timeout: timedelta
    ) -> dist.ProcessGroup:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)  # type: ignore[return-value]  # as gloo

    def device_for(self, local_rank: int) -> torch.device:
        device = torch.device("cuda", _one_each(local_rank, self.devices(), "CUDA"))
        torch.cuda.set_device(device)
        return device

    def devices(self) -> int | None:
        return torch.cuda.device_count()


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
        device = torch.device("npu", _one_each(local_rank, self.devices(), "NPU"))
        self._torch_npu.npu.set_device(device)
        return device

    def devices(self) -> int | None:
        return int(self._torch_npu.npu.device_count())


SHARE_DEVICE_ENV = "ELASWAVE_SHARE_DEVICE"
"""Set to ``1`` to let several ranks of one host share an accelerator, for testing only
(``scripts/gpu_check`` on a machine with fewer GPUs than ranks). NCCL refuses two ranks
of a group on one device unless each process claims a host of its own, so every worker
then sets a distinct ``NCCL_HOSTID`` and NCCL's test-only transport: ``NCCL_P2P_DISABLE=1``,
``NCCL_SHM_DISABLE=1``, ``NCCL_NET=Socket`` (:func:`_as_own_host`). Slow, and never for
training: without it a rank with no device of its own is refused."""


def sharing_devices() -> bool:
    """Whether :data:`SHARE_DEVICE_ENV` opts this process into sharing a device."""
    value = os.environ.get(SHARE_DEVICE_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{SHARE_DEVICE_ENV}={value!r}: expected 1 (share) or 0 (one each)")
    return value == "1"


def _as_own_host(local_rank: int) -> None:
    """NCCL's test-only mode for a rank that shares its device: its own host identity
    (so NCCL does not see a duplicate GPU) and only the socket transport between ranks."""
    os.environ["NCCL_HOSTID"] = f"{socket.gethostname()}-elaswave-rank{local_rank}"
    os.environ.update(NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1", NCCL_NET="Socket")


def _one_each(local_rank: int, count: int | None, what: str) -> int:
    """The device index of ``local_rank``: NCCL and HCCL refuse two ranks of one group
    on the same device ("Duplicate GPU detected"), so ranks never share one, unless
    :data:`SHARE_DEVICE_ENV` opts in: then ranks take the devices in turn, and each
    process is its own NCCL host."""
    if sharing_devices() and count:
        _as_own_host(local_rank)
        return local_rank % count
    if count is None or local_rank < count:
        return local_rank
    raise ValueError(
        f"local rank {local_rank} has no {what} device of its own: this host has {count}, "
        f"and each rank needs one (testing only: {SHARE_DEVICE_ENV}=1 shares them)"
    )


def check_capacity(backend: GroupBackend, ranks: int, device: str) -> None:
    """Refuse, before anything starts, a job that puts more ranks on this host than it
    has accelerators (otherwise the first collective fails a minute in), unless
    :data:`SHARE_DEVICE_ENV` opts in to sharing them."""
    count = backend.devices()
    if count is not None and ranks > count and not (count and sharing_devices()):
        raise ValueError(
            f"--device {device}: {ranks} ranks on this host but it has {count} "
            f"{device} device(s), one per rank needed (dp x pp <= {count}; --device cpu or "
            f"emulated runs any number; testing only: {SHARE_DEVICE_ENV}=1 shares them)"
        )


def backend_for(device: Device | str) -> GroupBackend:
    device = parse_device(str(device))
    if device in (Device.CPU, Device.EMULATED):
        return GlooBackend()
    if device is Device.CUDA:
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' asked for, but torch sees no CUDA device")
        return NcclBackend()
    return HcclBackend()
