"""Checking host snapshots against their owners' shards (``--verify-snapshots``).

Each step, an owner records its shard and each holder the snapshot it keeps of it: a
sha256 digest (:func:`~elaswave.fabric.snapshot.state_digest`) and a fingerprint
(:func:`state_fingerprint`, a few sums and sampled elements of each tensor).

On the host the two are equal bit for bit: owner and holder both run
:func:`~elaswave.fabric.adamw.adamw_update` (torch's fused CPU kernel) on the same fp32
inputs, so :func:`versions_agree` compares digests. A CUDA owner's fused AdamW is not
bit-identical to the CPU kernel its holder runs, so a device owner's snapshot drifts
from its shard by a few units in the last place per step: there (``exact`` False) the
check compares fingerprints within :data:`SNAPSHOT_RTOL` of each tensor's magnitude, a
bound far below what a wrong step, a lost gradient or a misplaced element produces.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from elaswave.fabric.adamw import ShardState

FINGERPRINT_POINTS = 16
"""Elements of each state tensor a fingerprint samples, evenly spaced."""

SNAPSHOT_RTOL = 1e-4
"""Tolerance of a fingerprint's values, relative to the tensor's mean magnitude, when
owner and holder run different AdamW kernels (about 1000 units in the last place of
fp32: many steps of drift, far below what a wrong update produces)."""

Fingerprint = tuple[float, ...]
"""Per state tensor: its element count, the sum of its absolute values, and
:data:`FINGERPRINT_POINTS` sampled elements (fewer in a smaller tensor)."""


def state_fingerprint(state: ShardState) -> Fingerprint:
    """The fingerprint of master, exp_avg and exp_avg_sq (float64 sums)."""
    out: list[float] = []
    for t in (state.master, state.exp_avg, state.exp_avg_sq):
        flat = t.detach().reshape(-1).double()
        n = flat.numel()
        index = torch.linspace(0, max(n - 1, 0), min(n, FINGERPRINT_POINTS)).long()
        out += [float(n), float(flat.abs().sum())]
        out += [float(v) for v in flat[index.to(flat.device)].tolist()]
    return tuple(out)


def _tensors(fingerprint: Fingerprint) -> list[tuple[float, float, Fingerprint]]:
    """(numel, sum of magnitudes, sampled elements) of each tensor in a fingerprint."""
    out, at = [], 0
    while at < len(fingerprint):
        n, total = fingerprint[at], fingerprint[at + 1]
        points = int(min(n, FINGERPRINT_POINTS))
        out.append((n, total, fingerprint[at + 2 : at + 2 + points]))
        at += 2 + points
    return out


def fingerprints_close(a: Fingerprint, b: Fingerprint) -> bool:
    """Whether two fingerprints agree within :data:`SNAPSHOT_RTOL` of each tensor's mean
    magnitude."""
    ta, tb = _tensors(a), _tensors(b)
    if len(ta) != len(tb):
        return False
    for (n, total, points), (m, other, theirs) in zip(ta, tb, strict=True):
        scale = max(total, other) / max(n, 1.0)
        if n != m or len(points) != len(theirs):
            return False
        if abs(total - other) > SNAPSHOT_RTOL * max(total, other):
            return False
        if any(abs(x - y) > SNAPSHOT_RTOL * scale for x, y in zip(points, theirs, strict=True)):
            return False
    return True


def versions_agree(
    owner_digests: Sequence[str],
    snapshot_digests: Sequence[str],
    *,
    exact: bool,
    owner_prints: Sequence[Fingerprint] = (),
    snapshot_prints: Sequence[Fingerprint] = (),
) -> bool:
    """Whether a snapshot's recorded versions are its owner's, step for step: equal
    digests when ``exact`` (owner and holder run the same AdamW kernel), otherwise
    close fingerprints (:func:`fingerprints_close`)."""
    if exact:
        return list(owner_digests) == list(snapshot_digests)
    if len(owner_prints) != len(snapshot_prints) or not owner_prints:
        return False
    return all(map(fingerprints_close, owner_prints, snapshot_prints))


def exact_on(device_type: str) -> bool:
    """Whether an owner training on ``device_type`` and its host holder run the same
    AdamW kernel (their versions then agree bit for bit)."""
    return device_type == "cpu"
