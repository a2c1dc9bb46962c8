"""One process group addressed by global ranks, with bounded waits.

Collectives are called through the group object's own methods (torch's ``dist.*``
helpers reject groups that were not registered through ``init_process_group``). Every
wait is bounded: a peer that dies or hangs surfaces as :class:`CommError` instead of a
silent hang, which is what fail-stop detection builds on.

Three classes implement groups: :class:`Group` (one gloo process group: collectives and
point-to-point), :class:`~elaswave.comm.ring.RingGroup` (collectives over pooled links)
and :class:`~elaswave.comm.links.PairGroup` (point-to-point over a pooled link). Callers
name what they need by Protocol: :class:`CollectiveGroup` (Group, RingGroup) or
:class:`P2PGroup` (Group, PairGroup); :class:`P2PLink` is the part of the latter that a
transfer executor uses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol, cast

import structlog
import torch
import torch.distributed as dist

from elaswave.comm.abort import Abort, wait_abortable
from elaswave.comm.posted import Posted
from elaswave.comm.spec import CommError, GroupSpec
from elaswave.comm.strict import StrictViolation

log = structlog.get_logger(__name__)

Transfer = tuple[torch.Tensor, int]
"""A point-to-point operation of a batch: the tensor, and the peer's global rank."""

DETACHED = timedelta(days=365)
"""gloo-level timeout of a detached wait: never reached, so the wait never closes its
pair (a gloo wait that times out does)."""
CONNECT_TAG = 0
"""The tag of :meth:`Group.connect`'s batch (no step's traffic uses tag 0 on a group)."""


class GroupMember(Protocol):
    """What every group kind tells about itself."""

    @property
    def spec(self) -> GroupSpec: ...
    @property
    def name(self) -> str: ...
    @property
    def rank(self) -> int:
        """This process's global rank."""
        ...

    @property
    def size(self) -> int: ...
    @property
    def index(self) -> int:
        """This process's position in the group."""
        ...

    @property
    def timeout(self) -> timedelta: ...
    @property
    def tainted(self) -> bool:
        """A collective on the group did not complete: rebuild it, do not reuse it."""
        ...


class CollectiveWork(Protocol):
    """A collective started without waiting (``*_async``)."""

    def wait(self) -> None:
        """Wait for it, bounded by the group's timeout and abort signal as a blocking
        collective is (:class:`CommError`, :class:`~elaswave.comm.abort.StepAborted`).
        The output tensor holds the result only once this returns."""
        ...


class CollectiveGroup(GroupMember, Protocol):
    """A group that data parallelism reduces over: :class:`Group` or a
    :class:`~elaswave.comm.ring.RingGroup`. Every member runs the same collectives in
    the same order (started, for the ``*_async`` ones: they may complete in any order).

    A started collective that is never waited (its step was abandoned) leaves the group
    ``tainted``; until then it may still write its output and read its input, so an
    abandoned collective's tensors must not be reused."""

    def all_reduce(self, tensor: torch.Tensor) -> None: ...
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None: ...
    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None: ...
    def reduce_scatter_async(self, output: torch.Tensor, input: torch.Tensor) -> CollectiveWork:
        """:meth:`reduce_scatter` started; ``input`` is only read."""
        ...

    def all_gather_async(self, output: torch.Tensor, input: torch.Tensor) -> CollectiveWork:
        """:meth:`all_gather` started."""
        ...

    def barrier(self) -> None: ...


class Done:
    """A collective that completed when it was started (a group of one member)."""

    def wait(self) -> None:
        return None


DONE = Done()


class P2PLink(Protocol):
    """Bounded point-to-point sends and receives between global ranks."""

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> dist.Work: ...
    def wait_send(self, work: dist.Work) -> None: ...
    def recv(self, tensor: torch.Tensor, peer: int, tag: int) -> None: ...


class P2PGroup(GroupMember, P2PLink, Protocol):
    """A group that carries point-to-point traffic: :class:`Group` or a
    :class:`~elaswave.comm.links.PairGroup`."""

    def batch(self, sends: Sequence[Transfer], recvs: Sequence[Transfer], tag: int) -> dist.Work:
        """Post ``sends`` and ``recvs`` (tensor, global peer rank) as one batch."""
        ...

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> dist.Work: ...
    def wait_recv(self, work: dist.Work) -> None: ...
    def recv_detached(self, tensor: torch.Tensor, peer: int, tag: int) -> None: ...
    def wait_detached(self, work: dist.Work, op: str) -> None: ...


@dataclass
class Group:
    spec: GroupSpec
    pg: dist.ProcessGroup
    rank: int
    """This process's global rank."""
    timeout: timedelta
    abort: Abort | None = None
    """When set, waits poll it and raise StepAborted instead of blocking on."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Where the group's tensors live (a batch of point-to-point operations, a barrier)."""
    parks: bool = False
    """Work in flight stalls the group until it is aborted (NCCL, HCCL, cpu-strict), so
    a point-to-point operation that did not complete taints it too."""
    _index: dict[int, int] = field(init=False)
    aborted: bool = field(init=False, default=False)
    _in_flight: int = field(init=False, default=0)
    """Collectives started and not yet waited."""
    posted: Posted = field(init=False, default_factory=Posted)
    """Sends and receives held until they complete (:mod:`elaswave.comm.posted`)."""

    def __post_init__(self) -> None:
        self._index = {r: i for i, r in enumerate(self.spec.ranks)}

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def tainted(self) -> bool:
        """Rebuild the group, do not reuse it: a collective on it did not complete (see
        :meth:`_collective`), or it parks work in flight that did not."""
        return self.aborted or self._in_flight > 0 or (self.parks and self.posted.pending() > 0)

    @property
    def size(self) -> int:
        return len(self.spec.ranks)

    @property
    def index(self) -> int:
        """This process's position in the group."""
        return self._index[self.rank]

    def _collective(self, launch: Callable[[], dist.Work], op: str) -> None:
        """Launch a collective and wait for it; if it does not complete (or its launch
        fails), the group stays ``tainted``.

        A collective that one member abandoned while others entered it leaves gloo's
        per-group sequence out of step, so a tainted group must be rebuilt, not reused.
        P2P traffic never taints: its tags are unique per generation and step.
        """
        self._in_flight += 1
        self._wait(self._launch(launch, op), op)
        self._in_flight -= 1

    def _launch(self, launch: Callable[[], dist.Work], op: str) -> dist.Work:
        """Issue an operation: a backend that already knows a peer is gone (NCCL, once
        its proxy saw the connection close) refuses it at launch, not at its wait."""
        with _comm_errors(self.name, op):
            return launch()

    def _wait(self, work: dist.Work, op: str) -> None:
        with _comm_errors(self.name, op):
            if self.abort is None:
                ok = work.wait(self.timeout)
            else:
                ok = wait_abortable(work, self.timeout, self.abort)
        if ok is False:
            raise CommError(self.name, op, f"timed out after {self.timeout}")

    def all_reduce(self, tensor: torch.Tensor) -> None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)
        self._collective(lambda: self.pg.allreduce([tensor], opts), "all_reduce")

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Sum ``input`` (``size`` chunks) over members; chunk ``index`` lands in ``output``."""
        if self.size == 1:
            output.copy_(input)
            return
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)
        self._collective(
            lambda: self.pg._reduce_scatter_base(output, input, opts), "reduce_scatter"
        )

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Concatenate every member's ``input`` into ``output`` in group order."""
        if self.size == 1:
            output.copy_(input)
            return
        self._collective(lambda: self.pg._allgather_base(output, input), "all_gather")

    def reduce_scatter_async(self, output: torch.Tensor, input: torch.Tensor) -> CollectiveWork:
        if self.size == 1:
            output.copy_(input)
            return DONE
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)
        return self._start(
            lambda: self.pg._reduce_scatter_base(output, input, opts), "reduce_scatter"
        )

    def all_gather_async(self, output: torch.Tensor, input: torch.Tensor) -> CollectiveWork:
        if self.size == 1:
            output.copy_(input)
            return DONE
        return self._start(lambda: self.pg._allgather_base(output, input), "all_gather")

    def _start(self, launch: Callable[[], dist.Work], op: str) -> CollectiveWork:
        """The group is ``tainted`` until every started collective is waited (one whose
        launch failed, for good)."""
        self._in_flight += 1
        return _GroupWork(self, self._launch(launch, op), op)

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1, device=self.device))

    def batch(self, sends: Sequence[Transfer], recvs: Sequence[Transfer], tag: int) -> dist.Work:
        """Post ``sends`` and ``recvs`` (tensor, global peer rank) as one batch, what
        ``batch_isend_irecv`` does: under NCCL one grouped launch, so that exchanges in
        both directions between two ranks cannot deadlock. Messages between two ranks
        match in the order posted; ``tag`` keeps a gloo batch apart from a stale one
        (NCCL ignores it: there a group with stale work is rebuilt). Waited with
        :meth:`wait_recv`."""
        if not sends and not recvs:
            return cast(dist.Work, AllOf([]))
        if not getattr(self.pg, "supports_coalescing", False):  # gloo: none blocks another
            works = [self.isend(t, p, tag) for t, p in sends]
            return cast(dist.Work, AllOf(works + [self.irecv(t, p, tag) for t, p in recvs]))
        with _comm_errors(self.name, "batch"):
            self.pg._start_coalescing()  # type: ignore[call-arg]  # a Backend's: no device
            try:
                for tensor, peer in sends:
                    self.pg.send([tensor], self._index[peer], tag)
                for tensor, peer in recvs:
                    self.pg.recv([tensor], self._index[peer], tag)
            except BaseException:
                self._close_batch()
                raise
            return self.posted.hold(self.pg._end_coalescing())  # type: ignore[call-arg]

    def _close_batch(self) -> None:
        """End a batch whose posting failed. NCCL's group is per thread, not per
        communicator: left open, it swallows this thread's next NCCL calls (a new
        communicator's connection fails with "ncclGroupEnd: not in a group call")."""
        try:
            self.pg._end_coalescing()  # type: ignore[call-arg]
        except RuntimeError as exc:  # the communicator's own failure, already raised
            log.debug("group.batch_closed", group=self.name, error=str(exc))

    def connect(self) -> None:
        """Open the group's point-to-point connections (``spec.p2p``) with one batch
        that every member issues. Under NCCL the first batch on a communicator connects
        its ranks and needs every member to issue one: a step's first batches, on
        different communicators at different ranks (a receive posted ahead on one, a
        send on another), would wait for each other forever. Called when the group is
        built, in the order every member builds its groups."""
        me = self.rank
        sends = [(torch.zeros(1, device=self.device), b) for a, b in self.spec.p2p if a == me]
        recvs = [(torch.zeros(1, device=self.device), a) for a, b in self.spec.p2p if b == me]
        if sends or recvs:
            self._wait(self.batch(sends, recvs, CONNECT_TAG), "connect")

    def warm(self, sizes: Sequence[int]) -> None:
        """Run each collective kind once per size of ``sizes`` (float32 elements in all,
        whatever the group's size), when the group is built. NCCL connects an
        algorithm's ranks inside the first collective that uses it, on the issuing
        thread and for every member: a member that hangs before a step's first
        collective on a new group would hold every other one there, past any abort
        (:func:`elaswave.comm.backend.launch_timeout_s`). NCCL picks the algorithm by
        the message's size, hence a small and a large one."""
        for total in sizes:
            piece = max(1, total // self.size)
            whole = torch.zeros(piece * self.size, device=self.device)
            self.all_reduce(whole)
            self.reduce_scatter(torch.zeros(piece, device=self.device), whole)
            self.all_gather(whole, torch.zeros(piece, device=self.device))

    def abort_now(self) -> None:
        """Abort the group's communicator: work in flight on it ends (or, gloo, stays
        parked); the group takes no more work. Safe to call more than once."""
        if self.aborted:
            return
        self.aborted = True
        self.abort_communicator()

    def abort_communicator(self) -> None:
        """The abort itself, for a group already marked ``aborted`` (it is ``tainted``
        from that moment, before the abort, which may take a while, has returned)."""
        try:
            self.pg.abort()
        except (RuntimeError, AttributeError) as exc:  # no abort: its waits stay parked
            log.warning("group.abort_failed", group=self.name, error=str(exc))

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> dist.Work:
        with _comm_errors(self.name, "send"):
            return self.posted.hold(self.pg.send([tensor], self._index[peer], tag))

    def wait_send(self, work: dist.Work) -> None:
        self._wait(work, "send")

    def recv(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        self.wait_recv(self.irecv(tensor, peer, tag))

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> dist.Work:
        """Post a receive; :meth:`wait_recv` waits for it (bounded, abortable)."""
        with _comm_errors(self.name, "recv"):
            return self.posted.hold(self.pg.recv([tensor], self._index[peer], tag))

    def wait_recv(self, work: dist.Work) -> None:
        self._wait(work, "recv")

    def recv_detached(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        """Receive and wait on the calling thread, unbounded and deaf to the abort signal.

        For background threads that may be abandoned mid-wait (they then stay blocked,
        holding this group, which must therefore never be destroyed). A dead peer still
        ends the wait with :class:`CommError`.
        """
        with _comm_errors(self.name, "recv"):
            work = self.posted.hold(self.pg.recv([tensor], self._index[peer], tag))
        self.wait_detached(work, "recv")

    def wait_detached(self, work: dist.Work, op: str) -> None:
        """Wait for posted work on the calling thread; see :meth:`recv_detached`."""
        with _comm_errors(self.name, op):
            work.wait(DETACHED)


@contextmanager
def _comm_errors(group: str, op: str) -> Iterator[None]:
    """A backend's RuntimeError as :class:`CommError` (a failure to recover from); a
    broken rule of the strict device passes through (a bug to stop on)."""
    try:
        yield
    except StrictViolation:
        raise
    except RuntimeError as exc:
        raise CommError(group, op, exc) from exc


class AllOf:
    """Several posted operations waited as one (a batch where none blocks another)."""

    def __init__(self, works: list[dist.Work]) -> None:
        self.works = works

    def wait(self, timeout: timedelta | None = None) -> bool:
        return all(w.wait() if timeout is None else w.wait(timeout) for w in self.works)

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


class _GroupWork:
    def __init__(self, group: Group, work: dist.Work, op: str) -> None:
        self.group, self.work, self.op = group, work, op
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        self.group._wait(self.work, self.op)  # raises: the group stays tainted
        self.done = True
        self.group._in_flight -= 1
