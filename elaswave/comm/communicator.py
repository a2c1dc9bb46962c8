"""The communicator: the set of named groups a worker belongs to, built from a store.

Each group lives under its own store prefix ``g{generation}/{name}``, so groups of a
later generation never collide with earlier ones. Every rank creates its groups in one
global order (sorted by name), which is deadlock-free: the first unfinished group in that
order always has all its members waiting on it. The dynamic communicator
(:mod:`elaswave.comm.dynamic`) edits this set group by group instead of rebuilding it;
it also holds :class:`~elaswave.comm.ring.RingGroup` objects here, under their names.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from functools import partial
from typing import TypeVar

import structlog
import torch
import torch.distributed as dist

from elaswave.comm.abort import Abort, AbortSignal, AbortSince, on_fresh_thread
from elaswave.comm.backend import GroupBackend
from elaswave.comm.group import CollectiveGroup, Group, P2PGroup
from elaswave.comm.links import PairGroup
from elaswave.comm.release import ABORT_DEADLINE_S, Released, abort_all, release
from elaswave.comm.ring import RingGroup
from elaswave.comm.spec import GroupSpec

log = structlog.get_logger(__name__)

T = TypeVar("T")

CommGroup = Group | RingGroup | PairGroup
"""A gloo process group; a ring over pooled links with the same collectives; or a
2-rank view over a pooled link with the same point-to-point methods. Callers that use a
group take it as a :class:`~elaswave.comm.group.CollectiveGroup` or a
:class:`~elaswave.comm.group.P2PGroup` (:meth:`Communicator.collective`,
:meth:`Communicator.p2p`)."""


class Communicator:
    def __init__(
        self,
        store: dist.Store,
        rank: int,
        backend: GroupBackend,
        *,
        timeout: timedelta,
        generation: int = 0,
        abort: AbortSignal | None = None,
        device: torch.device | None = None,
        prefix: str = "",
    ) -> None:
        self.prefix = prefix
        """Prepended to every group's store prefix (keeps planes apart)."""
        self.abort = abort
        self.device = device if device is not None else torch.device("cpu")
        self.store = store
        self.rank = rank
        self.backend = backend
        self.timeout = timeout
        self.generation = generation
        self._groups: dict[str, CommGroup] = {}
        self.dropped: list[CommGroup] = []
        """Groups an :meth:`edit` did not carry over (they may have work in flight)."""
        self.retired: list[CommGroup] = []
        """Every group this plane's edits dropped so far, where its backend does not park
        work (gloo), kept alive: freeing a gloo process group while a wait is parked on
        it takes the process down. Where work parks (NCCL), a dropped group is aborted,
        which ends every wait on it, and then freed with its threads."""

    def build(
        self,
        specs: Iterable[GroupSpec],
        *,
        answering: bool = False,
        concerning: Iterable[int] | None = None,
    ) -> float:
        """Create every group of ``specs`` that contains this rank. Returns seconds taken.

        A failure announced meanwhile abandons the build (StepAborted); ``answering``:
        the build answers the failure the signal holds now (a group rebuilt while its
        rank reports), and only a later one abandons it, one naming a rank of
        ``concerning`` if given (:class:`~elaswave.comm.abort.AbortSince`)."""
        started = time.perf_counter()
        later = (
            AbortSince(self.abort, concerning)
            if answering and self.abort is not None
            else self.abort
        )
        ordered = sorted(specs, key=lambda s: s.name)
        names = [s.name for s in ordered]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate group names in {names}")
        for spec in ordered:
            if self.rank not in spec.ranks:
                continue
            prefix = f"{self.prefix}g{self.generation}/{spec.name}"
            create = partial(
                self.backend.create,
                dist.PrefixStore(prefix, self.store),
                spec.ranks.index(self.rank),
                len(spec.ranks),
                self.timeout,
                name=spec.name,
            )
            connected = partial(self._connected, spec, create, later)
            self._groups[spec.name] = on_fresh_thread(
                connected, name=f"ew-create-{spec.name}", abort=later
            )
        elapsed = time.perf_counter() - started
        log.info("communicator.built", rank=self.rank, groups=len(self._groups), seconds=elapsed)
        return elapsed

    def _connected(
        self, spec: GroupSpec, create: Callable[[], dist.ProcessGroup], later: Abort | None
    ) -> Group:
        """The group of ``spec``, created and connected (its point-to-point pairs, and
        its collectives where the backend connects them lazily). On a creation thread of
        its own: a member that fails meanwhile leaves it waiting there, not the caller;
        when its wait ends (aborted, or its launch bound) the group is aborted, so that
        no work of a group nobody holds stays on the device. Its waits here end on
        ``later`` (see :meth:`build`'s ``answering``)."""
        group = Group(
            spec, create(), self.rank, self.timeout, later, self.device,
            parks=self.backend.parks_in_flight,
        )  # fmt: skip
        try:
            group.connect()
            if spec.collectives and group.size > 1:
                group.warm(self.backend.warm_sizes)
        except BaseException:
            group.abort_now()
            raise
        group.abort = self.abort  # a step's waits end for any failure announced
        return group

    def edit(
        self,
        specs: Iterable[GroupSpec],
        *,
        generation: int,
        rebuild: Callable[[GroupSpec], bool] = lambda spec: False,
    ) -> tuple[Communicator, int]:
        """The communicator for ``specs``: same-membership groups are reused as they are.

        A group is carried over (the same object) when ``specs`` holds it with the same
        members and ``rebuild(spec)`` is false; every other group of ``specs`` that has
        this rank is created under the new generation's prefix. Members agree without
        talking: they all hold the same old specs. Returns (communicator, groups reused).
        """
        new = Communicator(
            self.store,
            self.rank,
            self.backend,
            timeout=self.timeout,
            generation=generation,
            abort=self.abort,
            device=self.device,
            prefix=self.prefix,
        )
        create = []
        for spec in specs:
            old = self._groups.get(spec.name)
            if old is not None and old.spec == spec and not rebuild(spec):
                new._groups[spec.name] = old
            else:
                create.append(spec)
        new.build(create)
        kept = set(map(id, new._groups.values()))
        self.dropped = [g for g in self._groups.values() if id(g) not in kept]
        if self.backend.parks_in_flight:  # an idle NCCL communicator holds device memory
            abort_all([g for g in self.dropped if isinstance(g, Group)])
        else:  # gloo: a wait may be parked on a dropped group
            new.retired = [*self.retired, *self.dropped]
        return new, sum(1 for g in self._groups.values() if id(g) in kept)

    def release(self, failed: Iterable[int], deadline_s: float = ABORT_DEADLINE_S) -> Released:
        """Abort the groups that hold a failed rank, or, where work in flight parks
        (NCCL), that have any (:mod:`elaswave.comm.release`). They stay, ``tainted``,
        until an :meth:`edit` replaces them."""
        return release(self.process_groups(), set(failed), deadline_s=deadline_s)

    def __len__(self) -> int:
        """The communicators this rank holds."""
        return len(self._groups)

    def put(self, group: CommGroup) -> None:
        """Hold ``group`` under its name (a ring, or a group carried over from another
        communicator). The name must be free."""
        if group.name in self._groups:
            raise ValueError(f"group {group.name!r} is already in the communicator")
        if self.rank not in group.spec.ranks:
            raise ValueError(f"rank {self.rank} is not a member of group {group.name!r}")
        self._groups[group.name] = group

    def __getitem__(self, name: str) -> CommGroup:
        return self._groups[name]

    def get(self, name: str) -> CommGroup | None:
        return self._groups.get(name)

    def collective(self, name: str) -> CollectiveGroup:
        """The group ``name``, for collectives; TypeError if it is a pair link."""
        group = self._groups[name]
        if isinstance(group, PairGroup):
            raise TypeError(f"group {name!r} is a point-to-point pair: it has no collectives")
        return group

    def group(self, name: str) -> Group:
        """The process group ``name`` (every group of a device plane is one); TypeError
        if it is a ring or a pair link."""
        group = self._groups[name]
        if not isinstance(group, Group):
            raise TypeError(f"group {name!r} is a {type(group).__name__}, not a process group")
        return group

    def p2p(self, name: str) -> P2PGroup:
        """The group ``name``, for point-to-point traffic; TypeError if it is a ring."""
        group = self._groups[name]
        if isinstance(group, RingGroup):
            raise TypeError(f"group {name!r} is a ring: it has no point-to-point methods")
        return group

    def process_groups(self) -> list[Group]:
        """The groups that are process groups of their own (not rings or pair views over
        pooled links): what an abort can release."""
        return [g for g in self._groups.values() if isinstance(g, Group)]

    def groups(self) -> list[CommGroup]:
        """Every group this rank holds, sorted by name."""
        return [self._groups[name] for name in sorted(self._groups)]

    @property
    def specs(self) -> list[GroupSpec]:
        """The specs of the groups this rank holds, sorted by name."""
        return [g.spec for g in self.groups()]

    def tainted(self) -> list[str]:
        """Names of the groups with a collective that did not complete."""
        return sorted(n for n, g in self._groups.items() if g.tainted)

    @property
    def names(self) -> list[str]:
        return sorted(self._groups)
