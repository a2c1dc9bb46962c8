"""``--verify-snapshots``' comparison (fabric.verify): exact digests on the host; for a
device owner, whose AdamW kernel rounds apart from the holder's, fingerprints within a
tolerance that a few units in the last place pass and a missed step or a wrong gradient
do not."""

from __future__ import annotations

import pytest
import torch

from elaswave.fabric.adamw import OptimizerConfig, ShardState, adamw_update
from elaswave.fabric.snapshot import state_digest
from elaswave.fabric.verify import exact_on, state_fingerprint, versions_agree

pytestmark = pytest.mark.timeout(30)

CFG = OptimizerConfig(lr=1e-2, warmup_steps=0)
STEPS = 5


def _runs(numel: int = 1000) -> tuple[list[ShardState], list[torch.Tensor]]:
    """The states after each of STEPS updates of one shard, and the gradients."""
    gen = torch.Generator().manual_seed(0)
    master = torch.randn(numel, generator=gen)
    state = ShardState(master, torch.zeros(numel), torch.zeros(numel), torch.ones(numel))
    grads = [torch.randn(numel, generator=gen) for _ in range(STEPS)]
    versions = []
    for step, grad in enumerate(grads):
        adamw_update(state, grad, step=step, cfg=CFG)
        master, avg, avg_sq = (t.clone() for t in (state.master, state.exp_avg, state.exp_avg_sq))
        versions.append(ShardState(master, avg, avg_sq, state.decay_mask))
    return versions, grads


def _ulps(state: ShardState, k: int) -> ShardState:
    """``state`` with every value moved ``k`` units in the last place (another kernel's
    rounding, exaggerated)."""

    def moved(t: torch.Tensor) -> torch.Tensor:
        for _ in range(k):
            t = torch.nextafter(t, torch.full_like(t, float("inf")))
        return t

    return ShardState(moved(state.master), moved(state.exp_avg), moved(state.exp_avg_sq),
                      state.decay_mask)  # fmt: skip


def test_host_owners_are_checked_bit_for_bit() -> None:
    versions, _ = _runs()
    digests = [state_digest(v) for v in versions]
    assert exact_on("cpu") and not exact_on("cuda")
    assert versions_agree(digests, list(digests), exact=True)
    drifted = [state_digest(_ulps(v, 1)) for v in versions]
    assert not versions_agree(digests, drifted, exact=True)


def test_a_device_owners_rounding_passes_and_a_wrong_snapshot_does_not() -> None:
    versions, grads = _runs()
    prints = [state_fingerprint(v) for v in versions]
    drifted = [state_fingerprint(_ulps(v, 8)) for v in versions]
    assert versions_agree([], [], exact=False, owner_prints=prints, snapshot_prints=drifted)
    behind = [prints[0], *prints[:-1]]  # a step missed
    assert not versions_agree([], [], exact=False, owner_prints=prints, snapshot_prints=behind)
    wrong = versions[-1]
    adamw_update(wrong, -grads[-1], step=STEPS, cfg=CFG)  # one more, unrelated update
    bad = [*prints[:-1], state_fingerprint(wrong)]
    assert not versions_agree([], [], exact=False, owner_prints=prints, snapshot_prints=bad)
    assert not versions_agree([], [], exact=False, owner_prints=prints, snapshot_prints=[])
