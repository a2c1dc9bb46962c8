"""The time of one training step of a pipeline plan, simulated action by action.

Every stage runs the runtime's own action list of the plan's schedule
(:mod:`elaswave.engine.schedule`: 1F1B, or the zero-bubble list whose backward is split
in input- and weight-gradient halves, :func:`split_parts`). A forward waits for the
activations of its samples (the sender's forward of the same micro-batch plus the
transfer), a backward (``B`` or ``I``) for their gradients (the next stage's backward
plus the transfer), a ``W`` for nothing but its stage; sends do not block the sender,
which waits for them at the end of the step (the runtime posts them and waits before
its optimizer step). After its last backward each stage runs its DP reduce-scatter and
all-gather; the step ends when the last stage's collectives do.

Two granularities, one schedule:

* :func:`plan_step_time` simulates **every DP replica** of every stage: its share of each
  micro-batch at its clock and slowdown, each route of the plan with its own transfer.
  This is what a plan costs, exactly what the emulated device paces, and what the
  planner compares candidates by: when the survivors of a stage cannot split a micro-
  batch evenly the shares rotate (:attr:`~elaswave.engine.plan.StagePlan.rotate`), and
  how much of the larger share the neighbours wait for depends on the whole pipeline.
* :func:`simulate_step` gives each stage one set of times (its busiest replica's),
  from :func:`stage_times` or from a caller that reshapes them (ReCycle's re-routed
  work in :mod:`elaswave.sim.recycle`).

:func:`simulate_step` times its lists with the planner's own
:func:`~elaswave.engine.schedule.finish_times`; :func:`plan_step_time` walks the lists'
dependency order of (stage, action) (:func:`action_order`), its replica model vectorised
over each stage's replicas, so 10^5 devices cost a few hundred milliseconds per step.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from elaswave.engine.cost import (
    DeviceSpec,
    LayerCost,
    compute_time,
    p2p_time,
    ring_allreduce_time,
    stage_memory,
    stage_p2p_time,
)
from elaswave.engine.plan import Plan, StagePlan
from elaswave.engine.schedule import (
    Action,
    Op,
    OpCosts,
    Schedule,
    equal_costs,
    finish_times,
    max_held,
    stage_actions,
    zb_h1,
    zero_bubble,
)
from elaswave.fabric.remap import FP32_BYTES


@dataclass(frozen=True)
class StageTimes:
    """Seconds one stage spends per micro-batch, and once per step."""

    fwd_s: float
    bwd_s: float
    send_fwd_s: float
    """Activations of one micro-batch to the next stage (0 on the last stage)."""
    send_bwd_s: float
    """Input gradients of one micro-batch to the previous stage (0 on the first)."""
    sync_s: float
    """DP gradient reduce-scatter plus parameter all-gather after the last backward."""


@dataclass(frozen=True)
class StepSim:
    step_s: float
    compute_end_s: tuple[float, ...]
    """When each stage's last replica is done with its micro-batches."""
    busy_s: tuple[float, ...]
    """Compute seconds of each stage's busiest replica in the step."""

    @property
    def bubble(self) -> float:
        """Idle fraction of the pipeline's compute (0 for a perfectly packed step)."""
        return 1.0 - sum(self.busy_s) / (len(self.busy_s) * self.step_s)


WEIGHT_SHARE = 0.5
"""The part of a backward that is its weight-gradient half (``W``): a linear layer's
backward is two matrix products of its forward's size, one for the input gradient and
one for the weight gradient."""


def split_parts(*, first: bool) -> tuple[float, float]:
    """The shares of a backward its ``I`` and ``W`` halves compute: on the first stage,
    whose input is data, ``I`` has nothing to compute and ``W`` is the whole backward."""
    return (0.0, 1.0) if first else (1.0 - WEIGHT_SHARE, WEIGHT_SHARE)


def op_seconds(op: Op, fwd_s: float, bwd_s: float, *, first: bool = False) -> float:
    """Seconds of ``op`` on a stage whose forward and whole backward take these."""
    if op is Op.FORWARD:
        return fwd_s
    if op is Op.BACKWARD:
        return bwd_s
    return bwd_s * split_parts(first=first)[op is Op.WEIGHT]


def action_order(
    num_stages: int,
    num_micro_batches: int,
    schedule: Schedule = Schedule.ONE_F_ONE_B,
    lists: Sequence[Sequence[Action]] | None = None,
) -> tuple[tuple[int, Op, int], ...]:
    """(stage, op, micro-batch) of every action of a step under ``schedule``, in an
    order in which each action comes after the actions it waits for (and after its
    stage's earlier ones): a forward after the previous stage's forward of its
    micro-batch, a backward (``B`` or ``I``) after the next stage's. ``lists``: every
    stage's list, where the schedule's depend on costs (:func:`plan_lists`); default:
    :func:`~elaswave.engine.schedule.stage_actions` of ``schedule``."""
    p, m = num_stages, num_micro_batches
    if p < 1 or m < 1:
        raise ValueError(f"{p} stages, {m} micro-batches: need at least 1 of each")
    if lists is None:
        lists = tuple(
            tuple(stage_actions(schedule, num_stages=p, stage=s, num_micro_batches=m))
            for s in range(p)
        )
    elif len(lists) != p:
        raise ValueError(f"{len(lists)} lists for {p} stages")
    return _order(tuple(tuple(a) for a in lists))


@functools.lru_cache(maxsize=64)
def _order(actions: tuple[tuple[Action, ...], ...]) -> tuple[tuple[int, Op, int], ...]:
    p = len(actions)
    done: set[tuple[str, int, int]] = set()
    nxt = [0] * p
    order: list[tuple[int, Op, int]] = []
    while len(order) < sum(len(a) for a in actions):
        progressed = False
        for s in range(p):
            while nxt[s] < len(actions[s]):
                op, mb = actions[s][nxt[s]]
                if op is Op.FORWARD:
                    dep = None if s == 0 else ("F", s - 1, mb)
                elif op is Op.WEIGHT:
                    dep = None
                else:
                    dep = None if s == p - 1 else ("G", s + 1, mb)
                if dep is not None and dep not in done:
                    break
                done.add(("F" if op is Op.FORWARD else "G" if op is not Op.WEIGHT else "W", s, mb))
                order.append((s, op, mb))
                nxt[s] += 1
                progressed = True
        if not progressed:  # the planned lists are deadlock-free; this guards the model
            raise RuntimeError("pipeline schedule made no progress")
    return tuple(order)


def op_costs(stages: Sequence[StageTimes]) -> list[OpCosts]:
    """The zero-bubble planner's costs of stages with these times: each backward split
    in its ``I`` and ``W`` halves by :func:`split_parts`."""
    out = []
    for s, st in enumerate(stages):
        i, w = split_parts(first=s == 0)
        out.append(OpCosts(st.fwd_s, st.bwd_s * i, st.bwd_s * w, st.send_fwd_s, st.send_bwd_s))
    return out


def held_limits(plan: Plan, layers: Sequence[LayerCost], device: DeviceSpec) -> list[int]:
    """Per stage, how many micro-batches (of its largest share) its device's memory
    holds between their forward and their weight gradients (at least 1; what
    :func:`~elaswave.engine.recovery.fits` checks, capped at the step's micro-batches)."""
    cost = {c.index: c for c in layers}
    out = []
    for st in plan.stages:
        kw = {
            "micro_batch": st.load, "dp": st.dp, "stage": st.stage, "num_stages": plan.pp,
        }  # fmt: skip
        fixed = stage_memory([cost[i] for i in st.layers], live=0, **kw)
        each = stage_memory([cost[i] for i in st.layers], live=1, **kw) - fixed
        room = device.memory_bytes - fixed
        live = plan.num_micro_batches if each <= 0 else int(room // each)
        out.append(max(1, min(live, plan.num_micro_batches)))
    return out


def plan_lists(
    plan: Plan, layers: Sequence[LayerCost] = (), device: DeviceSpec | None = None
) -> tuple[tuple[Action, ...], ...]:
    """Every stage's action list under ``plan``'s schedule. A schedule whose lists depend
    on costs (:attr:`~elaswave.engine.schedule.Schedule.priced`) needs the cost model's
    ``layers`` and ``device``: ``zb-cost`` takes, of :func:`zb_cost_candidates`, the
    lists whose step :func:`plan_step_time` simulates shortest (the first of equals). A
    pure function of the plan and the cost model (no slowdowns), which every worker has:
    the Core's planner and the workers run the same lists."""
    p, m = plan.pp, plan.num_micro_batches
    if not plan.schedule.priced:
        return tuple(
            tuple(stage_actions(plan.schedule, num_stages=p, stage=s, num_micro_batches=m))
            for s in range(p)
        )
    if device is None or not layers:
        raise ValueError(f"schedule {plan.schedule} needs the cost model's layers and device")
    return _zb_cost_search(_shape(plan), tuple(layers), device)


def _shape(plan: Plan) -> Plan:
    """``plan`` as zb-cost's search sees it: which ranks hold a stage, and the plan's
    generation, change no list, so plans that differ only there share one search (the
    planner prices many candidates of one shape at a change, and a churning job's nodes
    come back under new ids to shapes it has had)."""
    stages, first = [], 0
    for st in plan.stages:
        stages.append(dataclasses.replace(st, ranks=tuple(range(first, first + st.dp))))
        first += st.dp
    return dataclasses.replace(plan, generation=0, stages=tuple(stages))


ZB_COST_PENDING_W = (1, 2, 4)
"""``zb-cost``'s candidate caps on pending ``W``, in multiples of ZB-H1's ``P - 1``."""


def zb_cost_candidates(
    plan: Plan, layers: Sequence[LayerCost], device: DeviceSpec
) -> list[tuple[tuple[Action, ...], ...]]:
    """The lists ``zb-cost`` chooses from: :func:`~elaswave.engine.schedule.zero_bubble`
    at ZB-H1's :func:`~elaswave.engine.schedule.equal_costs` and at the plan's own
    per-stage costs (:func:`stage_times` at each rotating stage's mean share: at its
    largest the planner sees every micro-batch as slow as the slowest replica's, and
    packs worse); ``W`` pending up to ``(P - 1)`` times :data:`ZB_COST_PENDING_W`; at
    most 1F1B's ``P - s`` forwards in flight, or as many as the stage's memory holds;
    every stage within its memory (:func:`held_limits`). The first is ZB-H1's lists
    (:func:`~elaswave.engine.schedule.zb_h1`) wherever they fit."""
    p, m = plan.pp, plan.num_micro_batches
    held = held_limits(plan, layers, device)
    own = op_costs(stage_times(plan, layers, device, mean=True))
    zb = tuple(tuple(zb_h1(num_stages=p, stage=s, num_micro_batches=m)) for s in range(p))
    out = [zb] if all(max_held(x) <= h for x, h in zip(zb, held, strict=True)) else []
    for costs in (equal_costs(p), own):
        for times in ZB_COST_PENDING_W:
            for in_flight in ([p - s for s in range(p)], held):
                lists = zero_bubble(
                    num_micro_batches=m, costs=costs, pending_w=max(1, p - 1) * times,
                    in_flight=[min(a, b) for a, b in zip(in_flight, held, strict=True)],
                    held=held,
                )  # fmt: skip
                out.append(tuple(tuple(x) for x in lists))
    return list(dict.fromkeys(out))  # the same lists once, in order


@functools.lru_cache(maxsize=256)  # a plan of 10^5 devices keys ~4 MB: at most 1 GB
def _zb_cost_search(
    plan: Plan, layers: tuple[LayerCost, ...], device: DeviceSpec
) -> tuple[tuple[Action, ...], ...]:
    candidates = zb_cost_candidates(plan, layers, device)
    cost = {c.index: c for c in layers}
    work, links = _replica_work(plan, cost, device, {}), _stage_links(plan, cost, device)
    steps = [_walk(plan, work, links, c).step_s for c in candidates]
    return candidates[min(range(len(steps)), key=lambda i: (steps[i], i))]


def simulate_step(
    stages: Sequence[StageTimes],
    num_micro_batches: int,
    schedule: Schedule = Schedule.ONE_F_ONE_B,
) -> StepSim:
    """The step time of a pipeline with these per-stage times under ``schedule`` (not a
    :attr:`~elaswave.engine.schedule.Schedule.priced` one: :func:`plan_step_time`): its
    lists timed by :func:`~elaswave.engine.schedule.finish_times`, each stage's DP
    collectives after its last action."""
    p, m = len(stages), num_micro_batches
    if p < 1 or m < 1:
        raise ValueError(f"{p} stages, {m} micro-batches: need at least 1 of each")
    lists = [stage_actions(schedule, num_stages=p, stage=s, num_micro_batches=m) for s in range(p)]
    finish = tuple(finish_times(lists, op_costs(stages)))
    step = max(f + st.sync_s for f, st in zip(finish, stages, strict=True))
    busy = tuple(m * (st.fwd_s + st.bwd_s) for st in stages)
    return StepSim(step, finish, busy)


def stage_times(
    plan: Plan,
    layers: Sequence[LayerCost],
    device: DeviceSpec,
    *,
    slowdowns: Mapping[int, float] | None = None,
    mean: bool = False,
) -> list[StageTimes]:
    """Per-stage times of ``plan`` under the cost model (``slowdowns``: rank -> factor),
    each stage at its busiest replica: a rotating stage at its largest share, an upper
    bound (:func:`plan_step_time` simulates the rotation); ``mean``: a rotating stage at
    its mean share."""
    slow = dict(slowdowns or {})
    cost = {c.index: c for c in layers}
    out = []
    for s in plan.stages:
        mhz = s.mhz or device.base_mhz
        if s.rotate:  # every replica takes the largest share in some micro-batch
            share = sum(s.sizes) / s.dp if mean else s.load
            load = share * max(slow.get(r, 1.0) for r in s.ranks)
        else:
            load = max(size * slow.get(r, 1.0) for r, size in zip(s.ranks, s.sizes, strict=True))
        fwd = compute_time(load * sum(cost[i].fwd_flops_per_sample for i in s.layers), device, mhz)
        bwd = compute_time(load * sum(cost[i].bwd_flops_per_sample for i in s.layers), device, mhz)
        out.append(StageTimes(fwd, bwd, 0.0, 0.0, _sync_s(s, cost, device)))
    for a, b in zip(plan.stages, plan.stages[1:], strict=False):
        kw = {
            "sender_dp": a.dp,
            "sender_micro_batch": a.load,
            "receiver_dp": b.dp,
            "receiver_micro_batch": b.load,
        }
        fwd_bytes = cost[a.layer_stop - 1].output_bytes_per_sample
        out[a.stage] = dataclasses.replace(
            out[a.stage], send_fwd_s=stage_p2p_time(fwd_bytes, device, **kw)
        )
        back = {
            "sender_dp": b.dp,
            "sender_micro_batch": b.load,
            "receiver_dp": a.dp,
            "receiver_micro_batch": a.load,
        }
        out[b.stage] = dataclasses.replace(
            out[b.stage], send_bwd_s=stage_p2p_time(fwd_bytes, device, **back)
        )
    return out


def _sync_s(stage: StagePlan, cost: Mapping[int, LayerCost], device: DeviceSpec) -> float:
    params = sum(cost[i].params for i in stage.layers)
    return ring_allreduce_time(params * FP32_BYTES, device, dp=stage.dp) if stage.dp > 1 else 0.0


@dataclass(frozen=True)
class _Links:
    """The routes between stage ``s`` and ``s + 1`` in one phase of their rotations, as
    the walk reads them. Kept for other plans with the same shares: read-only."""

    into_dst: np.ndarray
    """[k, receiver] the sender of the receiver's k-th route; receivers with fewer
    routes are padded with the sender count (a column of zeros beside the senders'
    times): a receiver's arrival is one gather and one maximum."""
    into_dst_s: np.ndarray
    """[k, receiver] that route's transfer time (0 where padded)."""
    into_src: np.ndarray
    """[k, sender] likewise, the receivers whose gradients come back to each sender."""
    into_src_s: np.ndarray
    src_reach: np.ndarray
    """Per sender, the longest of its routes' transfers (-inf: it sends nothing)."""
    dst_reach: np.ndarray
    """Per receiver, likewise for the gradients it sends back."""


def _links(plan: Plan, s: int, mb: int, bytes_per_sample: float, device: DeviceSpec) -> _Links:
    """The routes of :meth:`Plan.routes` (same pairs, same order), computed on arrays:
    a rotation's period can be thousands of micro-batches at 10^5 devices."""
    a, b = plan.stages[s].shares(mb), plan.stages[s + 1].shares(mb)
    if len(a) + len(b) > _SHARED_ROUTES_MAX:
        return _routes.__wrapped__(a, b, bytes_per_sample, device)
    return _routes(a, b, bytes_per_sample, device)


_SHARED_ROUTES_MAX = 512
"""Replicas of two stages up to which their routes are kept for the next plan that has
them (a planner prices many plans whose stages share routes; 4,096 kept of at most
this size take at most ~200 MB)."""


@functools.lru_cache(maxsize=4096)
def _routes(
    a: tuple[int, ...], b: tuple[int, ...], bytes_per_sample: float, device: DeviceSpec
) -> _Links:
    """:func:`_links` between replicas with shares ``a`` and ``b``."""
    a_hi = np.cumsum(a)
    a_lo = a_hi - a
    b_hi = np.cumsum(b)
    b_lo = b_hi - b
    first = np.searchsorted(b_hi, a_lo, side="right")  # first receiver ending after a_lo
    stop = np.searchsorted(b_lo, a_hi, side="left")  # receivers starting before a_hi
    counts = np.maximum(stop - first, 0)
    src = np.repeat(np.arange(len(a_hi)), counts)
    dst = (
        np.repeat(first, counts)
        + np.arange(counts.sum())
        - np.repeat(np.cumsum(counts) - counts, counts)
    )
    width = np.minimum(a_hi[src], b_hi[dst]) - np.maximum(a_lo[src], b_lo[dst])
    keep = width > 0
    src, dst, width = src[keep], dst[keep], width[keep]
    widths, which = np.unique(width, return_inverse=True)  # a few distinct sizes
    seconds = np.array([p2p_time(w * bytes_per_sample, device) for w in widths])[which]
    into_dst, into_dst_s = _padded(dst, src, seconds, receivers=len(b), pad=len(a))
    into_src, into_src_s = _padded(src, dst, seconds, receivers=len(a), pad=len(b))
    src_reach = np.full(len(a), -np.inf)
    np.maximum.at(src_reach, src, seconds)
    dst_reach = np.full(len(b), -np.inf)
    np.maximum.at(dst_reach, dst, seconds)
    arrays = (into_dst, into_dst_s, into_src, into_src_s, src_reach, dst_reach)
    for array in arrays:
        array.flags.writeable = False
    return _Links(*arrays)


def _padded(
    to: np.ndarray, frm: np.ndarray, seconds: np.ndarray, *, receivers: int, pad: int
) -> tuple[np.ndarray, np.ndarray]:
    """([k, receiver] sender of each receiver's k-th route, padded with ``pad``; the
    routes' seconds, 0 where padded) of routes ``frm`` -> ``to``."""
    counts = np.bincount(to, minlength=receivers)
    depth = max(1, int(counts.max(initial=0)))
    index = np.full((depth, receivers), pad, dtype=np.intp)
    secs = np.zeros((depth, receivers))
    order = np.argsort(to, kind="stable")
    rank = np.arange(len(to)) - np.repeat(np.cumsum(counts) - counts, counts)
    index[rank, to[order]] = frm[order]
    secs[rank, to[order]] = seconds[order]
    return index, secs


def plan_step_time(
    plan: Plan,
    layers: Sequence[LayerCost],
    device: DeviceSpec,
    *,
    slowdowns: Mapping[int, float] | None = None,
    lists: Sequence[Sequence[Action]] | None = None,
) -> StepSim:
    """Simulate one step of ``plan`` replica by replica (see the module docstring).
    ``lists``: every stage's action list (default :func:`plan_lists`).

    Each replica computes its share of every micro-batch (:meth:`StagePlan.shares`) at
    its stage's clock times its slowdown; a forward starts when the replica is free and
    every route bringing its samples has delivered (sender's forward end plus
    :func:`~elaswave.engine.cost.p2p_time` of the route's bytes); a backward likewise
    for the routes returning gradients. A replica is done when its compute and its last
    send are; a stage's collectives start when its last replica is done.
    """
    cost = {c.index: c for c in layers}
    if lists is None and plan.schedule.priced:
        lists = plan_lists(plan, layers, device)
    work = _replica_work(plan, cost, device, dict(slowdowns or {}))
    return _walk(plan, work, _stage_links(plan, cost, device), lists)


def _walk(
    plan: Plan,
    work: _ReplicaWork,
    links: Sequence[Sequence[_Links]],
    lists: Sequence[Sequence[Action]] | None,
) -> StepSim:
    """:func:`plan_step_time` of ``plan`` running ``lists`` (None: its schedule's), its
    replicas' work and routes given (zb-cost's candidates share them)."""
    order = action_order(plan.pp, plan.num_micro_batches, plan.schedule, lists)
    fwd_end, bwd_end, free = _run_actions(plan, work, links, order)
    done = _sends_done(plan, links, fwd_end, bwd_end, free)
    finish = tuple(
        float(d[ok].max()) if ok.any() else 0.0 for d, ok in zip(done, work.live, strict=True)
    )
    step = max(f + t for f, t in zip(finish, work.sync, strict=True))
    busy = []
    for s in range(plan.pp):
        phase = np.arange(plan.num_micro_batches) % len(work.fwd[s])
        busy.append(float((work.fwd[s][phase] + work.bwd[s][phase]).sum(axis=0).max()))
    return StepSim(step, finish, tuple(busy))


def step_lower_bound(
    plan: Plan,
    layers: Sequence[LayerCost],
    device: DeviceSpec,
    *,
    slowdowns: Mapping[int, float] | None = None,
) -> float:
    """A time no step of ``plan`` can beat, whatever its lists: each replica computes
    its whole step's work one action after another, from its first forward on (which,
    for a replica with a share of the first micro-batch, waits for that micro-batch's
    forwards on the stages before it), and then its stage's collectives. Cheap (no
    walk): a planner skips the candidates that cannot win."""
    work = _replica_work(plan, {c.index: c for c in layers}, device, dict(slowdowns or {}))
    m, head, bound = plan.num_micro_batches, 0.0, 0.0
    for s in range(plan.pp):
        phase = np.arange(m) % len(work.fwd[s])
        busy = (work.fwd[s][phase] + work.bwd[s][phase]).sum(axis=0)
        first = work.fwd[s][0] > 0  # replicas with a share of micro-batch 0
        bound = max(bound, float((busy + np.where(first, head, 0.0)).max()) + work.sync[s])
        head += float(work.fwd[s][0][first].min()) if first.any() else 0.0
    return bound * (1.0 - 1e-9)  # below any walk's rounding of the same sums


@dataclass(frozen=True, kw_only=True)
class _ReplicaWork:
    """Per stage: what each replica computes in each phase of the stage's rotation."""

    fwd: list[np.ndarray]
    """[phase, replica] forward seconds of one micro-batch."""
    bwd: list[np.ndarray]
    """[phase, replica] backward seconds of one micro-batch."""
    sync: list[float]
    """Seconds of the stage's DP collectives after its last backward."""
    live: list[np.ndarray]
    """Replicas with a share of some micro-batch."""


def _replica_work(
    plan: Plan, cost: Mapping[int, LayerCost], device: DeviceSpec, slow: Mapping[int, float]
) -> _ReplicaWork:
    m = plan.num_micro_batches
    fwd, bwd, sync, live = [], [], [], []
    for st in plan.stages:
        mhz = st.mhz or device.base_mhz
        factor = np.array([slow.get(r, 1.0) for r in st.ranks])
        per_f = compute_time(sum(cost[i].fwd_flops_per_sample for i in st.layers), device, mhz)
        per_b = compute_time(sum(cost[i].bwd_flops_per_sample for i in st.layers), device, mhz)
        period = min(st.period, m)  # micro-batch mb takes phase mb % period
        shares = np.array([st.shares(ph) for ph in range(period)], dtype=np.float64)
        fwd.append(shares * per_f * factor)  # [phase, replica] seconds
        bwd.append(shares * per_b * factor)
        sync.append(_sync_s(st, cost, device))
        live.append(shares.sum(axis=0) > 0)
    return _ReplicaWork(fwd=fwd, bwd=bwd, sync=sync, live=live)


def _stage_links(
    plan: Plan, cost: Mapping[int, LayerCost], device: DeviceSpec
) -> list[list[_Links]]:
    """Per boundary ``s`` (stages ``s`` and ``s + 1``), the routes of each micro-batch
    of one block of their rotations (micro-batch mb uses ``mb % len(block)``)."""
    links = []
    for s in range(plan.pp - 1):
        a, b = plan.stages[s], plan.stages[s + 1]
        per_sample = cost[a.layer_stop - 1].output_bytes_per_sample
        block = min(math.lcm(a.period, b.period), plan.num_micro_batches)
        distinct: dict[tuple[int, int], _Links] = {}  # phases in one block share routes
        row = []
        for ph in range(block):
            key = (a.turn(ph), b.turn(ph))
            if key not in distinct:
                distinct[key] = _links(plan, s, ph, per_sample, device)
            row.append(distinct[key])
        links.append(row)
    return links


_MAX = np.maximum.reduce


def _run_actions(
    plan: Plan,
    work: _ReplicaWork,
    links: Sequence[Sequence[_Links]],
    order: Sequence[tuple[int, Op, int]],
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """(forward ends, backward ends: ``B`` or ``I``) [micro-batch, replica] of every
    stage, and when each replica's compute is done, walking the plan's lists in
    dependency order (``order``: :func:`action_order`). The ends carry one more column,
    always 0: where :attr:`_Links.into_dst` pads."""
    p, m = plan.pp, plan.num_micro_batches
    fwd_end = [np.zeros((m, st.dp + 1)) for st in plan.stages]
    bwd_end = [np.zeros((m, st.dp + 1)) for st in plan.stages]
    free = [np.zeros(st.dp) for st in plan.stages]
    parts = [split_parts(first=s == 0) for s in range(p)]
    for s, op, mb in order:
        phase = mb % len(work.fwd[s])
        if op is Op.FORWARD:
            if s > 0:
                ln = links[s - 1][mb % len(links[s - 1])]
                ready = _MAX(fwd_end[s - 1][mb][ln.into_dst] + ln.into_dst_s, axis=0)
                end = np.maximum(free[s], ready)
                end += work.fwd[s][phase]
            else:
                end = free[s] + work.fwd[s][phase]
            fwd_end[s][mb, :-1] = end
        elif op is Op.WEIGHT:
            end = free[s] + work.bwd[s][phase] * parts[s][1]
        else:
            if s < p - 1:
                ln = links[s][mb % len(links[s])]
                ready = _MAX(bwd_end[s + 1][mb][ln.into_src] + ln.into_src_s, axis=0)
            else:
                ready = fwd_end[s][mb, :-1]
            end = np.maximum(free[s], ready)
            end += work.bwd[s][phase] if op is Op.BACKWARD else work.bwd[s][phase] * parts[s][0]
            bwd_end[s][mb, :-1] = end
        free[s] = end
    return fwd_end, bwd_end, free


def _sends_done(
    plan: Plan,
    links: Sequence[Sequence[_Links]],
    fwd_end: Sequence[np.ndarray],
    bwd_end: Sequence[np.ndarray],
    free: Sequence[np.ndarray],
) -> list[np.ndarray]:
    """When each replica is done: its compute and its last send (a send leaves when its
    micro-batch's compute ends, so a replica's last is at the latest of those ends plus
    that micro-batch's longest route)."""
    m = plan.num_micro_batches
    done = [f.copy() for f in free]
    for s in range(plan.pp - 1):  # sends: activations to s + 1, gradients back to s
        row = links[s]
        each = np.arange(m) % len(row)
        out = np.stack([ln.src_reach for ln in row])[each]  # [micro-batch, sender]
        np.maximum(done[s], _MAX(fwd_end[s][:, :-1] + out, axis=0), out=done[s])
        back = np.stack([ln.dst_reach for ln in row])[each]
        np.maximum(done[s + 1], _MAX(bwd_end[s + 1][:, :-1] + back, axis=0), out=done[s + 1])
    return done
