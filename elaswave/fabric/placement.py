"""Where each optimizer shard's host snapshot lives (paper §5.1, made node-aware).

The paper's ring puts shard i's snapshot on its DP neighbour, which may share a node
with it: losing that node loses both. Here each owner's snapshot goes to the next rank
in ring order on a *different node*; only when every replica of a stage shares one node
does it fall back to the plain ring neighbour (and says so).
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
