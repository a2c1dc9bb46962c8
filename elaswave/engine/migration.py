"""Non-blocking layer migration: who streams which layer to whom, and when (pure).

When a plan change moves layers between stages, a *blocking* migration copies each
moving layer's parameters to its new stage before the job resumes. The *non-blocking*
method (the paper's §6.3) resumes at once and runs one *transition step*:

* micro-batches ``0 .. early - 1`` still run every layer on its **old** stage: the
  source keeps a shadow instance of each outgoing layer and computes it for them;
* meanwhile each outgoing layer's parameters stream from a source replica to every
  target replica, which waits for them only when micro-batch ``early`` first reaches the
  layer on its **new** stage;
* after the last backward each source replica ships its shadow's accumulated gradient
  (the *payback*) to a target replica, which adds it to its own before the optimizer
  step, so the step's gradient is complete and the numbers are the blocking migration's
  up to float summation order.

The plan's dataflow (which replica takes which samples) applies from the first
micro-batch either way; only the layer boundary waits. Every rank computes the same
decision and routes from the two plans, so no extra message is needed.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from elaswave.comm.spec import TagSpace
from elaswave.engine.cost import DeviceSpec, LayerCost, LayerKind, compute_time, p2p_time
from elaswave.engine.plan import Plan
from elaswave.fabric.remap import FP32_BYTES

MIGRATION_MODES = ("nonblocking", "blocking")
"""The modes a job may ask for (``--migration``): the Core decides ``none`` itself."""


class MigrationMode(enum.StrEnum):
    """How a change moves layers (the ``migration`` a RecoveryPlan announces)."""

    NONE = "none"
    """No layer moves."""
    BLOCKING = "blocking"
    """Parameters gathered before resuming."""
    NONBLOCKING = "nonblocking"
    """Streamed during the transition step."""


NONE, BLOCKING, NONBLOCKING = MigrationMode.NONE, MigrationMode.BLOCKING, MigrationMode.NONBLOCKING
MAX_TRANSFERS = TagSpace.PAYBACK - TagSpace.STREAM
"""Streams (and paybacks) one transition may hold: stream ``i`` uses tag index
``TagSpace.STREAM + i``."""


@dataclass(frozen=True)
class LayerMove:
    """Layer ``layer`` runs on stage ``src`` under the old plan and ``dst`` under the new."""

    layer: int
    src: int
    dst: int


@dataclass(frozen=True)
class Transfer:
    """One point-to-point message of a migration: ``layer``'s parameters (a stream) or
    its shadow gradient (a payback), from rank ``src`` to rank ``dst``."""

    layer: int
    src: int
    dst: int


@dataclass(frozen=True)
class Transition:
    """The non-blocking migration of one plan change, identical on every rank."""

    moves: tuple[LayerMove, ...]
    early: int
    """Micro-batches of the transition step that run on the old layer placement (0: the
    streams are expected before any target needs them; no shadow runs)."""
    streams: tuple[Transfer, ...]
    paybacks: tuple[Transfer, ...]
    """Empty when ``early`` is 0: no shadow has a gradient to pay back."""


def layer_moves(old: Plan, new: Plan) -> tuple[LayerMove, ...]:
    """Every layer whose stage differs between ``old`` and ``new``, in layer order (a
    pipeline of another number of stages: every layer whose stage index differs)."""
    stage_of = [{layer: s.stage for s in p.stages for layer in s.layers} for p in (old, new)]
    if stage_of[0].keys() != stage_of[1].keys():
        raise ValueError("plans cover different layers")
    return tuple(
        LayerMove(layer, stage_of[0][layer], stage_of[1][layer])
        for layer in sorted(stage_of[0])
        if stage_of[0][layer] != stage_of[1][layer]
    )


def why_blocking(
    mode: str,
    old: Plan,
    new: Plan,
    *,
    stale: Collection[int] = (),
    joined: Collection[int] = (),
    layers: Sequence[LayerCost],
) -> str | None:
    """Why this change must migrate its layers blocking, or None if it need not.

    Non-blocking migration needs every source replica's parameters to be those of the
    committed step (a rank that failed over mid optimizer step holds newer ones:
    ``stale``), stage memberships that only shrink (a joiner holds no parameters; a rank
    that changes stage runs none of its old stage's layers), and only transformer blocks
    moving (embedding and head stay at the pipeline's ends).
    """
    if mode not in MIGRATION_MODES:
        raise ValueError(f"unknown migration mode {mode!r}; valid: {', '.join(MIGRATION_MODES)}")
    if mode == "blocking":
        return "blocking migration was asked for"
    if old.pp != new.pp:
        return f"the pipeline goes from {old.pp} to {new.pp} stages"
    if joined:
        return f"ranks {sorted(joined)} join and gather their stage's parameters"
    if stale:
        return f"ranks {sorted(stale)} hold parameters newer than the committed step"
    before = {r: s.stage for s in old.stages for r in s.ranks}
    moved = sorted(r for s in new.stages for r in s.ranks if before.get(r, s.stage) != s.stage)
    if moved:  # a source of the streams would no longer run the old stage's layers
        return f"ranks {moved} change stage and gather their new stage's parameters"
    kinds = {c.index: c.kind for c in layers}
    moves = layer_moves(old, new)
    messages = (
        max(sum(new.stages[m.dst].dp for m in moves), sum(new.stages[m.src].dp for m in moves))
        if moves
        else 0
    )
    if messages > MAX_TRANSFERS:
        return f"{messages} streams or paybacks exceed the {MAX_TRANSFERS} tags a step has"
    for move in moves:
        if kinds.get(move.layer) is not LayerKind.BLOCK:
            return f"layer {move.layer} is not a transformer block"
        if not set(new.stages[move.src].ranks) <= set(old.stages[move.src].ranks):
            return f"stage {move.src} gained members"
    return None


def _forward_s(
    plan: Plan, stage: int, layer_ids: Sequence[int], cost: dict[int, LayerCost], device: DeviceSpec
) -> float:
    """Modelled forward seconds of ``layer_ids`` for one micro-batch on ``stage``'s
    busiest replica."""
    s = plan.stages[stage]
    flops = s.load * sum(cost[i].fwd_flops_per_sample for i in layer_ids)
    return compute_time(flops, device, s.mhz or device.base_mhz)


def plan_transition(
    old: Plan,
    new: Plan,
    *,
    layers: Sequence[LayerCost],
    device: DeviceSpec,
    early: int | None = None,
) -> Transition | None:
    """The non-blocking transition from ``old`` to ``new`` (None if no layer moves).

    Target replica ``j`` of a layer's new stage receives its parameters from replica
    ``j mod D_src`` of the layer's (new) source stage; source replica ``i`` pays its
    shadow gradient back to target replica ``i mod D_dst``, so every source replica's
    micro-batches are counted exactly once.

    ``early`` (None: planned) is how many micro-batches keep the old placement. A target
    first needs an incoming layer when micro-batch 0 reaches it: after the upstream
    stages' forwards and its own layers before that one. While the streams' modelled
    transfer time fits in that, ``early`` is 0 and no shadow runs (pure overlap); beyond
    it, each early micro-batch buys one forward of the target's kept layers, at the
    price of the source computing the layer for that micro-batch too.
    """
    moves = layer_moves(old, new)
    if not moves:
        return None
    cost = {c.index: c for c in layers}
    m = new.num_micro_batches
    if early is None:
        early = 0
        for stage in sorted({mv.dst for mv in moves}):
            incoming = [mv.layer for mv in moves if mv.dst == stage]
            kept = [i for i in new.stages[stage].layers if i not in incoming]
            upstream = sum(
                _forward_s(new, u, list(new.stages[u].layers), cost, device)
                + p2p_time(cost[new.stages[u].layer_stop - 1].output_bytes_per_sample, device)
                for u in range(stage)
            )
            before = _forward_s(new, stage, [i for i in kept if i < min(incoming)], cost, device)
            stream_s = p2p_time(sum(cost[i].params * FP32_BYTES for i in incoming), device)
            gap = stream_s - upstream - before
            if gap <= 0:
                continue
            per_mb = _forward_s(new, stage, kept, cost, device)
            early = max(early, m if per_mb <= 0 else math.ceil(gap / per_mb))
    if early < 0:
        raise ValueError(f"early = {early}: must be at least 0")
    early = min(early, m)
    streams, paybacks = [], []
    for move in moves:
        src = new.stages[move.src].ranks
        dst = new.stages[move.dst].ranks
        streams += [Transfer(move.layer, src[j % len(src)], r) for j, r in enumerate(dst)]
        if early:
            paybacks += [Transfer(move.layer, r, dst[i % len(dst)]) for i, r in enumerate(src)]
    return Transition(moves, early, tuple(streams), tuple(paybacks))


@dataclass(frozen=True, kw_only=True)
class MigrationDecision:
    """How the change from one plan to the next moves layers (summary.json's
    ``migration``, :mod:`elaswave.engine.record`)."""

    mode: MigrationMode
    layers: tuple[int, ...]
    """The layers that move, in layer order (empty when the mode is ``none``)."""
    why: str | None = None
    """Blocking: why the layers cannot stream."""
    early_micro_batches: int | None = None
    """Non-blocking: how many micro-batches keep the old placement."""


def decide_migration(
    mode: str,
    old: Plan,
    new: Plan,
    *,
    stale: Collection[int],
    joined: Collection[int],
    layers: Sequence[LayerCost],
    device: DeviceSpec,
    early: int | None = None,
) -> MigrationDecision:
    """How the change from ``old`` to ``new`` moves layers: its mode, the layers that
    move, and why they move blocking or how many micro-batches keep the old placement.
    ``mode``: the job's ``--migration``. The Core decides it once and announces the
    mode; workers follow it."""
    moves = layer_moves(old, new)
    if not moves:
        return MigrationDecision(mode=MigrationMode.NONE, layers=())
    moving = tuple(m.layer for m in moves)
    why = why_blocking(mode, old, new, stale=stale, joined=joined, layers=layers)
    if why is not None:
        return MigrationDecision(mode=MigrationMode.BLOCKING, layers=moving, why=why)
    transition = plan_transition(old, new, layers=layers, device=device, early=early)
    assert transition is not None  # why_blocking found nothing against it
    return MigrationDecision(
        mode=MigrationMode.NONBLOCKING, layers=moving, early_micro_batches=transition.early
    )
