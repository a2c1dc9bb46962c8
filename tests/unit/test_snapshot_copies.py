"""K copies of every snapshot (``--snapshot-copies K``): each owner's K holders are K
other ranks, on K nodes other than its own wherever the layout has that many, so that
losing any K nodes (or any K ranks) loses no state. Checked exhaustively over small
pipelines against the brute-force definition of "no state lost"."""

from __future__ import annotations

from itertools import combinations

import pytest

from elaswave.fabric.placement import node_of, place_snapshots_across


def _pipelines():
    """Every pipeline of 1-3 stages of 1-4 ranks, ranks numbered stage after stage."""
    for widths in [(1,), (2,), (3,), (4,), (1, 1), (2, 1), (2, 2), (3, 2), (1, 3), (3, 3),
                   (4, 4), (1, 1, 1), (2, 2, 2), (1, 2, 3), (4, 2, 1)]:  # fmt: skip
        stages, first = [], 0
        for w in widths:
            stages.append(list(range(first, first + w)))
            first += w
        yield stages


CASES = [
    (stages, per_node, copies)
    for stages in _pipelines()
    for per_node in (1, 2)
    for copies in (1, 2, 3)
]


@pytest.mark.parametrize(("stages", "per_node", "copies"), CASES)
def test_k_copies_survive_any_k_lost_nodes(stages, per_node, copies):
    ranks = sorted(r for s in stages for r in s)
    placement = place_snapshots_across(stages, per_node, copies)
    nodes = sorted({node_of(r, per_node) for r in ranks})
    for owner in ranks:
        holders = placement.holders_of(owner)
        if len(ranks) == 1:
            assert holders == ()
            continue
        assert owner not in holders and len(set(holders)) == len(holders)
        assert len(holders) == min(copies, len(ranks) - 1)
        assert placement.holder[owner] == holders[0]
    # Where every owner has `copies` nodes besides its own, losing any `copies` nodes
    # leaves a copy of every shard: the owner's or a holder's.
    if len(nodes) > copies and len(ranks) > copies:
        assert placement.node_safe
        for lost in combinations(nodes, copies):
            for owner in ranks:
                alive = [
                    r for r in (owner, *placement.holders_of(owner))
                    if node_of(r, per_node) not in lost
                ]  # fmt: skip
                assert alive, (stages, per_node, copies, lost, owner)
    # Any `copies` ranks lost leave a copy (one copy per rank at most each).
    if len(ranks) > copies:
        for lost in combinations(ranks, copies):
            for owner in ranks:
                assert set((owner, *placement.holders_of(owner))) - set(lost), (owner, lost)


def test_one_copy_is_the_placement_of_before():
    """``copies=1`` changes nothing: the same holders, no further copies."""
    stages = [[0, 1, 2], [3, 4, 5]]
    one = place_snapshots_across(stages, 1)
    assert place_snapshots_across(stages, 1, 1) == one and one.more == {}
    two = place_snapshots_across(stages, 1, 2)
    assert two.holder == one.holder  # the first copies stay where they were
    assert all(len(two.holders_of(o)) == 2 for o in range(6))


def test_links_name_every_copy():
    placement = place_snapshots_across([[0, 1], [2, 3]], 1, 2)
    assert placement.links() == sorted((o, h) for o in range(4) for h in placement.holders_of(o))
    assert len(placement.links()) == 8
    assert sorted(placement.holds(2)) == sorted(o for o in range(4) if 2 in placement.holders_of(o))
