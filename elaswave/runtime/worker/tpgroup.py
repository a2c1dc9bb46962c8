"""A worker's tensor-parallel group: the members of one (stage, replica).

With ``--tp N`` the plan places *units* (its ranks); unit ``u`` is the N processes
``u * N .. u * N + N - 1``, member ``t`` of which runs piece ``t`` of every layer of the
unit's stage. Each member trains in its own *plane*: the plan's groups and links over
the units, between the members with the same ``t`` (a store namespace per plane), so
ZeRO shards, snapshots, live remap and layer migration work per TP piece exactly as
they do whole. Only the layers' own collectives cross planes, over :class:`TpLink`.

The unit is the failure unit: the Core loses a unit when any member exits, and its
other members are released. Between the survivors' members, a recovery agrees through
the store (:func:`unit_report`): every member writes its stop report, and each reads
all of them, so the unit reports (its leader, member 0, publishes) the earliest
committed step of any member, every group a member left tainted, and whether its
parameters' step is known, and every member decides the same about its TP group.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elaswave.comm.abort import AbortSignal
from elaswave.comm.backend import GroupBackend
from elaswave.comm.communicator import Communicator
from elaswave.comm.group import Group
from elaswave.comm.release import abort_all
from elaswave.comm.spec import GroupSpec
from elaswave.model.tensor_parallel import merge_param, split_dim

TP_GROUP = "tp"
"""The name a member reports its TP group under when a collective on it was abandoned."""


def plane_store(store: dist.Store, member: int, tp: int) -> dist.Store:
    """The store namespace of plane ``member`` (the root store when there is no TP)."""
    return store if tp == 1 else dist.PrefixStore(f"plane{member}/", store)


class TpLink:
    """Unit ``unit``'s TP group as member ``member`` sees it, across recoveries: a new
    group (a fresh store prefix) when a collective on the old one was abandoned."""

    def __init__(
        self,
        store: dist.Store,
        *,
        unit: int,
        member: int,
        size: int,
        backend: GroupBackend,
        timeout: timedelta,
        abort: AbortSignal | None,
        device: torch.device | None = None,
    ) -> None:
        self._store = dist.PrefixStore(f"tp/u{unit}/", store)
        self._unit = unit
        self._device = device
        self.member, self._size = member, size
        self._backend, self._timeout, self._abort = backend, timeout, abort
        self.generation = 0
        self.waited_s = 0.0
        self.group = self._build(0)

    def _build(self, generation: int) -> Group:
        """The unit's group of ``generation``. Only a failure of this unit announced
        from now on abandons the build: the members see announcements at different
        moments, and one abandoning a build the others finish would split the unit (a
        rebuild while the unit reports its failure; a joiner starting while another
        unit's members exit, chaos seed 66203 case 19)."""
        comm = Communicator(
            self._store,
            self.member,
            self._backend,
            timeout=self._timeout,
            generation=generation,
            abort=self._abort,
            device=self._device,
        )
        spec = GroupSpec(TP_GROUP, tuple(range(self._size)), collectives=True)
        comm.build([spec], answering=True, concerning=(self._unit,))
        return comm.group(TP_GROUP)

    @property
    def size(self) -> int:
        return self._size

    @property
    def tainted(self) -> bool:
        return self.group.tainted

    def all_reduce(self, tensor: torch.Tensor) -> None:
        started = time.perf_counter()
        try:
            self.group.all_reduce(tensor)
        finally:
            self.waited_s += time.perf_counter() - started

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        started = time.perf_counter()
        try:
            self.group.all_gather(output, input)
        finally:
            self.waited_s += time.perf_counter() - started

    def waited(self) -> float:
        """Seconds spent in the group's collectives so far (the pacer's fail-slow
        emulation stretches compute, not these waits)."""
        return self.waited_s

    def release(self) -> None:
        """After a failure: abort the group if it has work in flight that parks (NCCL);
        it is then reported tainted, and every member rebuilds it."""
        if self.group.parks and self.group.tainted:
            abort_all([self.group])

    def rebuild(self, generation: int) -> None:
        """Every member calls it, with the same ``generation``, while it reports the
        failure the rebuild answers. Only a later failure of this unit abandons it: the
        Core widening the change's failure set with other units (two kills of one step
        seen apart) leaves the members' group to build, as each member sees the same
        announcements but not at the same moment, and one member abandoning a build that
        the other finished would leave the unit split between generations."""
        self.generation = generation
        self.group = self._build(generation)


def unit_report(
    store: dist.Store,
    *,
    unit: int,
    member: int,
    size: int,
    generation: int,
    report: dict[str, Any],
    timeout_s: float,
) -> dict[str, Any]:
    """Write this member's stop report for ``generation`` and return the unit's: the
    earliest ``committed_step``, every ``tainted`` group, ``params_step`` when all
    members agree (-2, unknown, otherwise), and ``newest_step``, the latest committed
    step when members differ (-2 otherwise: a member a step ahead keeps no step before
    its previous one, which the Core must not roll the unit back past). TimeoutError
    when a member does not report (it is lost: the Core releases this one too)."""
    mine = json.dumps(report)
    met = _meet(store, f"g{generation}", unit, member, size, mine, timeout_s=timeout_s,
                what="report")  # fmt: skip
    reports = [json.loads(r) for r in met]
    params = {r["params_step"] for r in reports}
    commits = [r["committed_step"] for r in reports]
    return {
        "committed_step": min(commits),
        "tainted": sorted({name for r in reports for name in r["tainted"]}),
        "params_step": params.pop() if len(params) == 1 else -2,
        "newest_step": max(commits) if max(commits) != min(commits) else -2,
    }


def whole_param(
    name: str, piece: torch.Tensor, tp: TpLink | None, parts: Sequence[int] | None = None
) -> torch.Tensor:
    """Parameter ``name`` whole, joined from every member's piece (each member calls it
    for the same parameters in the same order); ``piece`` itself without TP. The pieces
    are gathered where ``piece`` lives (a device-plane collective). ``parts``: the blocks
    of a fused weight (:func:`~elaswave.model.tensor_parallel.fused_parts`)."""
    if tp is None or split_dim(name) is None:
        return piece
    flat = piece.contiguous().view(-1)
    out = torch.empty(tp.size * flat.numel(), dtype=flat.dtype, device=flat.device)
    tp.all_gather(out, flat)
    return merge_param(name, [p.view_as(piece) for p in out.chunk(tp.size)], parts)


def unit_barrier(
    store: dist.Store,
    name: str,
    unit: int,
    member: int,
    size: int,
    *,
    timeout_s: float,
    what: str,
    abort: AbortSignal | None = None,
) -> None:
    """Return once every member of ``unit`` has reached barrier ``name``: what the
    leader then tells the Core for the unit (a plan acknowledged, a plan applied) is
    true of every member, and at the end the last collectives of each have arrived
    everywhere (gloo may still hold a finished collective's sends when its caller
    returns; a process that exits then loses them). TimeoutError when one does not
    come (it is lost, or hung: the Core fences the unit); StepAborted when ``abort``
    is set meanwhile (a member that will not come: its apply was torn)."""
    _meet(store, name, unit, member, size, "1", timeout_s=timeout_s, what=what, abort=abort)


_POLL_S = 0.1
"""How often a barrier given an abort signal looks at it."""


def _meet(
    store: dist.Store,
    name: str,
    unit: int,
    member: int,
    size: int,
    value: str,
    *,
    timeout_s: float,
    what: str,
    abort: AbortSignal | None = None,
) -> list[str]:
    """Put this member's ``value`` under ``name`` and return every member's, in member
    order, once all are there (looking at ``abort``, if given, every 0.1 s)."""
    keys = [f"unit/{unit}/{name}/m{m}" for m in range(size)]
    store.set(keys[member], value)
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        wait = min(left, _POLL_S) if abort is not None else left
        try:
            store.wait(keys, timedelta(seconds=max(0.001, wait)))
            break
        except RuntimeError as exc:
            if abort is not None:
                abort.check()
            if time.monotonic() >= deadline:
                raise TimeoutError(f"unit {unit}: a TP member did not {what} ({exc})") from None
    return [store.get(k).decode() for k in keys]
