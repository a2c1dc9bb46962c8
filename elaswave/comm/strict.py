"""NCCL's rules on CPU: the process groups of the ``cpu-strict`` device.

ElasWave is developed and tested on CPU machines with gloo, whose semantics are kinder
than NCCL's. A :class:`StrictProcessGroup` wraps a gloo process group and behaves as a
NCCL communicator does wherever the difference can break a data plane, so that code
which passes under it does not rely on gloo's kindness:

* **Tags are ignored.** Point-to-point messages match first-in-first-out per
  communicator, peer and direction, whatever tag they were posted with.
* **One stream per communicator.** Operations run one after the other in the order they
  were issued, as NCCL kernels do on a communicator's stream: a receive that waits for
  a message stalls every operation issued after it. Send and receive in both directions
  between two ranks must be issued as one batch (``_start_coalescing`` ...
  ``_end_coalescing``, what ``batch_isend_irecv`` does); issuing them ungrouped is
  refused with :class:`StrictViolation` (under NCCL two ranks doing so deadlock).
* **A dead or stopped peer hangs.** An operation whose peer died or stopped never
  completes (gloo would end it with an error); only :meth:`StrictProcessGroup.abort`
  ends it, and every operation queued behind it, with an error.
* **Device tensors only.** A tensor marked as a host-plane buffer (:func:`mark_host`:
  snapshots, staging buffers; under NCCL these live in host memory, which NCCL
  refuses) is refused.
* **The first batch is collective.** NCCL connects two ranks for point-to-point traffic
  inside their first batch on a communicator, and the issuing thread waits there (up to
  the communicator's timeout) until every member has issued its first batch (torch:
  "if this API is the first collective call in the group ..., all ranks of the group
  must participate"). Two ranks whose first batches are on different communicators
  deadlock; the strict communicator blocks the issuing thread the same way, so they
  time out (:meth:`elaswave.comm.group.Group.connect` connects a group when it is built).
* **The first collective is collective.** NCCL connects the ranks of a collective
  algorithm lazily, inside the first collective that uses it, and under a non-blocking
  communicator torch waits there on the issuing thread until every member has issued
  it, where no abort reaches (:func:`elaswave.comm.backend.launch_timeout_s`): a member
  that hung before its first collective holds every other one in the launch. The strict
  communicator blocks the issuing thread of its first collective the same way, up to
  its timeout (:meth:`elaswave.comm.group.Group.warm` connects a group when it is built).
* **A waiting receive stalls the device.** While a receive posted on one communicator
  waits for its message, nothing may be issued on another: under NCCL the receive's
  kernel spins, and the rank's next device allocation or launch can wait behind it,
  so work the peer needs from this rank never runs. Receives are posted when needed.
* **A failed communicator refuses new work.** Once an operation failed because a peer
  is gone, every later launch on the communicator raises (NCCL's proxy saw the
  connection close: ``ncclRemoteError`` at launch), while the failed operation itself
  still hangs until the communicator is aborted.
* **A batch is per thread.** NCCL's group (``ncclGroupStart`` ... ``ncclGroupEnd``)
  belongs to the issuing thread, not to a communicator: a batch left open (its posting
  failed half-way) swallows the thread's next NCCL calls, so opening another batch or
  creating a communicator on that thread is refused until it is closed. And torch
  counts a thread's open groups: a batch that failed leaves the count one too high for
  good, and creating a communicator on that thread is refused from then on.
* **One issuing thread.** NCCL needs every rank to issue a communicator's operations in
  the same order, which two threads issuing on one communicator cannot promise: the
  thread that issues on a communicator owns it until it ends (a creation thread that
  connects it hands it over that way), and any other is refused meanwhile.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, ReduceScatterOptions

FOREVER = timedelta(days=365)
"""gloo-level timeout of every strict operation: a stopped peer parks it, as under NCCL."""

STRICT_TAG = 0
"""The one tag every strict point-to-point operation is posted with."""


class StrictViolation(RuntimeError):
    """A use of a communicator that NCCL would refuse, or deadlock on."""


_HOST: set[int] = set()
_HOST_LOCK = threading.Lock()


def mark_host(tensor: torch.Tensor) -> torch.Tensor:
    """Mark ``tensor``'s memory as a host-plane buffer until ``tensor`` is freed;
    returns it. Views share the mark (it is kept by storage)."""
    key = tensor.untyped_storage().data_ptr()
    if key == 0:
        return tensor
    with _HOST_LOCK:
        _HOST.add(key)
    weakref.finalize(tensor, _unmark, key)
    return tensor


def _unmark(key: int) -> None:
    with _HOST_LOCK:
        _HOST.discard(key)


def is_host(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lives in a buffer marked by :func:`mark_host`."""
    key = tensor.untyped_storage().data_ptr()
    with _HOST_LOCK:
        return key != 0 and key in _HOST


_LIVE: weakref.WeakSet[StrictProcessGroup] = weakref.WeakSet()
"""This process's strict communicators (the rule on receives spans all of them)."""


class StrictWork:
    """One operation (or batch) on a strict communicator's stream."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._done = threading.Event()
        self._error: str | None = None

    def finish(self, error: str | None = None) -> None:
        """Complete it (with ``error``, if any); only the first call counts."""
        if not self._done.is_set():
            self._error = error
            self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Wait for the operation; RuntimeError if it timed out or was aborted."""
        seconds = None if timeout is None else timeout.total_seconds()
        if not self._done.wait(seconds):
            raise RuntimeError(f"{self.what}: timed out after {timeout} (the operation hangs)")
        if self._error is not None:
            raise RuntimeError(f"{self.what}: {self._error}")
        return True


@dataclass
class _Op:
    what: str
    post: Callable[[], list[dist.Work]]
    work: StrictWork
    p2p: list[tuple[int, str]] = field(default_factory=list)
    receives: int = 0
    """Receives it holds (a batch's, or an ungrouped one)."""
    """(peer, "send" | "recv") of the ungrouped point-to-point operations it holds."""


class StrictProcessGroup:
    """A gloo process group that keeps NCCL's rules (see the module docstring).

    Offers the methods of a torch backend that :class:`elaswave.comm.group.Group` calls.
    """

    supports_coalescing = True

    def __init__(
        self,
        pg: dist.ProcessGroup,
        rank: int,
        size: int,
        name: str = "",
        timeout: timedelta = FOREVER,
        device: object = None,
    ) -> None:
        """``device``: the device whose work this communicator's operations share (by
        default this process's one); tests running two ranks in one process give each
        rank its own."""
        self._pg = pg
        self._device = device
        self._rank, self._size = rank, size
        self._timeout = timeout
        self._connected = False
        self._collectives_connected = False
        self.name = name or f"strict{id(self):x}"
        self._owner: threading.Thread | None = None
        self._lock = threading.Condition()
        self._queue: list[_Op] = []
        self._running: _Op | None = None
        self._batch: list[Callable[[], list[dist.Work]]] | None = None
        self._open: dict[tuple[int, str], int] = {}
        self._receiving = 0
        """Receives queued or running on the stream (see :meth:`_refuse_while_receiving`)."""
        self._batch_receives = 0
        self._failed: str | None = None
        """Why an operation on the stream failed (a peer is gone): launches then raise."""
        _LIVE.add(self)
        self.aborted = False
        threading.Thread(target=self._stream, name=f"ew-strict-{self.name}", daemon=True).start()

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    # --- operations torch's backends offer ---------------------------------------------

    def allreduce(
        self, tensors: list[torch.Tensor], opts: dist.AllreduceOptions | None = None
    ) -> StrictWork:
        self._check("all_reduce", tensors)
        self._connect_collectives()
        opts = opts or dist.AllreduceOptions()
        opts.timeout = FOREVER
        return self._issue("all_reduce", lambda: [self._pg.allreduce(tensors, opts)])

    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: ReduceScatterOptions | None = None
    ) -> StrictWork:
        self._check("reduce_scatter", [output, input])
        self._connect_collectives()
        opts = opts or ReduceScatterOptions()
        opts.timeout = FOREVER
        return self._issue(
            "reduce_scatter", lambda: [self._pg._reduce_scatter_base(output, input, opts)]
        )

    def _allgather_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: AllgatherOptions | None = None
    ) -> StrictWork:
        self._check("all_gather", [output, input])
        self._connect_collectives()
        opts = opts or AllgatherOptions()
        opts.timeout = FOREVER
        return self._issue("all_gather", lambda: [self._pg._allgather_base(output, input, opts)])

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> StrictWork:
        self._check(f"send to {peer}", tensors)
        return self._issue(
            f"send to {peer}", lambda: [self._pg.send(tensors, peer, STRICT_TAG)], (peer, "send")
        )

    def recv(self, tensors: list[torch.Tensor], peer: int, tag: int) -> StrictWork:
        self._check(f"recv from {peer}", tensors)
        return self._issue(
            f"recv from {peer}", lambda: [self._pg.recv(tensors, peer, STRICT_TAG)], (peer, "recv")
        )

    def _start_coalescing(self) -> None:
        self._check("batch", [], launch=False)  # opening a group launches nothing
        refuse_open_batch(f"batch on communicator {self.name!r}")
        with self._lock:
            if self._batch is not None:
                raise StrictViolation(f"communicator {self.name!r}: a batch is already open")
            self._batch = []
            self._batch_receives = 0
        _THREAD.batch = (id(self), self.name)

    def _end_coalescing(self) -> StrictWork:
        if getattr(_THREAD, "batch", None) == (id(self), self.name):
            _THREAD.batch = None  # ncclGroupEnd ends the thread's group, even when it fails
        with self._lock:
            posts, self._batch = self._batch, None
        if posts is None:
            raise StrictViolation(f"communicator {self.name!r}: no batch is open")
        try:
            self._check("batch", [])
        except RuntimeError:
            _THREAD.broken = self.name
            raise
        if posts and not self._connected:
            self._connect()
        return self._enqueue(
            _Op(
                "batch",
                lambda: [w for p in posts for w in p()],
                StrictWork("batch"),
                receives=self._batch_receives,
            )
        )

    def _connect(self) -> None:
        """The first batch's connection: wait, on the issuing thread, until every member
        has issued its first batch (RuntimeError after the communicator's timeout)."""
        self._connected = True
        opts = dist.BarrierOptions()
        opts.timeout = FOREVER
        connect = self._enqueue(
            _Op("first batch (connect)", lambda: [self._pg.barrier(opts)], StrictWork("connect"))
        )
        try:
            connect.wait(self._timeout)
        except RuntimeError as exc:
            raise RuntimeError(
                f"communicator {self.name!r}: {exc}; under NCCL every member must issue its "
                "first batch on a communicator before any can go on"
            ) from None

    def _connect_collectives(self) -> None:
        """The first collective's connection: wait, on the issuing thread, until every
        member has issued its first collective (RuntimeError after the timeout). NCCL
        connects from the host, not on the communicator's stream: work queued there
        does not delay it."""
        if self._collectives_connected:
            return
        self._collectives_connected = True
        opts = dist.BarrierOptions()
        opts.timeout = FOREVER
        connect, barrier = StrictWork("first collective (connect)"), self._pg.barrier(opts)

        def finish() -> None:
            try:
                barrier.wait(FOREVER)
            except RuntimeError as exc:
                connect.finish(str(exc))
            connect.finish()

        threading.Thread(target=finish, name=f"ew-strict-connect-{self.name}", daemon=True).start()
        try:
            connect.wait(self._timeout)
        except RuntimeError as exc:
            raise RuntimeError(
                f"communicator {self.name!r}: {exc}; under NCCL every member must issue its "
                "first collective on a communicator before any can go on"
            ) from None

    def abort(self) -> None:
        """End every queued and running operation with an error; refuse new ones. A
        gloo operation already posted stays parked on the stream's thread."""
        with self._lock:
            self.aborted = True
            self._receiving = 0
            ops = ([self._running] if self._running else []) + self._queue
            self._queue = []
            self._lock.notify_all()
        for op in ops:
            op.work.finish(f"communicator {self.name!r} aborted")

    # --- the rules --------------------------------------------------------------------

    def _check(self, what: str, tensors: Iterable[torch.Tensor], *, launch: bool = True) -> None:
        if launch:
            self._refuse_if_failed(what)
        me = threading.current_thread()
        with self._lock:
            if self._owner is None or not self._owner.is_alive():
                self._owner = me
        if self._owner is not me:
            raise StrictViolation(
                f"{what} on communicator {self.name!r} from thread "
                f"{threading.current_thread().name!r}, not the one that issues its "
                "operations: NCCL needs one issue order on every rank"
            )
        self._refuse_while_receiving(what)
        for tensor in tensors:
            if is_host(tensor):
                raise StrictViolation(
                    f"{what} on communicator {self.name!r} was handed a host-plane buffer "
                    "(a snapshot or staging buffer): device communicators take device "
                    "tensors only"
                )

    def _refuse_if_failed(self, what: str) -> None:
        """A launch on an aborted communicator, or one that saw a peer go, raises; inside
        a batch that leaves the thread's group count broken (see the module docstring)."""
        if (self.aborted or self._failed is not None) and self._batch is not None:
            _THREAD.broken = self.name
        if self.aborted:
            raise RuntimeError(f"{what} on aborted communicator {self.name!r}")
        if self._failed is not None:
            raise RuntimeError(
                f"{what} on communicator {self.name!r}, where an operation failed "
                f"({self._failed}): a communicator that saw a peer go refuses new work"
            )

    def _refuse_while_receiving(self, what: str) -> None:
        """Refuse an operation while a receive posted on another communicator of this
        process still waits. Under NCCL that receive's kernel spins until its message
        comes, and a device allocation (cudaMalloc synchronises the device) or a
        launch behind it waits for the kernel: if the message depends on what this
        rank still has to compute or send, nothing moves again."""
        waiting = [
            g.name
            for g in list(_LIVE)
            if g is not self and g._device == self._device and g._receiving and not g.aborted
        ]
        if waiting:
            raise StrictViolation(
                f"{what} on communicator {self.name!r} while a receive posted on "
                f"{waiting[0]!r} waits: under NCCL its kernel blocks this rank's later "
                "device work; post a receive when it is needed and wait for it"
            )

    def _issue(
        self, what: str, post: Callable[[], list[dist.Work]], p2p: tuple[int, str] | None = None
    ) -> StrictWork:
        work = StrictWork(what)
        with self._lock:
            if self._batch is not None:
                self._batch.append(post)
                self._batch_receives += p2p is not None and p2p[1] == "recv"
                return work  # completes with the batch: wait for _end_coalescing's work
        receives = int(p2p is not None and p2p[1] == "recv")
        op = _Op(what, post, work, [p2p] if p2p else [], receives=receives)
        if p2p is not None:
            self._refuse_crossing(*p2p)
        return self._enqueue(op)

    def _refuse_crossing(self, peer: int, kind: str) -> None:
        other = "recv" if kind == "send" else "send"
        with self._lock:
            if self._open.get((peer, other), 0):
                raise StrictViolation(
                    f"{kind} {'to' if kind == 'send' else 'from'} rank {peer} on communicator "
                    f"{self.name!r} while an ungrouped {other} with it is in flight: NCCL runs "
                    "them one after the other and two ranks doing so deadlock; issue both "
                    "directions as one batch (batch_isend_irecv)"
                )

    def _enqueue(self, op: _Op) -> StrictWork:
        with self._lock:
            if self.aborted:
                raise RuntimeError(f"{op.what} on aborted communicator {self.name!r}")
            for key in op.p2p:
                self._open[key] = self._open.get(key, 0) + 1
            self._receiving += op.receives
            self._queue.append(op)
            self._lock.notify_all()
        return op.work

    def _stream(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self.aborted:
                    self._lock.wait()
                if self.aborted:
                    return
                op = self._running = self._queue.pop(0)
            error = self._run(op)
            with self._lock:
                for key in op.p2p:
                    self._open[key] -= 1
                self._receiving -= op.receives
                if error is not None:  # a dead peer: hang, as NCCL does, until aborted
                    self._failed = error
                    while not self.aborted:
                        self._lock.wait()
                if self.aborted:  # abort() ended the running operation
                    return
                self._running = None
            op.work.finish()

    def _run(self, op: _Op) -> str | None:
        try:
            for work in op.post():
                work.wait(FOREVER)
        except RuntimeError as exc:
            return str(exc)
        return None


_THREAD = threading.local()
"""The batch open on this thread (``batch``: its communicator's id and name, or None),
and the communicator whose batch failed on it (``broken``, or None)."""


def refuse_open_batch(what: str) -> None:
    """Refuse ``what`` on a thread that left a batch open (see the module docstring)."""
    open_on = getattr(_THREAD, "batch", None)
    if open_on is not None:
        raise StrictViolation(
            f"{what} while a batch on communicator {open_on[1]!r} is still open on this thread: "
            "NCCL's group belongs to the thread, and one left open swallows its next calls "
            "(end a batch whose posting failed)"
        )


def refuse_creation(what: str) -> None:
    """Refuse creating a communicator on a thread with a batch open, or where a batch
    failed half-way (see the module docstring)."""
    refuse_open_batch(what)
    broken = getattr(_THREAD, "broken", None)
    if broken is not None:
        raise StrictViolation(
            f"{what} on a thread where a batch on communicator {broken!r} failed half-way: "
            "torch's count of the thread's open NCCL groups stays one too high, and NCCL "
            "refuses a communicator created there (create communicators on a fresh thread)"
        )


class StrictBackend:
    """The ``cpu-strict`` device's backend: CPU compute, gloo underneath, NCCL's rules."""

    name = "cpu-strict"
    parks_in_flight = True
    warm_sizes: tuple[int, ...] = (1,)
    """One warm-up collective of each kind connects a strict communicator."""

    def __init__(self, launch_timeout_s: float = 30.0) -> None:
        self._launch = timedelta(seconds=launch_timeout_s)

    def create(
        self, store: dist.Store, rank: int, size: int, timeout: timedelta, name: str = ""
    ) -> dist.ProcessGroup:
        refuse_creation(f"creating communicator {name!r}")
        # torch's stubs declare ProcessGroupGloo a bare Backend (see GlooBackend)
        pg: dist.ProcessGroup = dist.ProcessGroupGloo(store, rank, size, timeout)  # type: ignore[assignment]
        launch = min(timeout, self._launch)  # a connecting launch waits no longer (NCCL's)
        return StrictProcessGroup(pg, rank, size, name, timeout=launch)  # type: ignore[return-value]  # duck-typed backend

    def device_for(self, local_rank: int) -> torch.device:
        return torch.device("cpu")

    def devices(self) -> int | None:
        return None
