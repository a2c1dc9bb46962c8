"""Pooled pairwise links: the connections the dynamic communicator keeps and reuses.

gloo cannot shrink a process group in place, so the dynamic communicator builds on
2-rank *links* (one small ProcessGroupGloo per pair of ranks) held in a per-process
:class:`LinkPool` keyed by the unordered pair. Every 2-rank group of a plan (a pipeline
route, a snapshot or remap link) is a :class:`PairGroup`, a named view over the pooled
link of its pair, and DP rings (:mod:`elaswave.comm.ring`) run over the links between
ring neighbours. One pair, one connection, whatever the purposes it serves: a membership
change creates only the pairs that no link serves yet.

Waits never time out inside gloo: a gloo wait that times out closes its pair, and a
pooled link that a survivor merely waited on for too long must stay usable. Each wait
runs on a daemon waiter thread with a practically unbounded gloo timeout while the caller
gives up after its own timeout or when the abort signal fires. Purposes sharing a pair
keep apart by tag (:class:`elaswave.comm.group.TagSpace`; ring tags set bit 30).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from typing import cast

import structlog
import torch
import torch.distributed as dist

from elaswave.comm.abort import WAITERS, AbortSignal, await_future, on_fresh_thread
from elaswave.comm.backend import GroupBackend
from elaswave.comm.group import DETACHED, AllOf, Transfer
from elaswave.comm.posted import Posted
from elaswave.comm.spec import CommError, GroupSpec

log = structlog.get_logger(__name__)

Pair = tuple[int, int]
"""A link's two global ranks, lower first."""


def pair(a: int, b: int) -> Pair:
    if a == b:
        raise ValueError(f"a link needs two distinct ranks, got {a} twice")
    return (a, b) if a < b else (b, a)


@dataclass(frozen=True)
class Link:
    """One 2-rank process group; the lower rank is index 0."""

    pair: Pair
    pg: dist.ProcessGroup
    generation: int
    """The change generation it was created in (part of its store prefix)."""
    posted: Posted = field(default_factory=Posted, compare=False)
    """Every send and receive on the link, held until it completes (a freed one that
    had not would stall the link for good: :mod:`elaswave.comm.posted`)."""

    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> dist.Work:
        """Post a send to global rank ``peer`` (raw gloo; the caller maps errors)."""
        return self.posted.hold(self.pg.send([tensor], self.index_of(peer), tag))

    def recv(self, tensor: torch.Tensor, peer: int, tag: int) -> dist.Work:
        """Post a receive from global rank ``peer``; see :meth:`send`."""
        return self.posted.hold(self.pg.recv([tensor], self.index_of(peer), tag))

    def index_of(self, rank: int) -> int:
        return self.pair.index(rank)


class LinkPool:
    """This process's links, keyed by pair; shared by every ring and pair group.

    Both ends of a link always hold the same entry: links are created by both ends in the
    same change and retired by both ends in the same change (when one end is removed, or
    when no group of the new membership uses the pair: :func:`~elaswave.comm.dynamic.
    links_used`), or all at once by a full rebuild, so "is the pair in my pool" has the
    same answer on both ends and needs no message.
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        backend: GroupBackend,
        *,
        timeout: timedelta,
        prefix: str = "link",
        abort: AbortSignal | None = None,
    ) -> None:
        self.abort = abort
        """A failure announced while a link is created ends the wait for it."""
        self.store = store
        self.rank = rank
        self.backend = backend
        self.timeout = timeout
        self.prefix = prefix
        self._links: dict[Pair, Link] = {}
        self.retired: list[Link] = []
        """Links no longer in the pool that an operation may still wait on. Kept alive:
        destroying a process group while a parked wait is blocked on it aborts the
        process. One with nothing pending is let go at the next retirement (with it its
        process group and gloo's threads), so that they do not pile up over changes."""

    def __contains__(self, key: object) -> bool:
        return key in self._links

    def __len__(self) -> int:
        return len(self._links)

    @property
    def pairs(self) -> frozenset[Pair]:
        return frozenset(self._links)

    def get(self, a: int, b: int) -> Link:
        return self._links[pair(a, b)]

    def connect(self, pairs: Iterable[Pair], *, generation: int) -> int:
        """Create every link of ``pairs`` not yet in the pool; returns how many were created.

        Links are created in sorted pair order. Every process does so, which is
        deadlock-free: the smallest unfinished pair always has both ends waiting on it.
        """
        created = 0
        for key in sorted({pair(*p) for p in pairs}):
            if key in self._links:
                continue
            if self.rank not in key:
                raise ValueError(f"rank {self.rank} cannot create link {key} it is not part of")
            lo, hi = key
            prefix = f"{self.prefix}/{lo}-{hi}/g{generation}"
            create = partial(
                self.backend.create,
                dist.PrefixStore(prefix, self.store), key.index(self.rank), 2, self.timeout,
            )  # fmt: skip
            try:
                pg = on_fresh_thread(create, name=f"ew-link-{lo}-{hi}", abort=self.abort)
            except RuntimeError as exc:
                raise CommError(f"link.{lo}-{hi}", "connect", exc) from exc
            self._links[key] = Link(key, pg, generation)
            created += 1
            log.debug("link.connected", rank=self.rank, pair=key, generation=generation)
        return created

    def retire(
        self, ranks: Collection[int] | None = None, *, pairs: Collection[Pair] = ()
    ) -> list[Pair]:
        """Take the links touching any of ``ranks`` (all links if both are left out), and
        those of ``pairs``, out of the pool."""
        every = ranks is None and not pairs
        keys = [
            k
            for k in self._links
            if every or k in pairs or (ranks is not None and (k[0] in ranks or k[1] in ranks))
        ]
        # A wait blocks only on an operation that has not completed: the others can go.
        self.retired = [link for link in self.retired if link.posted.pending()]
        for key in sorted(keys):
            self.retired.append(self._links.pop(key))
        return sorted(keys)


class PairGroup:
    """A named 2-rank group served by the pooled link of its pair (point-to-point only).

    Offers the point-to-point methods of :class:`elaswave.comm.group.Group` with the same
    semantics; the link is shared with every other group and ring over the same pair.
    """

    tainted = False
    """Point-to-point traffic never taints: its tags are unique per generation and step."""

    def __init__(
        self,
        spec: GroupSpec,
        rank: int,
        links: LinkPool,
        *,
        timeout: timedelta,
        abort: AbortSignal | None = None,
    ) -> None:
        if len(spec.ranks) != 2 or rank not in spec.ranks:
            raise ValueError(f"pair group {spec.name} {spec.ranks} must be 2 ranks with {rank}")
        self.spec = spec
        self.rank = rank
        self.timeout = timeout
        self.abort = abort
        try:
            self.link = links.get(*spec.ranks)
        except KeyError:
            raise ValueError(
                f"pair group {spec.name}: link {pair(*spec.ranks)} missing from the pool"
            ) from None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def size(self) -> int:
        return 2

    @property
    def index(self) -> int:
        """This process's position in the group."""
        return self.spec.ranks.index(self.rank)

    def __repr__(self) -> str:
        return f"PairGroup({self.name!r}, ranks={self.spec.ranks}, rank={self.rank})"

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> dist.Work:
        try:
            return self.link.send(tensor, peer, tag)
        except RuntimeError as exc:
            raise CommError(self.name, "send", exc) from exc

    def wait_send(self, work: dist.Work) -> None:
        self._wait(work, "send")

    def batch(self, sends: Sequence[Transfer], recvs: Sequence[Transfer], tag: int) -> dist.Work:
        """Post ``sends`` and ``recvs`` (tensor, the peer) on the link: under gloo none
        blocks another. Waited with :meth:`wait_recv`."""
        works = [self.isend(t, p, tag) for t, p in sends] + [
            self.irecv(t, p, tag) for t, p in recvs
        ]
        return cast(dist.Work, AllOf(works))

    def recv(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        self.wait_recv(self.irecv(tensor, peer, tag))

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> dist.Work:
        """Post a receive; :meth:`wait_recv` waits for it (bounded, abortable)."""
        try:
            return self.link.recv(tensor, peer, tag)
        except RuntimeError as exc:
            raise CommError(self.name, "recv", exc) from exc

    def wait_recv(self, work: dist.Work) -> None:
        self._wait(work, "recv")

    def recv_detached(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        """Receive and wait on the calling thread, unbounded and deaf to the abort signal
        (for background threads that may be abandoned mid-wait)."""
        try:
            work = self.link.recv(tensor, peer, tag)
        except RuntimeError as exc:
            raise CommError(self.name, "recv", exc) from exc
        self.wait_detached(work, "recv")

    def wait_detached(self, work: dist.Work, op: str) -> None:
        """Wait for posted work on the calling thread; see :meth:`recv_detached`."""
        try:
            work.wait(DETACHED)
        except RuntimeError as exc:
            raise CommError(self.name, op, exc) from exc

    def _wait(self, work: dist.Work, op: str) -> None:
        if self.abort is not None:
            self.abort.check()
        future = WAITERS.submit(lambda: work.wait(DETACHED))
        try:
            done, _ = await_future(future, self.timeout.total_seconds(), self.abort)
        except RuntimeError as exc:
            raise CommError(self.name, op, exc) from exc
        if not done:
            raise CommError(self.name, op, f"timed out after {self.timeout}")
