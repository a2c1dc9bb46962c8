"""The dynamic communicator (§6.1): a membership change edits only what it touches.

When ranks leave (or join), the worker's named groups are carried into the new
membership by editing them: every group whose members did not change is reused as the
same object; a ring (DP group) that lost or gained members is re-formed over the links it
already has, creating only the missing ones (one failure in a ring of D >= 4: one new
link, between the failed rank's two neighbours); every 2-rank group (a pipeline route, a
snapshot or remap link) is a view over the pooled link of its pair, so a change connects
only pairs that no link serves yet, whatever purpose the existing link was made for;
links and groups to a removed rank are dropped without any collective on them. (The
paper's baselines, a partial and a full restart of the communicator, are in
``benchmarks/rebuild.py``, which builds on this module.)

Which groups are rings is decided by a predicate (by default the trainer's DP groups,
``dp.s{stage}``, see :func:`elaswave.engine.plan.dp_group_name`). Every other 2-rank group
is a :class:`~elaswave.comm.links.PairGroup`; larger groups are gloo groups.

The plan of a change is a pure function of this rank's groups, its pooled links and the
new membership (:func:`plan_change`); :class:`DynamicCommunicator` executes it. Only
survivors apply a change, all with the same arguments. They create what they need in
one global order, full groups by name first, then links by pair, which is deadlock-free
for the reason given in :mod:`elaswave.comm.communicator`. A rank that joins calls
:meth:`DynamicCommunicator.build` with the new membership and generation.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import timedelta

import structlog
import torch.distributed as dist

from elaswave.comm.abort import AbortSignal
from elaswave.comm.backend import GroupBackend
from elaswave.comm.communicator import CommGroup, Communicator
from elaswave.comm.group import Group
from elaswave.comm.links import LinkPool, Pair, PairGroup, pair
from elaswave.comm.ring import RingGroup, ring_pairs
from elaswave.comm.spec import GroupSpec

log = structlog.get_logger(__name__)

DP_GROUP_PREFIX = "dp."
"""Prefix of the trainer's DP group names (``dp.s{stage}``)."""

EDIT = "edit"
"""The :attr:`ChangeStats.strategy` of the dynamic communicator's changes."""


def is_dp_group(spec: GroupSpec) -> bool:
    """The default ring predicate: the trainer's DP groups."""
    return spec.name.startswith(DP_GROUP_PREFIX)


def _never(spec: GroupSpec) -> bool:
    return False


def shrink_specs(
    specs: Iterable[GroupSpec],
    removed: Collection[int],
    *,
    is_ring: Callable[[GroupSpec], bool] = is_dp_group,
) -> list[GroupSpec]:
    """The groups after ``removed`` leave: a ring keeps its survivors in ring order; any
    other group that loses a member is dropped (a link to a dead rank means nothing)."""
    out = []
    for spec in specs:
        if not set(spec.ranks) & set(removed):
            out.append(spec)
        elif is_ring(spec):
            survivors = tuple(r for r in spec.ranks if r not in removed)
            if survivors:
                out.append(replace(spec, ranks=survivors))
    return out


@dataclass(frozen=True, kw_only=True)
class ChangePlan:
    """What one rank does for one membership change."""

    reuse: tuple[str, ...]
    """Groups carried over as the same objects."""
    rings: tuple[GroupSpec, ...]
    """Rings (re-)formed over pooled links."""
    pairs: tuple[GroupSpec, ...]
    """2-rank groups served as views over the pooled link of their pair."""
    groups: tuple[GroupSpec, ...]
    """Groups created as full process groups, in creation order (by name)."""
    drop: tuple[str, ...]
    """Groups of the old membership not carried over."""
    retire_links: tuple[Pair, ...]
    """Pooled links taken out: those touching a removed rank, and those no group of the
    new membership uses (a change's remap links, routes the new plan does not keep), so
    that a rank's links follow its plan rather than pile up over changes."""
    new_links: tuple[Pair, ...]
    """Links this rank creates for its rings, in creation order (by pair)."""
    kept_links: tuple[Pair, ...]
    """Pooled links the (re-)formed rings use again."""


def check_change(*, rank: int, specs: Sequence[GroupSpec], removed: Collection[int]) -> None:
    """ValueError unless ``specs`` can be the membership after ``removed`` leave, as
    applied by ``rank``: group names are unique, ``rank`` is a survivor, and no group
    holds a removed rank."""
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate group names in {sorted(names)}")
    if rank in removed:
        raise ValueError(f"rank {rank} is being removed; only survivors apply a change")
    stale = [s.name for s in specs if set(s.ranks) & set(removed)]
    if stale:
        raise ValueError(f"groups {stale} still contain removed ranks {sorted(removed)}")


def links_used(
    rank: int, specs: Iterable[GroupSpec], *, is_ring: Callable[[GroupSpec], bool] = is_dp_group
) -> frozenset[Pair]:
    """The pooled links ``rank``'s groups of ``specs`` run over: its ring neighbours'
    and its 2-rank groups'. Both ends of a pair find the same answer from the same
    specs (a pair is used when some group holds both as ring neighbours or as its two
    members), so both keep a link or both retire it, with no message."""
    used: set[Pair] = set()
    for spec in specs:
        if rank not in spec.ranks:
            continue
        if is_ring(spec):
            used.update(p for p in ring_pairs(spec.ranks) if rank in p)
        elif len(spec.ranks) == 2:
            used.add(pair(*spec.ranks))
    return frozenset(used)


def plan_change(
    *,
    rank: int,
    current: Iterable[GroupSpec],
    pooled: Collection[Pair],
    specs: Iterable[GroupSpec],
    removed: Collection[int] = (),
    is_ring: Callable[[GroupSpec], bool] = is_dp_group,
    rebuild: Callable[[GroupSpec], bool] = _never,
) -> ChangePlan:
    """Plan the change of this rank's groups from ``current`` to ``specs`` (pure).

    ``current`` are the specs of the groups this rank holds, ``pooled`` its links,
    ``specs`` the new membership's groups (those without this rank are ignored). A group
    is reused only if its spec is unchanged and ``rebuild(spec)`` is false; a rebuilt
    ring is re-formed over the links it has (no new link, fresh tag space).
    """
    specs = list(specs)
    check_change(rank=rank, specs=specs, removed=removed)
    old = {s.name: s for s in current}
    used = links_used(rank, specs, is_ring=is_ring)
    retire = sorted(p for p in pooled if p[0] in removed or p[1] in removed or p not in used)
    pooled_after = set(pooled) - set(retire)
    reuse, rings, pairs, groups = [], [], [], []
    for spec in sorted((s for s in specs if rank in s.ranks), key=lambda s: s.name):
        if old.get(spec.name) == spec and not rebuild(spec):
            reuse.append(spec.name)
        elif is_ring(spec):
            rings.append(spec)
        elif len(spec.ranks) == 2:
            pairs.append(spec)
        else:
            groups.append(spec)
    needed = sorted(
        {p for s in rings for p in ring_pairs(s.ranks) if rank in p}
        | {pair(*s.ranks) for s in pairs}
    )
    return ChangePlan(
        reuse=tuple(reuse),
        rings=tuple(rings),
        pairs=tuple(pairs),
        groups=tuple(groups),
        drop=tuple(sorted(set(old) - set(reuse))),
        retire_links=tuple(retire),
        new_links=tuple(p for p in needed if p not in pooled_after),
        kept_links=tuple(p for p in needed if p in pooled_after),
    )


@dataclass(frozen=True, kw_only=True)
class ChangeStats:
    """One rank's account of one change. Link counts are this rank's pairwise
    connections: a new 2-rank link counts once on each end, a new full group of n
    members n - 1 on each member."""

    strategy: str
    """How the groups were carried over: :data:`EDIT` (the baselines in
    ``benchmarks/rebuild.py`` name theirs)."""
    generation: int
    rank: int
    seconds: float
    groups_created: int
    """Rings formed, pair views made and full groups created."""
    groups_reused: int
    groups_dropped: int
    links_created: int
    links_reused: int
    links_retired: int

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def may_be_parked(group: CommGroup) -> bool:
    """Whether a wait may be blocked on ``group``, so that freeing it now could take the
    process down (a gloo group freed under a blocked wait does). Rings and pair groups
    post every operation on their links, which hold each until it completes: one whose
    links hold nothing pending blocks no wait (a thread still running one of its
    collectives holds it itself). A full group keeps no such record: always kept."""
    if isinstance(group, PairGroup):
        return group.link.posted.pending() > 0
    if isinstance(group, RingGroup):
        return any(link.posted.pending() > 0 for link in group.links)
    return True


class DynamicCommunicator:
    """A worker's named groups (rings over pooled links, and gloo groups) under changes.

    :attr:`comm` is an ordinary :class:`Communicator` (``comm[name]``, ``get``,
    ``names``, ``generation``) holding the current groups; each change replaces it.
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        backend: GroupBackend,
        *,
        timeout: timedelta,
        generation: int = 0,
        abort: AbortSignal | None = None,
        is_ring: Callable[[GroupSpec], bool] = is_dp_group,
    ) -> None:
        self.store = store
        self.rank = rank
        self.backend = backend
        self.timeout = timeout
        self.abort = abort
        self.is_ring = is_ring
        self.links = LinkPool(store, rank, backend, timeout=timeout, abort=abort)
        self._comm = self._communicator(generation)
        self.retired: list[CommGroup] = []
        """Groups no change carried over that may have a wait parked on them, kept alive
        (:func:`may_be_parked`); the others are let go at the next change."""

    @property
    def comm(self) -> Communicator:
        return self._comm

    @property
    def generation(self) -> int:
        return self._comm.generation

    def __getitem__(self, name: str) -> CommGroup:
        return self._comm[name]

    def get(self, name: str) -> CommGroup | None:
        return self._comm.get(name)

    @property
    def names(self) -> list[str]:
        return self._comm.names

    def build(self, specs: Iterable[GroupSpec]) -> ChangeStats:
        """Create this rank's groups of ``specs`` (rings with all their links) under the
        current generation: the start-up build, or a joining rank's first build."""
        if self._comm.names:
            raise ValueError("the communicator is already built; use apply() for a change")
        plan = plan_change(
            rank=self.rank,
            current=(),
            pooled=self.links.pairs,
            specs=specs,
            is_ring=self.is_ring,
        )
        return self._execute(plan, self.generation, removed=())

    def apply(
        self,
        specs: Iterable[GroupSpec] | None = None,
        *,
        removed: Collection[int] = (),
        generation: int | None = None,
        rebuild: Callable[[GroupSpec], bool] = _never,
    ) -> ChangeStats:
        """Carry the groups into the new membership ``specs`` by editing them.

        ``specs`` defaults to this rank's groups with ``removed`` taken out
        (:func:`shrink_specs`); for ranks joining, pass the new membership's specs.
        ``generation`` (default: current + 1) names the new groups' store prefixes and
        must be the same on every member. Returns this rank's :class:`ChangeStats`.
        """
        new_generation = self.next_generation(generation)
        if specs is None:
            specs = shrink_specs(self._comm.specs, removed, is_ring=self.is_ring)
        plan = plan_change(
            rank=self.rank,
            current=self._comm.specs,
            pooled=self.links.pairs,
            specs=specs,
            removed=removed,
            is_ring=self.is_ring,
            rebuild=rebuild,
        )
        return self._execute(plan, new_generation, removed=removed)

    def next_generation(self, generation: int | None) -> int:
        """``generation``, or the current one + 1 by default; it must be above the
        current one."""
        new_generation = self.generation + 1 if generation is None else generation
        if new_generation <= self.generation:
            raise ValueError(
                f"generation {new_generation} must be above the current {self.generation}"
            )
        return new_generation

    # ----------------------------------------------------------------- execution

    def _communicator(self, generation: int) -> Communicator:
        return Communicator(
            self.store,
            self.rank,
            self.backend,
            timeout=self.timeout,
            generation=generation,
            abort=self.abort,
        )

    def _execute(
        self, plan: ChangePlan, generation: int, *, removed: Collection[int]
    ) -> ChangeStats:
        started = time.perf_counter()
        old = self._comm
        retired_links = self._retire_links(plan, removed)
        assert tuple(retired_links) == plan.retire_links, (retired_links, plan.retire_links)

        new = self._communicator(generation)
        for name in plan.reuse:
            new.put(old[name])
        # One global creation order: full groups by name, then links by pair.
        self._create_groups(plan, generation, new)
        created_links = self.links.connect(plan.new_links, generation=generation)
        for spec in plan.rings:
            new.put(
                RingGroup(
                    spec,
                    self.rank,
                    self.links,
                    timeout=self.timeout,
                    generation=generation,
                    abort=self.abort,
                )
            )
        for spec in plan.pairs:
            new.put(PairGroup(spec, self.rank, self.links, timeout=self.timeout, abort=self.abort))
        dropped = [old[name] for name in plan.drop]
        self.retired = [g for g in [*self.retired, *dropped] if may_be_parked(g)]
        old.dropped = dropped
        self._comm = new
        seconds = time.perf_counter() - started
        stats = self._stats(
            plan,
            generation=generation,
            seconds=seconds,
            created_links=created_links,
            retired_links=len(retired_links),
        )
        log.info("communicator.changed", **stats.to_dict())
        return stats

    def _retire_links(self, plan: ChangePlan, removed: Collection[int]) -> list[Pair]:
        """Take the plan's retired links out of the pool."""
        return self.links.retire((), pairs=plan.retire_links)

    def _create_groups(self, plan: ChangePlan, generation: int, into: Communicator) -> None:
        """Create the plan's full groups, by name (the links come after)."""
        into.build(plan.groups)

    def _stats(
        self,
        plan: ChangePlan,
        *,
        generation: int,
        seconds: float,
        created_links: int,
        retired_links: int,
    ) -> ChangeStats:
        """This rank's account of ``plan``, executed (the groups now in :attr:`comm`)."""
        reused = [self._comm[name] for name in plan.reuse]
        mine = [s for s in plan.groups if self.rank in s.ranks]
        pooled_links = set(plan.kept_links)
        full_links = 0
        for group in reused:
            if isinstance(group, RingGroup):
                pooled_links.update(group.pairs)
            elif isinstance(group, PairGroup):
                pooled_links.add(group.link.pair)
            else:
                assert isinstance(group, Group)
                full_links += group.size - 1
        return ChangeStats(
            strategy=EDIT,
            generation=generation,
            rank=self.rank,
            seconds=seconds,
            groups_created=len(plan.rings) + len(plan.pairs) + len(mine),
            groups_reused=len(plan.reuse),
            groups_dropped=len(plan.drop),
            links_created=created_links + sum(len(s.ranks) - 1 for s in mine),
            links_reused=len(pooled_links) + full_links,
            links_retired=retired_links,
        )
