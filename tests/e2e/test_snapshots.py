"""Per-step snapshots: at every step each host snapshot equals its owner's shard bit for
bit, and it lives on another node, in another stage."""

from __future__ import annotations

import pytest

from elaswave.fabric.placement import node_of
from elaswave.fabric.verify import exact_on, versions_agree
from tests.runs import train


@pytest.mark.timeout(240)
def test_snapshots_equal_owner_shards_every_step_and_live_on_other_nodes_and_stages(runs_dir):
    run = train(
        runs_dir / "snapshots",
        "--dp",
        "4",
        "--pp",
        "2",
        "--steps",
        "6",
        "--ranks-per-node",
        "2",
        "--verify-snapshots",
    )
    workers = {w.rank: w for w in run.workers()}
    owners_seen = set()
    for holder, worker in workers.items():
        for owner, digests in worker.snapshot_digests.items():
            owners_seen.add(owner)
            assert node_of(owner, 2) != node_of(holder, 2), (owner, holder)
            # In another stage: losing every rank of a stage loses none of its state.
            assert workers[owner].stage != worker.stage, (owner, holder)
            assert len(digests) == 6
            assert digests == workers[owner].optimizer_digests, (owner, holder)
            theirs = workers[owner]
            exact = exact_on(theirs.optimizer_device or "cpu")
            assert exact, "a host owner: its snapshot is checked bit for bit"
            assert versions_agree(theirs.optimizer_digests, digests, exact=exact)
            # The check a device owner gets (fingerprints) passes where digests are equal.
            mine = (worker.snapshot_fingerprints or {})[owner]
            prints = theirs.optimizer_fingerprints or ()
            assert versions_agree((), (), exact=False, owner_prints=prints, snapshot_prints=mine)
    assert owners_seen == set(workers), "every shard has exactly one snapshot"
    # The digests really change step to step (the comparison above is not vacuous).
    assert len(set(workers[0].optimizer_digests)) == 6
