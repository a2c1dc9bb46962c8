"""Where each optimizer shard's host snapshot lives (paper §5.1, made node- and stage-aware).

The paper's ring puts shard i's snapshot on its DP neighbour, which may share a node
with it: losing that node loses both. And a neighbour in the same stage is lost with
it when the whole stage is: a stage down to one rank has no neighbour at all. Here each
owner's snapshot goes to a rank of *another stage* on *another node*
(:func:`place_snapshots_across`), so that losing every rank of one stage, or one node,
loses no state; a one-stage pipeline falls back to the next rank in ring order on
another node, and only when every rank shares one node to the plain ring neighbour (and
says so).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial


def node_of(rank: int, ranks_per_node: int) -> int:
    if ranks_per_node < 1:
        raise ValueError(f"ranks per node = {ranks_per_node}: must be at least 1")
    return rank // ranks_per_node


@dataclass(frozen=True)
class SnapshotPlacement:
    holder: dict[int, int]
    """Owner rank -> rank holding its (first) snapshot in host memory."""
    node_safe: bool
    """True when every snapshot is on a different node from its owner, and an owner's
    copies on different nodes from each other."""
    stage_safe: bool = False
    """True when every snapshot is in a different stage from its owner's (losing a
    whole stage then loses none of its state)."""
    more: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """Owner rank -> the ranks holding its further copies (``--snapshot-copies K``: K-1
    of them), in order of preference."""

    def holders_of(self, owner: int) -> tuple[int, ...]:
        """Every rank holding a copy of ``owner``'s snapshot, the first copy's first."""
        first = self.holder.get(owner)
        return () if first is None else (first, *self.more.get(owner, ()))

    def holds(self, rank: int) -> list[int]:
        """Owners of which ``rank`` holds a copy."""
        return sorted(owner for owner in self.holder if rank in self.holders_of(owner))

    def links(self) -> list[tuple[int, int]]:
        """Every (owner, holder) pair a snapshot is shipped over, sorted."""
        return sorted((owner, h) for owner in self.holder for h in self.holders_of(owner))


def place_snapshots(
    ranks: Sequence[int], ranks_per_node: int, copies: int = 1
) -> SnapshotPlacement:
    """Holder of each DP member's snapshot (and of its further ``copies - 1``).

    Preference order: (1) a uniform ring shift by the smallest k that puts every holder
    on another node: balanced, each rank holds exactly one snapshot; (2) per owner, the
    next rank in ring order on another node: node-safe but possibly unbalanced; (3) the
    paper's plain ring neighbour, when some owner has no other node in its stage.
    """
    first = _place_first(ranks, ranks_per_node)
    if copies <= 1 or len(ranks) <= 2:
        return first
    node = {r: node_of(r, ranks_per_node) for r in ranks}
    more = {}
    for i, owner in enumerate(ranks):  # further copies: on yet other nodes, in ring order
        ring = [ranks[(i + step) % len(ranks)] for step in range(1, len(ranks))]
        chosen = [first.holder[owner]]
        for _ in range(copies - 1):
            left = [r for r in ring if r not in chosen]
            used = {node[owner], *(node[h] for h in chosen)}
            if not left:
                break
            chosen.append(next((r for r in left if node[r] not in used), left[0]))
        more[owner] = tuple(chosen[1:])
    return _with_more(first, more, node, None)


def _place_first(ranks: Sequence[int], ranks_per_node: int) -> SnapshotPlacement:
    n = len(ranks)
    if n == 1:
        return SnapshotPlacement({}, node_safe=False)
    node = {r: node_of(r, ranks_per_node) for r in ranks}
    for shift in range(1, n):
        holder = {owner: ranks[(i + shift) % n] for i, owner in enumerate(ranks)}
        if all(node[o] != node[h] for o, h in holder.items()):
            return SnapshotPlacement(holder, node_safe=True)
    holder, safe = {}, True
    for i, owner in enumerate(ranks):
        ring = [ranks[(i + step) % n] for step in range(1, n)]
        elsewhere = [r for r in ring if node[r] != node[owner]]
        holder[owner] = elsewhere[0] if elsewhere else ring[0]
        safe &= bool(elsewhere)
    return SnapshotPlacement(holder, node_safe=safe)


def _with_more(
    first: SnapshotPlacement,
    more: dict[int, tuple[int, ...]],
    node: dict[int, int],
    stage: dict[int, int] | None,
) -> SnapshotPlacement:
    """``first`` with the further copies ``more``; safety judged over every copy."""
    copies = {o: (h, *more.get(o, ())) for o, h in first.holder.items()}
    node_safe = all(
        len({node[o], *(node[h] for h in hs)}) == 1 + len(hs) for o, hs in copies.items()
    )
    stage_safe = stage is not None and all(
        stage[h] != stage[o] for o, hs in copies.items() for h in hs
    )
    return SnapshotPlacement(first.holder, node_safe, stage_safe, more)


CLASSES = ((True, True), (False, True), (True, False))
"""Holder classes in order of preference: (another stage, another node) both, then
another node, then another stage."""


def _best_class(candidates: list[int], apart: Callable[[int], tuple[bool, bool]]) -> list[int]:
    """The candidates of the best class that has any (``apart(r)``: whether r is in
    another stage, on another node); all of them when none is apart at all."""
    for want in CLASSES:
        ok = [r for r in candidates if all(a or not w for a, w in zip(apart(r), want, strict=True))]
        if ok:
            return ok
    return candidates


HOLDS_AT_MOST = 2
"""Snapshots one rank holds while another rank of the owner's best class holds fewer."""


def _weight(owner: int, holder: int) -> int:
    """A fixed pseudo-random weight of the pair (splitmix64 of both ranks): the same in
    every process, unlike Python's salted hash."""
    x = (owner * 0x9E3779B97F4A7C15 + holder + 1) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def place_snapshots_across(
    stages: Sequence[Sequence[int]], ranks_per_node: int, copies: int = 1
) -> SnapshotPlacement:
    """Holder of every rank's snapshot, over a pipeline's stages (each a list of ranks).

    Each owner takes a rank of the best class it has: in another stage and on another
    node, else on another node, else in another stage (node-safe beats stage-safe: a
    node is lost more often than every rank of a stage), else any. Within the class,
    rendezvous hashing picks the rank of highest :func:`_weight` that holds fewer than
    :data:`HOLDS_AT_MOST` snapshots (owners in rank order; the highest weight of all
    when every one holds that many). The placement is a function of the ranks alone,
    and a change moves few snapshots: a rank that leaves moves the ones it held, and the
    bounded load displaces at most three more (exhaustively over 2-4 stages of 1-4 ranks:
    tests/unit/test_replan.py); a rank that joins takes those it outweighs. So few
    snapshot links are opened and few keepers restart. A one-stage pipeline is
    :func:`place_snapshots` (no other stage exists); a single rank has no holder.

    ``copies`` > 1: each owner's further copies go, one by one, to the best class left
    (:func:`_place_more`), so that its K holders sit on K nodes other than its own
    where the layout has them: losing any K nodes (or K ranks) then loses no state.
    """
    stages = [list(ranks) for ranks in stages if ranks]
    if len(stages) <= 1:
        return place_snapshots(stages[0] if stages else [], ranks_per_node, copies)
    ranks = sorted(r for ranks in stages for r in ranks)
    stage = {r: k for k, members in enumerate(stages) for r in members}
    node = {r: node_of(r, ranks_per_node) for r in ranks}

    def apart(o: int, h: int) -> tuple[bool, bool]:
        return stage[o] != stage[h], node[o] != node[h]

    holder: dict[int, int] = {}
    held = dict.fromkeys(ranks, 0)
    for owner in ranks:
        fit = _best_class([r for r in ranks if r != owner], partial(apart, owner))
        room = [r for r in fit if held[r] < HOLDS_AT_MOST] or fit
        holder[owner] = max(room, key=lambda r: _weight(owner, r))
        held[holder[owner]] += 1
    first = SnapshotPlacement(
        holder,
        node_safe=all(apart(o, h)[1] for o, h in holder.items()),
        stage_safe=all(apart(o, h)[0] for o, h in holder.items()),
    )
    if copies <= 1:
        return first
    return _with_more(first, _place_more(first, stage, node, copies, held), node, stage)


def _apart_from(
    stage: dict[int, int], node: dict[int, int], owner_stage: int, used: set[int], r: int
) -> tuple[bool, bool]:
    """Whether ``r`` is in another stage than the owner's, on a node no copy is on."""
    return stage[r] != owner_stage, node[r] not in used


def _place_more(
    first: SnapshotPlacement,
    stage: dict[int, int],
    node: dict[int, int],
    copies: int,
    held: dict[int, int],
) -> dict[int, tuple[int, ...]]:
    """Each owner's copies after the first: every one on a node none of the owner's
    copies is on yet (and, among those, in another stage) where one is left; within the
    class the rank of highest weight holding fewer than ``HOLDS_AT_MOST`` per copy."""
    more: dict[int, tuple[int, ...]] = {}
    for owner in sorted(first.holder):
        chosen = [first.holder[owner]]
        for k in range(2, copies + 1):
            left = [r for r in node if r != owner and r not in chosen]
            if not left:
                break
            used = {node[owner], *(node[h] for h in chosen)}
            fit = _best_class(left, partial(_apart_from, stage, node, stage[owner], used))
            room = [r for r in fit if held[r] < HOLDS_AT_MOST * k] or fit
            pick = max(room, key=lambda r: _weight(owner, r))
            chosen.append(pick)
            held[pick] += 1
        more[owner] = tuple(chosen[1:])
    return more


def snapshot_link_name(owner: int, holder: int) -> str:
    """The name of the link an owner ships its snapshot over to its holder."""
    return f"snap.{owner}-{holder}"
