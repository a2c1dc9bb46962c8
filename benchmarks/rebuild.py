"""The communicator baselines (paper §6.1): a partial and a full restart of the groups.

ElasWave carries a worker's named groups into a new membership by editing them
(:mod:`elaswave.comm.dynamic`). The baselines it is measured against carry them the way
torch jobs do:

* :attr:`RebuildStrategy.PARTIAL` (partial restart): every group whose members changed
  is created from scratch as a full gloo process group; the others are reused.
* :attr:`RebuildStrategy.FULL` (full restart): every group and link is dropped and the
  job's communication is initialised again the way a torch job initialises it at
  start-up (Megatron's ``initialize_model_parallel``): ``init_process_group`` over every
  survivor (the global communicator), then ``new_group`` for every group of the job in
  one global order, every rank taking part in the creation of every group.

:func:`plan_rebuild` plans a change by any of the three strategies (the edit is
:func:`~elaswave.comm.dynamic.plan_change` itself), and :class:`RebuildingCommunicator`
executes one: the edit through :meth:`~elaswave.comm.dynamic.DynamicCommunicator.apply`,
exactly what ElasWave runs, the baselines through the same executor with their own
steps. ``scripts/bench_communicator.py`` measures the three after a SIGKILL.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch.distributed as dist

from elaswave.comm.communicator import Communicator
from elaswave.comm.dynamic import (
    ChangePlan,
    ChangeStats,
    DynamicCommunicator,
    check_change,
    is_dp_group,
    plan_change,
    shrink_specs,
)
from elaswave.comm.group import Group
from elaswave.comm.links import Pair
from elaswave.comm.spec import GroupSpec


class RebuildStrategy(enum.StrEnum):
    """How a change carries the groups into the new membership."""

    EDIT = "edit"
    """ElasWave's dynamic communicator (:mod:`elaswave.comm.dynamic`)."""
    PARTIAL = "partial"
    """Partial restart: every changed group created again as a full gloo group."""
    FULL = "full"
    """Full restart: everything initialised again, as at a torch job's start-up."""


@dataclass(frozen=True, kw_only=True)
class RebuildPlan(ChangePlan):
    """A :class:`~elaswave.comm.dynamic.ChangePlan` and the strategy that made it."""

    strategy: RebuildStrategy
    world: tuple[int, ...] = ()
    """FULL only: the ranks of the re-initialised global group, in rank order. Every one
    of them takes part in creating every group of ``groups``, which then holds every
    group of the job, not only this rank's; every pooled link is retired."""


def _fields(plan: ChangePlan) -> dict[str, Any]:
    return {f.name: getattr(plan, f.name) for f in dataclasses.fields(ChangePlan)}


def plan_rebuild(
    *,
    rank: int,
    current: Iterable[GroupSpec],
    pooled: Collection[Pair],
    specs: Iterable[GroupSpec],
    removed: Collection[int] = (),
    strategy: RebuildStrategy = RebuildStrategy.EDIT,
    is_ring: Callable[[GroupSpec], bool] = is_dp_group,
) -> RebuildPlan:
    """Plan the change of this rank's groups from ``current`` to ``specs`` by
    ``strategy`` (pure; the arguments as for :func:`~elaswave.comm.dynamic.plan_change`).

    Under FULL, every rank creates every group of the job: there ``specs`` must be the
    whole job's groups, the same on every survivor.
    """
    strategy = RebuildStrategy(strategy)
    specs = list(specs)
    current = list(current)
    if strategy is RebuildStrategy.FULL:
        check_change(rank=rank, specs=specs, removed=removed)
        return RebuildPlan(
            strategy=strategy,
            reuse=(),
            rings=(),
            pairs=(),
            groups=tuple(sorted(specs, key=lambda s: s.name)),
            drop=tuple(sorted({s.name for s in current})),
            world=tuple(sorted({r for s in specs for r in s.ranks} | {rank})),
            retire_links=tuple(sorted(pooled)),
            new_links=(),
            kept_links=(),
        )
    edit = plan_change(
        rank=rank, current=current, pooled=pooled, specs=specs, removed=removed, is_ring=is_ring
    )
    if strategy is RebuildStrategy.EDIT:
        return RebuildPlan(**_fields(edit), strategy=strategy)
    # PARTIAL: every group that is not reused is created as a full gloo group.
    created = sorted(edit.rings + edit.pairs + edit.groups, key=lambda s: s.name)
    partial = dataclasses.replace(
        edit, rings=(), pairs=(), groups=tuple(created), new_links=(), kept_links=()
    )
    return RebuildPlan(**_fields(partial), strategy=strategy)


class RebuildingCommunicator(DynamicCommunicator):
    """A :class:`~elaswave.comm.dynamic.DynamicCommunicator` that can also carry its
    groups into a new membership as the baselines do (:meth:`apply_by`)."""

    def apply_by(
        self,
        strategy: RebuildStrategy,
        specs: Iterable[GroupSpec] | None = None,
        *,
        removed: Collection[int] = (),
        generation: int | None = None,
    ) -> ChangeStats:
        """Carry the groups into the new membership ``specs`` by ``strategy``; the
        arguments as for :meth:`~elaswave.comm.dynamic.DynamicCommunicator.apply`, but a
        full rebuild needs ``specs``: every group of the job."""
        new_generation = self.next_generation(generation)
        strategy = RebuildStrategy(strategy)
        if strategy is RebuildStrategy.EDIT:
            return self.apply(specs, removed=removed, generation=new_generation)
        if specs is None:
            if strategy is RebuildStrategy.FULL:
                raise ValueError("a full rebuild creates every group of the job: pass specs")
            specs = shrink_specs(self.comm.specs, removed, is_ring=self.is_ring)
        plan = plan_rebuild(
            rank=self.rank,
            current=self.comm.specs,
            pooled=self.links.pairs,
            specs=specs,
            removed=removed,
            strategy=strategy,
            is_ring=self.is_ring,
        )
        return self._execute(plan, new_generation, removed=removed)

    def _retire_links(self, plan: ChangePlan, removed: Collection[int]) -> list[Pair]:
        if _is_full(plan):
            return self.links.retire()
        return super()._retire_links(plan, removed)

    def _create_groups(self, plan: ChangePlan, generation: int, into: Communicator) -> None:
        if _is_full(plan):
            self._initialise_world(plan, generation, into)
        else:
            super()._create_groups(plan, generation, into)

    def _initialise_world(self, plan: RebuildPlan, generation: int, into: Communicator) -> None:
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

    def _stats(
        self,
        plan: ChangePlan,
        *,
        generation: int,
        seconds: float,
        created_links: int,
        retired_links: int,
    ) -> ChangeStats:
        """As the edit's, with the strategy's name; a full rebuild also counts its
        global group (one group, N - 1 connections for N ranks)."""
        stats = super()._stats(
            plan,
            generation=generation,
            seconds=seconds,
            created_links=created_links,
            retired_links=retired_links,
        )
        if not isinstance(plan, RebuildPlan):
            return stats
        world_links = len(plan.world) - 1 if plan.world else 0
        return dataclasses.replace(
            stats,
            strategy=str(plan.strategy),
            groups_created=stats.groups_created + int(bool(plan.world)),
            links_created=stats.links_created + world_links,
        )


def _is_full(plan: ChangePlan) -> TypeGuard[RebuildPlan]:
    return isinstance(plan, RebuildPlan) and plan.strategy is RebuildStrategy.FULL
