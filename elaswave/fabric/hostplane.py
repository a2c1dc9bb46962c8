"""Host-plane buffers: where fault-tolerance traffic lives, and how it gets there.

ElasWave has two planes. The *device plane* carries training traffic (activations and
their gradients, the DP reduce-scatter and all-gather, TP collectives, the loss
reduction) between device-resident tensors on the device's backend. The *host plane*
carries fault-tolerance traffic (snapshot gradient shipping, the snapshot-state
exchange, live remap, layer streaming and paybacks) between host buffers over gloo.

Every host-plane buffer is allocated here, or handed over here, and marked with
:func:`~elaswave.comm.strict.mark_host`, so that the ``cpu-strict`` device refuses it on
a device-plane communicator as NCCL would. Host buffers are pinned when CUDA is
available (pinned memory is what an asynchronous device-to-host copy needs).

Snapshot shipping copies each step's gradient shard off the device through a
:class:`HostCopier`: a plain copy on CPU, and on CUDA a copy into a pinned buffer on a
copy stream of its own, ordered after the training stream's work by an event, so that
the training stream never waits for it (:class:`CudaHostCopier`, the one CUDA branch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from elaswave.comm.strict import mark_host
from elaswave.fabric.adamw import ShardState


def pinned() -> bool:
    """Whether host buffers are pinned: only in a process that trains on CUDA (one
    that has initialised it), not in a CPU run on a machine that has GPUs."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def host_empty(shape: int | Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised host-plane buffer (a receive or staging buffer), marked."""
    size = (shape,) if isinstance(shape, int) else tuple(shape)
    return mark_host(torch.empty(size, dtype=dtype, pin_memory=pinned()))


def host_zeros(shape: int | Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A zeroed host-plane buffer, marked."""
    return host_empty(shape, dtype).zero_()


def as_host(fresh: torch.Tensor) -> torch.Tensor:
    """``fresh``'s values in a host-plane buffer: ``fresh`` itself, marked, when it is
    already in host memory (the caller hands over a tensor nothing else uses: a
    ``torch.stack`` or ``torch.cat`` of its own); otherwise a synchronous copy into a
    pinned buffer (recovery paths, where the training stream is idle)."""
    if fresh.device.type == "cpu":
        return mark_host(fresh.contiguous())
    out = host_empty(fresh.shape, fresh.dtype)
    out.copy_(fresh)
    return out


def host_state(state: ShardState) -> ShardState:
    """A host-plane copy of a shard state (a snapshot), each tensor marked. Pageable:
    only gloo and the host's AdamW touch it, never a device copy."""
    return ShardState(
        *(
            mark_host(t.detach().to("cpu", copy=True))
            for t in (state.master, state.exp_avg, state.exp_avg_sq, state.decay_mask)
        )
    )


def bind_thread_device(device: torch.device | None) -> None:
    """Make ``device`` the calling thread's current CUDA device (a helper thread starts
    on device 0 whatever its process trains on); nothing for other devices. Call it
    first thing in every thread that touches tensors."""
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)


@dataclass
class HostCopy:
    """A device-to-host copy under way: ``tensor`` holds the values once :meth:`wait`
    has returned."""

    tensor: torch.Tensor
    """The host-plane buffer (marked) the copy lands in."""
    _wait: Callable[[], None] | None = None

    @property
    def ready(self) -> bool:
        """Whether the copy was complete when it was handed over (a host copy)."""
        return self._wait is None

    def wait(self) -> None:
        """Block the calling thread (not a device stream) until the copy is complete."""
        if self._wait is not None:
            self._wait()


class HostCopier(Protocol):
    """Copies a device tensor into a new host-plane buffer off the training stream."""

    def copy(self, tensor: torch.Tensor, extra: int = 0) -> HostCopy:
        """Start copying ``tensor`` (its producer's work already issued on the calling
        thread's current stream); its memory may be reused once the copy is waited.
        ``extra``: elements the buffer has beyond ``tensor``'s (then flat), for the
        caller to fill (a frame's trailer: :mod:`elaswave.fabric.snapshot`)."""
        ...


def _buffer_for(tensor: torch.Tensor, extra: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A host-plane buffer for ``tensor`` and ``extra`` elements more, and the view of
    it that ``tensor``'s values go to."""
    if not extra:
        out = host_empty(tensor.shape, tensor.dtype)
        return out, out
    out = host_empty(tensor.numel() + extra, tensor.dtype)
    return out, out[: tensor.numel()].view(tensor.shape)


class CpuHostCopier:
    """The host's copier: a plain copy, complete when it returns."""

    def copy(self, tensor: torch.Tensor, extra: int = 0) -> HostCopy:
        out, values = _buffer_for(tensor, extra)
        values.copy_(tensor.detach())
        return HostCopy(out)


class CudaHostCopier:
    """A CUDA device's copier: pinned buffers filled on a copy stream of its own."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def copy(self, tensor: torch.Tensor, extra: int = 0) -> HostCopy:
        source = tensor.detach()
        out, values = _buffer_for(source, extra)
        done = torch.cuda.Event()
        # After what the training stream has issued so far (the producer of the tensor),
        # without making the training stream wait for the copy.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            values.copy_(source, non_blocking=True)
            done.record(self.stream)
        source.record_stream(self.stream)  # the allocator keeps it until the copy is done
        return HostCopy(out, done.synchronize)


def host_copier(device: torch.device) -> HostCopier:
    """The copier for tensors on ``device``."""
    if device.type == "cuda":
        return CudaHostCopier(device)
    return CpuHostCopier()
