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

from collections.abc import Sequence
from dataclasses import dataclass


def node_of(rank: int, ranks_per_node: int) -> int:
    if ranks_per_node < 1:
        raise ValueError(f"ranks per node = {ranks_per_node}: must be at least 1")
    return rank // ranks_per_node


@dataclass(frozen=True)
class SnapshotPlacement:
    holder: dict[int, int]
    """Owner rank -> rank holding its snapshot in host memory."""
    node_safe: bool
    """True when every snapshot is on a different node from its owner."""
    stage_safe: bool = False
    """True when every snapshot is in a different stage from its owner's (losing a
    whole stage then loses none of its state)."""

    def holds(self, rank: int) -> list[int]:
        """Owners whose snapshot ``rank`` holds."""
        return sorted(owner for owner, holder in self.holder.items() if holder == rank)


def place_snapshots(ranks: Sequence[int], ranks_per_node: int) -> SnapshotPlacement:
    """Holder of each DP member's snapshot.

    Preference order: (1) a uniform ring shift by the smallest k that puts every holder
    on another node: balanced, each rank holds exactly one snapshot; (2) per owner, the
    next rank in ring order on another node: node-safe but possibly unbalanced; (3) the
    paper's plain ring neighbour, when some owner has no other node in its stage.
    """
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
    stages: Sequence[Sequence[int]], ranks_per_node: int
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
    """
    stages = [list(ranks) for ranks in stages if ranks]
    if len(stages) <= 1:
        return place_snapshots(stages[0] if stages else [], ranks_per_node)
    ranks = sorted(r for ranks in stages for r in ranks)
    stage = {r: k for k, members in enumerate(stages) for r in members}
    node = {r: node_of(r, ranks_per_node) for r in ranks}

    def apart(o: int, h: int) -> tuple[bool, bool]:
        return stage[o] != stage[h], node[o] != node[h]

    holder: dict[int, int] = {}
    held = dict.fromkeys(ranks, 0)
    for owner in ranks:
        others = [r for r in ranks if r != owner]
        fit = others
        for want in ((True, True), (False, True), (True, False)):
            ok = [
                r
                for r in others
                if all(a or not w for a, w in zip(apart(owner, r), want, strict=True))
            ]
            if ok:
                fit = ok
                break
        room = [r for r in fit if held[r] < HOLDS_AT_MOST] or fit
        holder[owner] = max(room, key=lambda r: _weight(owner, r))
        held[holder[owner]] += 1
    return SnapshotPlacement(
        holder,
        node_safe=all(apart(o, h)[1] for o, h in holder.items()),
        stage_safe=all(apart(o, h)[0] for o, h in holder.items()),
    )


def snapshot_link_name(owner: int, holder: int) -> str:
    """The name of the link an owner ships its snapshot over to its holder."""
    return f"snap.{owner}-{holder}"
