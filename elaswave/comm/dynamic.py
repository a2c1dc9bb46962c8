"""The dynamic communicator (§6.1): a membership change edits only what it touches.

When ranks leave (or join), the worker's named groups are carried into the new
membership by one of three strategies, the paper's method and its two baselines:

* :attr:`RebuildStrategy.EDIT` (the dynamic communicator): every group whose members did
  not change is reused as the same object; a ring (DP group) that lost or gained members
  is re-formed over the links it already has, creating only the missing ones (one
  failure in a ring of D >= 4: one new link, between the failed rank's two neighbours);
  every 2-rank group (a pipeline route, a snapshot or remap link) is a view over the
  pooled link of its pair, so a change connects only pairs that no link serves yet,
  whatever purpose the existing link was made for; links and groups to a removed rank
  are dropped without any collective on them.
* :attr:`RebuildStrategy.PARTIAL` (partial restart): every group whose members changed
  is created from scratch as a full gloo process group; the others are reused.
* :attr:`RebuildStrategy.FULL` (full restart): every group and link is dropped and the
  job's communication is initialised again the way a torch job initialises it at
  start-up (Megatron's ``initialize_model_parallel``): ``init_process_group`` over every
  survivor (the global communicator), then ``new_group`` for every group of the job in
  one global order, every rank taking part in the creation of every group.

Which groups are rings is decided by a predicate (by default the trainer's DP groups,
``dp.s{stage}``, see :func:`elaswave.engine.plan.dp_group_name`). Under EDIT every other
2-rank group is a :class:`~elaswave.comm.links.PairGroup`; larger groups are gloo
groups.

The plan of a change is a pure function of this rank's groups, its pooled links and the
new membership (:func:`plan_change`); :class:`DynamicCommunicator` executes it. Only
survivors apply a change, all with the same arguments. They create what they need in
one global order, full groups by name first, then links by pair, which is deadlock-free
for the reason given in :mod:`elaswave.comm.communicator`. A rank that joins calls
:meth:`DynamicCommunicator.build` with the new membership and generation.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import asdict, dataclass
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


class RebuildStrategy(enum.StrEnum):
    EDIT = "edit"
    PARTIAL = "partial"
    FULL = "full"


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
                out.append(GroupSpec(spec.name, survivors))
    return out


@dataclass(frozen=True)
class ChangePlan:
    """What one rank does for one membership change."""

    strategy: RebuildStrategy
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
    world: tuple[int, ...]
    """FULL only: the ranks of the re-initialised global group, in rank order. Every one
    of them takes part in creating every group of ``groups``, which then holds every
    group of the job, not only this rank's."""
    retire_links: tuple[Pair, ...]
    """Pooled links taken out: those touching a removed rank (all of them for FULL)."""
    new_links: tuple[Pair, ...]
    """Links this rank creates for its rings, in creation order (by pair)."""
    kept_links: tuple[Pair, ...]
    """Pooled links the (re-)formed rings use again."""


def plan_change(
    *,
    rank: int,
    current: Iterable[GroupSpec],
    pooled: Collection[Pair],
    specs: Iterable[GroupSpec],
    removed: Collection[int] = (),
    strategy: RebuildStrategy = RebuildStrategy.EDIT,
    is_ring: Callable[[GroupSpec], bool] = is_dp_group,
    rebuild: Callable[[GroupSpec], bool] = _never,
) -> ChangePlan:
    """Plan the change of this rank's groups from ``current`` to ``specs`` (pure).

    ``current`` are the specs of the groups this rank holds, ``pooled`` its links,
    ``specs`` the new membership's groups (those without this rank are ignored, except
    under FULL, where every rank creates every group of the job: there ``specs`` must be
    the whole job's groups, the same on every survivor). A group
    is reused only if its spec is unchanged and ``rebuild(spec)`` is false; under EDIT a
    rebuilt ring is re-formed over the links it has (no new link, fresh tag space).
    """
    strategy = RebuildStrategy(strategy)
    specs = list(specs)
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate group names in {sorted(names)}")
    if rank in removed:
        raise ValueError(f"rank {rank} is being removed; only survivors apply a change")
    stale = [s.name for s in specs if set(s.ranks) & set(removed)]
    if stale:
        raise ValueError(f"groups {stale} still contain removed ranks {sorted(removed)}")

    old = {s.name: s for s in current}
    if strategy is RebuildStrategy.FULL:
        retire = sorted(pooled)
    else:
        retire = sorted(p for p in pooled if p[0] in removed or p[1] in removed)
    pooled_after = set(pooled) - set(retire)

    if strategy is RebuildStrategy.FULL:
        world = sorted({r for s in specs for r in s.ranks} | {rank})
        return ChangePlan(
            strategy=strategy,
            reuse=(),
            rings=(),
            pairs=(),
            groups=tuple(sorted(specs, key=lambda s: s.name)),
            drop=tuple(sorted(old)),
            world=tuple(world),
            retire_links=tuple(retire),
            new_links=(),
            kept_links=(),
        )
    reuse, rings, pairs, groups = [], [], [], []
    for spec in sorted((s for s in specs if rank in s.ranks), key=lambda s: s.name):
        if old.get(spec.name) == spec and not rebuild(spec):
            reuse.append(spec.name)
        elif strategy is RebuildStrategy.EDIT and is_ring(spec):
            rings.append(spec)
        elif strategy is RebuildStrategy.EDIT and len(spec.ranks) == 2:
            pairs.append(spec)
        else:
            groups.append(spec)
    needed = sorted(
        {p for s in rings for p in ring_pairs(s.ranks) if rank in p}
        | {pair(*s.ranks) for s in pairs}
    )
    return ChangePlan(
        strategy=strategy,
        reuse=tuple(reuse),
        rings=tuple(rings),
        pairs=tuple(pairs),
        groups=tuple(groups),
        drop=tuple(sorted(set(old) - set(reuse))),
        world=(),
        retire_links=tuple(retire),
        new_links=tuple(p for p in needed if p not in pooled_after),
        kept_links=tuple(p for p in needed if p in pooled_after),
    )


@dataclass(frozen=True)
class ChangeStats:
    """One rank's account of one change. Link counts are this rank's pairwise
    connections: a new 2-rank link counts once on each end, a new full group of n
    members n - 1 on each member (a full rebuild's global group of N ranks: N - 1)."""

    strategy: RebuildStrategy
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
        out = asdict(self)
        out["strategy"] = str(self.strategy)
        return out


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
        self.links = LinkPool(store, rank, backend, timeout=timeout)
        self._comm = self._communicator(generation)
        self.retired: list[CommGroup] = []
        """Groups no change carried over. Kept alive: one may have a wait parked on it."""

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
        strategy: RebuildStrategy = RebuildStrategy.EDIT,
        generation: int | None = None,
        rebuild: Callable[[GroupSpec], bool] = _never,
    ) -> ChangeStats:
        """Carry the groups into the new membership ``specs`` by ``strategy``.

        ``specs`` defaults to this rank's groups with ``removed`` taken out
        (:func:`shrink_specs`); for ranks joining, pass the new membership's specs.
        ``generation`` (default: current + 1) names the new groups' store prefixes and
        must be the same on every member. Returns this rank's :class:`ChangeStats`.
        """
        new_generation = self.generation + 1 if generation is None else generation
        if new_generation <= self.generation:
            raise ValueError(
                f"generation {new_generation} must be above the current {self.generation}"
            )
        strategy = RebuildStrategy(strategy)
        if specs is None:
            if strategy is RebuildStrategy.FULL:
                raise ValueError("a full rebuild creates every group of the job: pass specs")
            specs = shrink_specs(self._comm.specs, removed, is_ring=self.is_ring)
        plan = plan_change(
            rank=self.rank,
            current=self._comm.specs,
            pooled=self.links.pairs,
            specs=specs,
            removed=removed,
            strategy=strategy,
            is_ring=self.is_ring,
            rebuild=rebuild,
        )
        return self._execute(plan, new_generation, removed=removed)

    # ----------------------------------------------------------------- execution

    def _initialise_world(self, plan: ChangePlan, generation: int, into: Communicator) -> None:
        """FULL: initialise communication again as a torch job does at start-up.

        The global group over every survivor (``init_process_group``, replacing the one
        a previous full rebuild made), then ``new_group`` for every group of the job in
        name order; each call is collective over the whole world (a store barrier), as in
        Megatron's ``initialize_model_parallel``. Members keep their groups.
        """
        world = list(plan.world)
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group(
            self.backend.name,
            store=dist.PrefixStore(f"world/g{generation}", self.store),
            rank=world.index(self.rank),
            world_size=len(world),
            timeout=self.timeout,
        )
        for spec in plan.groups:
            pg = dist.new_group(
                [world.index(r) for r in spec.ranks], timeout=self.timeout, sort_ranks=False
            )
            if self.rank in spec.ranks:
                into.put(Group(spec, pg, self.rank, self.timeout, self.abort))

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
        if plan.strategy is RebuildStrategy.FULL:
            retired_links = self.links.retire()
        else:
            retired_links = self.links.retire(removed)
        assert tuple(retired_links) == plan.retire_links, (retired_links, plan.retire_links)

        new = self._communicator(generation)
        for name in plan.reuse:
            new.put(old[name])
        # One global creation order: full groups by name, then links by pair.
        if plan.strategy is RebuildStrategy.FULL:
            self._initialise_world(plan, generation, new)
        else:
            new.build(plan.groups)
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
        self.retired.extend(dropped)
        old.dropped = dropped
        self._comm = new
        seconds = time.perf_counter() - started

        reused = [new[name] for name in plan.reuse]
        mine = [s for s in plan.groups if self.rank in s.ranks]
        world_links = len(plan.world) - 1 if plan.world else 0
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
        stats = ChangeStats(
            strategy=plan.strategy,
            generation=generation,
            rank=self.rank,
            seconds=seconds,
            groups_created=len(plan.rings) + len(plan.pairs) + len(mine) + int(bool(plan.world)),
            groups_reused=len(plan.reuse),
            groups_dropped=len(plan.drop),
            links_created=created_links + world_links + sum(len(s.ranks) - 1 for s in mine),
            links_reused=len(pooled_links) + full_links,
            links_retired=len(retired_links),
        )
        log.info("communicator.changed", **stats.to_dict())
        return stats
