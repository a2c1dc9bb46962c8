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

import structlog
import torch
import torch.distributed as dist

from elaswave.comm.spec import Device, parse_device
from elaswave.comm.strict import StrictBackend

log = structlog.get_logger(__name__)

NCCL_ENV = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    "TORCH_NCCL_BLOCKING_WAIT": "0",
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "100",
    "NCCL_NVLS_ENABLE": "0",
}
"""What torch's NCCL watchdog may do, as ElasWave sets it before any communicator is
made. torch's default (``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``) tears the process down when
an operation outlives the group timeout, which a survivor's parked operation does while
the Core plans a recovery; ElasWave instead bounds every wait itself and aborts the
communicators a failure stalls (:mod:`elaswave.comm.release`), so the watchdog handles
no error (``0``) and its heartbeat monitor, which kills a process whose watchdog is
stuck, is off. After seeing a failed operation the watchdog waits four times
``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC`` (15 s by default) for a debug dump that nothing
writes here, and destroying its process group (a group a recovery dropped) waits for
the watchdog: 0.4 s instead of a training thread stalled for a minute. NVLS (NVLink
SHARP) communicators are off because they make an abort slow
(nvidia-resiliency-ext turns them off for in-process restarts too). A different value a
user set is overridden, with a warning. (``NCCL_RUNTIME_CONNECT=0``, which would connect
a communicator's collectives when it is created rather than inside its first collective,
was tried on one H200 with eight ranks sharing it: every rank went silent for over 2 s
while its communicators connected, and the Core fenced them all; docs/gpu_check.md.)"""


NCCL_DEFAULT_ENV = {"NCCL_SET_THREAD_NAME": "1"}
"""What ElasWave sets for NCCL unless the user set it: NCCL's own threads (a
communicator's proxy and service threads) named at the OS level ("NCCL Progress", ...)
rather than keeping the process's name, as ElasWave's threads are
(:mod:`elaswave.osthreads`), so a worker's threads can be told apart by name (``top -H``,
``/proc/PID/task``, scripts/gpu_check's churn case)."""


LAUNCH_TIMEOUT_ENV = "TORCH_NCCL_NONBLOCKING_TIMEOUT"
"""torch's bound, in whole seconds, on a launch that waits on a non-blocking NCCL
communicator (30 minutes by default), read once per process."""


def launch_timeout_s(comm_timeout_s: float) -> int:
    """How long one launch may wait on the issuing thread: half the communication
    timeout, at least a second.

    A launch that connects (a communicator's first batch, the first collective of an
    algorithm: NCCL connects lazily) waits there for every member, and under a
    non-blocking communicator torch spins on the issuing thread until it is done, which
    no abort signal reaches (aborting the communicator meanwhile would free it under
    the spinning thread). Groups are therefore connected when they are built
    (:meth:`elaswave.comm.group.Group.warm`, on a creation thread a failure may
    abandon); this bound is what is left: a launch still stuck on a member that hung
    raises in time for its rank to stop at a step boundary before the Core's stop
    deadline (``max(30 s, comm timeout)``)."""
    return max(1, int(comm_timeout_s / 2))


class GroupBackend(Protocol):
    """Creates one process group over ``size`` members from a (prefixed) store."""

    name: str
    parks_in_flight: bool
    """Work that will never complete stalls its communicator until it is aborted
    (NCCL, HCCL): a group with work in flight is aborted and rebuilt after a failure."""
    warm_sizes: tuple[int, ...]
    """Elements in all of the collectives a collective group runs once when it is
    built (:meth:`elaswave.comm.group.Group.warm`): where a communicator connects inside
    its first collective of each algorithm, and the algorithm depends on the size, one
    small and one large of each kind; none where creating a group connects it (gloo)."""

    def create(
        self, store: dist.Store, rank: int, size: int, timeout: timedelta, name: str = ""
    ) -> dist.ProcessGroup:
        """``name``: the group's, for messages (the strict device's refusals)."""
        ...

    def device_for(self, local_rank: int) -> torch.device: ...

    def devices(self) -> int | None:
        """Accelerators one host offers its ranks (one rank each); None: no limit."""
        ...


HCCL_ENV = {"HCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_HCCL_WAIT_TIMEOUT_DUMP_MILSEC": "100"}
"""torch_npu's watchdog, set as NCCL's is (:data:`NCCL_ENV`): it handles no error, so a
survivor's parked operation cannot take the process down during a recovery."""


def _set_env(env: dict[str, str]) -> None:
    """Set ``env`` in this process before any communicator is made, warning where a
    user's different value is overridden."""
    for name, value in env.items():
        if os.environ.get(name, value) != value:
            log.warning("comm.env_overridden", name=name, was=os.environ[name], now=value)
        os.environ[name] = value


class GlooBackend:
    name = "gloo"
    parks_in_flight = False
    warm_sizes: tuple[int, ...] = ()

    def create(
        self, store: dist.Store, rank: int, size: int, timeout: timedelta, name: str = ""
    ) -> dist.ProcessGroup:
        # torch's stubs declare ProcessGroupGloo a bare Backend, without the collective
        # and point-to-point methods it has at runtime (and that Group calls).
        return dist.ProcessGroupGloo(store, rank, size, timeout)  # type: ignore[return-value]

    def device_for(self, local_rank: int) -> torch.device:
        return torch.device("cpu")

    def devices(self) -> int | None:
        return None


WARM_SIZES: tuple[int, ...] = (1, 1 << 21)
"""NCCL's and HCCL's :attr:`GroupBackend.warm_sizes`: one element a member, and 8 MiB of
float32 in all (large enough for the ring algorithm a gradient bucket takes; the same
for any group size, so a large group's warm-up costs no more)."""


class NcclBackend:
    name = "nccl"
    parks_in_flight = True
    warm_sizes = WARM_SIZES

    def __init__(self, comm_timeout_s: float = 60.0) -> None:
        _set_env(NCCL_ENV | {LAUNCH_TIMEOUT_ENV: str(launch_timeout_s(comm_timeout_s))})
        for name, value in NCCL_DEFAULT_ENV.items():
            os.environ.setdefault(name, value)
        self._device: torch.device | None = None

    def create(
        self, store: dist.Store, rank: int, size: int, timeout: timedelta, name: str = ""
    ) -> dist.ProcessGroup:
        """A communicator connected now (not inside the first operation of a step) and
        non-blocking (its initialisation and abort never hang the calling thread), on
        this rank's device whatever thread creates it."""
        device = self._device or torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)  # the current device is per thread
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        opts.config.blocking = 0
        pg = dist.ProcessGroupNCCL(store, rank, size, opts)
        pg.eager_connect_single_device(device)
        return pg  # type: ignore[return-value]  # as gloo

    def device_for(self, local_rank: int) -> torch.device:
        device = torch.device("cuda", _one_each(local_rank, self.devices(), "CUDA"))
        torch.cuda.set_device(device)
        self._device = device
        return device

    def devices(self) -> int | None:
        return torch.cuda.device_count()


class HcclBackend:
    """Ascend NPUs. Written against torch_npu's documented API; needs CANN at run time."""

    name = "hccl"
    parks_in_flight = True
    warm_sizes = WARM_SIZES

    def __init__(self) -> None:
        _set_env(HCCL_ENV)
        self._device: torch.device | None = None
        try:
            self._torch_npu = importlib.import_module("torch_npu")
        except Exception as exc:  # ImportError, or OSError when CANN's libhccl.so is missing
            raise ValueError(
                f"device 'npu' needs torch_npu with Ascend CANN installed ({exc}); "
                "use --device cpu or cuda on this machine"
            ) from None

    def create(
        self, store: dist.Store, rank: int, size: int, timeout: timedelta, name: str = ""
    ) -> dist.ProcessGroup:
        c10d = self._torch_npu._C._distributed_c10d
        opts = c10d.ProcessGroupHCCL.Options()
        opts._timeout = timeout
        device = self._device or torch.device("npu", self._torch_npu.npu.current_device())
        self._torch_npu.npu.set_device(device)  # the current device is per thread
        pg = c10d.ProcessGroupHCCL(store, rank, size, opts)
        if hasattr(pg, "eager_connect_single_device"):  # connect now, as NCCL's
            pg.eager_connect_single_device(device)
        return pg

    def device_for(self, local_rank: int) -> torch.device:
        device = torch.device("npu", _one_each(local_rank, self.devices(), "NPU"))
        self._torch_npu.npu.set_device(device)
        self._device = device
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


def _as_own_host() -> None:
    """NCCL's test-only mode for a rank that shares its device: a host identity of its
    own process (so NCCL does not see a duplicate GPU, even beside a worker of another
    job host on this machine with the same local rank) and only the socket transport
    between ranks."""
    os.environ["NCCL_HOSTID"] = f"{socket.gethostname()}-elaswave-pid{os.getpid()}"
    os.environ.update(NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1", NCCL_NET="Socket")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")  # the ranks sharing a device share a host


def _one_each(local_rank: int, count: int | None, what: str) -> int:
    """The device index of ``local_rank``: NCCL and HCCL refuse two ranks of one group
    on the same device ("Duplicate GPU detected"), so ranks never share one, unless
    :data:`SHARE_DEVICE_ENV` opts in: then ranks take the devices in turn, and each
    process is its own NCCL host."""
    if sharing_devices() and count:
        _as_own_host()
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


def backend_for(device: Device | str, comm_timeout_s: float = 60.0) -> GroupBackend:
    """The backend of ``device``'s device plane (training traffic); a launch waits at
    most :func:`launch_timeout_s` of ``comm_timeout_s`` on its issuing thread."""
    device = parse_device(str(device))
    if device in (Device.CPU, Device.EMULATED):
        return GlooBackend()
    if device is Device.CPU_STRICT:
        return StrictBackend(launch_timeout_s(comm_timeout_s))
    if device is Device.CUDA:
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' asked for, but torch sees no CUDA device")
        return NcclBackend(comm_timeout_s)
    return HcclBackend()


def host_backend() -> GroupBackend:
    """The backend of the host plane (fault-tolerance traffic between host buffers):
    gloo on every device."""
    return GlooBackend()
