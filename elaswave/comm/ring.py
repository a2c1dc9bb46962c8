"""DP rings over pooled links: the group the dynamic communicator edits in place.

A DP group is not one gloo process group (gloo cannot shrink one) but a ring over the
pooled links between ring neighbours (:mod:`elaswave.comm.links`). When a member fails
the ring is re-formed over its survivors by connecting only its two former neighbours;
every other link stays as it is.

Collectives are the textbook ring algorithms (``size - 1`` steps; each step sends one
chunk to the next member and receives one from the previous member, with tagged
send/recv so neighbours cannot deadlock). Their results equal gloo's own
``_reduce_scatter_base`` / ``_allgather_base`` / ``allreduce`` up to float rounding:
the ring sums a chunk in ring order, starting at the member after its owner, which is
not gloo's order.

Each collective runs whole on a daemon waiter thread (one thread hand-off per
collective, as for a gloo collective) with a practically unbounded gloo timeout, and the
caller gives up after :attr:`RingGroup.timeout` (or when the abort signal is set) with
:class:`CommError`; the abandoned collective, and any other of the ring still in flight,
posts nothing more and stays parked on its thread until the link's peer dies.
``reduce_scatter_async`` / ``all_gather_async`` start a collective and return at once
(the tag counter is reserved on the caller's thread, so members agree on it whatever
order the collectives complete in); their ``wait`` is bounded the same way. Tags carry
the ring's generation, so an abandoned send or receive can never match a message of a
ring formed later. A process group destroyed under a blocked wait aborts the process,
so each parked collective holds its ring and with it its links' groups, and retired
links are kept (:attr:`LinkPool.retired`); an idle gloo group costs about 1 ms of CPU
per second (measured here), which bounds what keeping them costs.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
import zlib
from collections.abc import Callable, Sequence
from datetime import timedelta

import structlog
import torch
import torch.distributed as dist

from elaswave.comm.abort import WAITERS, AbortSignal, StepAborted, await_future
from elaswave.comm.group import DETACHED, DONE, CollectiveWork
from elaswave.comm.links import Link, LinkPool, Pair, pair
from elaswave.comm.spec import CommError, GroupSpec

log = structlog.get_logger(__name__)

_TAG_RING = 1 << 30
"""Set in every ring tag; :func:`elaswave.comm.group.p2p_tag` tags stay below it."""


# --------------------------------------------------------------------------- pure helpers


def ring_pairs(ranks: Sequence[int]) -> list[Pair]:
    """The links a ring over ``ranks`` (in ring order) needs: ``(r[i], r[i+1 mod D])``.

    A ring of D >= 3 members needs D links, of two members one, of one member none.
    """
    size = len(ranks)
    if size < 2:
        return []
    out = [pair(ranks[i], ranks[(i + 1) % size]) for i in range(size)]
    return sorted(set(out))


def ring_neighbours(ranks: Sequence[int], rank: int) -> tuple[int, int]:
    """(previous, next) member of ``rank`` in the ring ``ranks``."""
    index = list(ranks).index(rank)
    return ranks[(index - 1) % len(ranks)], ranks[(index + 1) % len(ranks)]


def reduce_scatter_schedule(index: int, size: int) -> list[tuple[int, int]]:
    """(chunk sent, chunk received and accumulated) at each step, for ring position ``index``.

    After ``size - 1`` steps position ``index`` holds the full sum of chunk ``index``.
    """
    return [((index - step - 1) % size, (index - step - 2) % size) for step in range(size - 1)]


def all_gather_schedule(index: int, size: int) -> list[tuple[int, int]]:
    """(chunk sent, chunk received) at each step; position ``index`` starts with its own."""
    return [((index - step) % size, (index - step - 1) % size) for step in range(size - 1)]


def ring_tag(generation: int, key: int, counter: int) -> int:
    """A send/recv tag: ring bit | generation (6 bits) | ring key (4 bits) | counter (20 bits).

    Members agree on every field without talking: the generation the ring was formed in,
    a hash of its name, and the number of steps the ring has run.
    """
    return _TAG_RING | ((generation % 64) << 24) | ((key % 16) << 20) | (counter % (1 << 20))


def ring_key(name: str) -> int:
    return zlib.crc32(name.encode()) % 16


# --------------------------------------------------------------------------- ring group


class RingGroup:
    """A group whose collectives run as rings over pooled links.

    Offers the collectives of :class:`elaswave.comm.group.Group` that data parallelism
    uses (``reduce_scatter``, ``all_gather``, ``all_reduce``, ``barrier``) with the same
    semantics; the ring order is the member order of ``spec``. Every member must run the
    same collectives in the same order (as for any process group).
    """

    def __init__(
        self,
        spec: GroupSpec,
        rank: int,
        links: LinkPool,
        *,
        timeout: timedelta,
        generation: int,
        abort: AbortSignal | None = None,
    ) -> None:
        if rank not in spec.ranks:
            raise ValueError(f"rank {rank} is not a member of ring {spec.name} {spec.ranks}")
        self.spec = spec
        self.rank = rank
        self.timeout = timeout
        self.generation = generation
        self.abort = abort
        self._index = spec.ranks.index(rank)
        self._key = ring_key(spec.name)
        self._counter = 0
        self._in_flight: set[_RingWork] = set()
        """Collectives started and not yet waited."""
        self.tainted = False
        """A collective on this ring did not complete. Its members may then disagree on
        the step counter, so the ring must be re-formed (``rebuild``), not reused; under
        EDIT that creates no link, only a fresh tag space."""
        self._prev: tuple[Link, int] | None = None
        self._next: tuple[Link, int] | None = None
        if self.size > 1:
            prev, nxt = ring_neighbours(spec.ranks, rank)
            try:
                prev_link, next_link = links.get(prev, rank), links.get(rank, nxt)
            except KeyError as exc:
                raise ValueError(
                    f"ring {spec.name}: link {exc} missing from the pool; connect it first"
                ) from None
            self._prev = (prev_link, prev)
            self._next = (next_link, nxt)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def size(self) -> int:
        return len(self.spec.ranks)

    @property
    def index(self) -> int:
        """This process's position in the ring."""
        return self._index

    @property
    def pairs(self) -> list[Pair]:
        """The links this process uses in the ring (at most two)."""
        return sorted({end[0].pair for end in (self._prev, self._next) if end is not None})

    @property
    def links(self) -> list[Link]:
        """The links themselves (at most two)."""
        return [end[0] for end in (self._prev, self._next) if end is not None]

    def __repr__(self) -> str:
        return f"RingGroup({self.name!r}, ranks={self.spec.ranks}, rank={self.rank})"

    # ----------------------------------------------------------------- collectives

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Sum ``input`` (``size`` chunks) over members; chunk ``index`` lands in ``output``."""
        self.reduce_scatter_async(output, input).wait()

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Concatenate every member's ``input`` into ``output`` in ring order."""
        self.all_gather_async(output, input).wait()

    def reduce_scatter_async(self, output: torch.Tensor, input: torch.Tensor) -> CollectiveWork:
        """:meth:`reduce_scatter` started on a waiter thread; ``input`` is only read (the
        partial sums travel in scratch buffers), so it may be a live gradient buffer."""
        if input.numel() != output.numel() * self.size:
            raise ValueError(
                f"{self.name}: reduce_scatter input has {input.numel()} elements, "
                f"expected output ({output.numel()}) x size ({self.size})"
            )
        if self.size == 1:
            output.copy_(input.reshape(output.shape))
            return DONE
        chunks = list(input.detach().reshape(-1).split(output.numel()))
        direct = output.is_contiguous()
        out = output.view(-1) if direct else torch.empty(output.numel(), dtype=output.dtype)
        base = self._reserve(1)
        work = self._start(
            lambda cancel: self._reduce_scatter_into(chunks, out, base, cancel), "reduce_scatter"
        )
        return work if direct else _CopyBack(work, output, out)

    def all_gather_async(self, output: torch.Tensor, input: torch.Tensor) -> CollectiveWork:
        """:meth:`all_gather` started on a waiter thread."""
        if output.numel() != input.numel() * self.size:
            raise ValueError(
                f"{self.name}: all_gather output has {output.numel()} elements, "
                f"expected input ({input.numel()}) x size ({self.size})"
            )
        if self.size == 1:
            output.copy_(input.reshape(output.shape))
            return DONE
        direct = output.is_contiguous()
        flat = output.view(-1) if direct else torch.empty_like(output).view(-1)
        chunks = list(flat.split(input.numel()))
        chunks[self._index].copy_(input.reshape(-1))
        base = self._reserve(1)
        work = self._start(
            lambda cancel: self._all_gather_chunks(chunks, base, cancel), "all_gather"
        )
        return work if direct else _CopyBack(work, output, flat)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over members, in place (reduce-scatter then all-gather)."""
        if self.size == 1:
            return
        direct = tensor.is_contiguous()
        flat = tensor.view(-1) if direct else tensor.reshape(-1).clone()
        chunks = list(flat.tensor_split(self.size))
        base = self._reserve(2)

        def run(cancel: threading.Event) -> None:
            self._reduce_scatter_chunks(chunks, base, cancel)
            self._all_gather_chunks(chunks, base + self.size - 1, cancel)

        self._start(run, "all_reduce").wait()
        if not direct:
            tensor.copy_(flat.view(tensor.shape))

    def barrier(self) -> None:
        # One element per member, so that every step carries a message.
        self.all_reduce(torch.zeros(self.size))

    # ----------------------------------------------------------------- ring steps

    def _reserve(self, phases: int) -> int:
        """Tag counters of the next ``phases`` x ``(size - 1)`` steps, reserved on the
        caller's thread before any is sent: members that entered the same collectives
        agree on the counter even when one of them was abandoned halfway.

        The ring is ``tainted`` from here until the collective completes: a member that
        reserves and is then aborted (even before posting anything) has moved its counter
        past its peers', so the ring must be re-formed, not reused."""
        base = self._counter
        self._counter += phases * (self.size - 1)
        self.tainted = True
        return base

    def _reduce_scatter_into(
        self, chunks: list[torch.Tensor], out: torch.Tensor, base: int, cancel: threading.Event
    ) -> None:
        """Reduce-scatter without writing ``chunks``: each step's partial sum (the chunk
        received plus this member's own) goes to one of two scratch buffers, the last
        one to ``out``. The sums are those of :meth:`_reduce_scatter_chunks`."""
        n = out.numel()
        received = torch.empty(n, dtype=out.dtype)
        sums = [torch.empty(n, dtype=out.dtype) for _ in range(min(2, self.size - 2))]
        schedule = reduce_scatter_schedule(self._index, self.size)
        partial = None
        for step, (send, recv) in enumerate(schedule):
            outgoing = chunks[send] if partial is None else partial
            tag = ring_tag(self.generation, self._key, base + step)
            self._step(outgoing, received, tag, cancel)
            target = out if step == len(schedule) - 1 else sums[step % 2]
            torch.add(chunks[recv], received, out=target)
            partial = target

    def _reduce_scatter_chunks(
        self, chunks: list[torch.Tensor], base: int, cancel: threading.Event
    ) -> None:
        scratch = torch.empty(max(c.numel() for c in chunks), dtype=chunks[0].dtype)
        schedule = reduce_scatter_schedule(self._index, self.size)
        for step, (send, recv) in enumerate(schedule):
            buf = scratch[: chunks[recv].numel()]
            self._step(chunks[send], buf, ring_tag(self.generation, self._key, base + step), cancel)
            chunks[recv].add_(buf)

    def _all_gather_chunks(
        self, chunks: list[torch.Tensor], base: int, cancel: threading.Event
    ) -> None:
        for step, (send, recv) in enumerate(all_gather_schedule(self._index, self.size)):
            tag = ring_tag(self.generation, self._key, base + step)
            self._step(chunks[send], chunks[recv], tag, cancel)

    def _step(
        self, send: torch.Tensor, recv: torch.Tensor, tag: int, cancel: threading.Event
    ) -> None:
        """Send to the next member and receive from the previous one, blocking (on the
        collective's waiter thread). Empty chunks skip. Nothing new is posted once the
        caller has given up on the collective."""
        assert self._next is not None
        assert self._prev is not None
        if cancel.is_set():
            raise _Cancelled
        posted: list[dist.Work] = []
        if send.numel():
            link, peer = self._next
            posted.append(link.send(send, peer, tag))
        if recv.numel():
            link, peer = self._prev
            posted.append(link.recv(recv, peer, tag))
        for work in posted:
            work.wait(DETACHED)

    def _start(self, collective: Callable[[threading.Event], None], op: str) -> _RingWork:
        """Run ``collective`` on a waiter thread (one thread hand-off per collective,
        whatever the ring size); :meth:`_RingWork.wait` waits for it, bounded by the
        timeout and the abort signal.

        A collective given up on stays parked on its thread (blocked on a dead or hung
        peer) and posts nothing more, nor does any other collective of the ring still in
        flight; the ring stays ``tainted``.
        """
        assert self.tainted, "a collective runs only after _reserve"
        if self.abort is not None:
            self.abort.check()
        cancel = threading.Event()
        future = WAITERS.submit(functools.partial(collective, cancel))
        work = _RingWork(self, future, cancel, op)
        self._in_flight.add(work)
        return work

    def _give_up(self) -> None:
        for work in list(self._in_flight):
            work.cancel.set()

    def _finished(self, work: _RingWork) -> None:
        self._in_flight.discard(work)
        if not self._in_flight:
            self.tainted = False


class _RingWork:
    """A ring collective running on a waiter thread."""

    def __init__(
        self,
        ring: RingGroup,
        future: concurrent.futures.Future[None],
        cancel: threading.Event,
        op: str,
    ) -> None:
        self.ring, self.future, self.cancel, self.op = ring, future, cancel, op
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        ring = self.ring
        try:
            if self.future.done():  # no hand-off to wait for what is already there
                done = True
                self.future.result()
            else:
                done, _ = await_future(self.future, ring.timeout.total_seconds(), ring.abort)
        except StepAborted:
            ring._give_up()
            raise
        except (RuntimeError, _Cancelled) as exc:
            ring._give_up()
            raise CommError(ring.name, self.op, exc) from exc
        if not done:
            ring._give_up()
            raise CommError(ring.name, self.op, f"timed out after {ring.timeout}")
        self.done = True
        ring._finished(self)


class _CopyBack:
    """A started collective whose result is copied into a non-contiguous output."""

    def __init__(self, work: CollectiveWork, output: torch.Tensor, flat: torch.Tensor) -> None:
        self.work, self.output, self.flat = work, output, flat

    def wait(self) -> None:
        self.work.wait()
        self.output.copy_(self.flat.view(self.output.shape))


class _Cancelled(Exception):
    """A given-up collective's thread stops before posting its next step."""
