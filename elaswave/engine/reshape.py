"""Ranks that change stage, and pipelines that change shape (pure).

Micro-batch resizing, layer migration and clocks balance a pipeline whose stages keep
their ranks. They cannot help when a failure empties a stage (nothing is left to hold
its layers), nor when the survivors are fewer than the stages, and they are a poor
answer when one stage lost most of its ranks while others kept all theirs. Then
:func:`reshape` reassigns ranks: a survivor leaves a wide stage for an empty or narrow
one, and when fewer ranks than stages survive, the pipeline gets fewer stages.

Every candidate is priced by its simulated step (:func:`~elaswave.engine.steptime.
plan_step_time`, after the throughput planner's rebalancing under the job's policy)
over a horizon of steps, plus the time to move the bytes the change needs: a rank that
takes layers it did not hold receives their parameters and its optimizer shard of them
(:func:`receive_bytes`). The cheapest candidate is the plan. The state of an emptied
stage survives in the host snapshots that :func:`~elaswave.engine.plan.
snapshot_placement` keeps in other stages.

When every stage keeps a rank, :func:`reformed` prices the pipelines of another number
of stages against the plan that keeps them: longer ones when joiners come to a pipeline
that lost stages (it grows back), and, where the job allows it, shorter ones of full
stages (damaged replicas re-formed). The runtime applies every plan of this module
(:func:`elaswave.engine.replan.replan`); the simulator prices the same ones.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from elaswave.comm.spec import MAX_MICRO_BATCHES
from elaswave.engine.cost import DeviceSpec, LayerCost, StageSpec
from elaswave.engine.dataflow import split_shares
from elaswave.engine.graph import Infeasible, plan_layers
from elaswave.engine.plan import Plan, StagePlan
from elaswave.engine.rebalance import Policy, rebalance
from elaswave.engine.recovery import Rebalancing, next_plan
from elaswave.engine.steptime import plan_step_time
from elaswave.fabric.errors import Unrecoverable
from elaswave.fabric.remap import FP32_BYTES, STATE_TENSORS

HORIZON_STEPS = 100
"""Steps over which a reshape's one-off move is weighed against its faster step."""

EXHAUSTIVE = 64
"""Vectors of stage widths priced one by one when there are at most this many."""

MAX_MOVES = 4
"""Ranks moved one at a time, at most, while balancing widths (each time one of the
widest stages gives a rank to whichever stage that prices best)."""

_PARAM = float(FP32_BYTES)
_OPTIMIZER = float(STATE_TENSORS * FP32_BYTES)


@dataclass(frozen=True)
class Reshaped:
    plan: Plan
    moved: tuple[tuple[int, int | None, int], ...]
    """(rank, its stage before or None for a joiner, its stage after) of every rank whose
    stage changes."""
    step_s: float
    """Simulated step of ``plan``."""
    move_bytes: float
    """Most bytes one rank receives for layers it did not hold."""
    reason: str


def receive_bytes(old: Plan, new: Plan, layers: Sequence[LayerCost]) -> dict[int, float]:
    """Bytes each rank of ``new`` receives: the parameters, and its optimizer shard, of
    every layer its new stage runs that its old stage did not (all of them for a rank
    that was not in ``old``)."""
    params = {c.index: c.params for c in layers}
    held = {r: set(s.layers) for s in old.stages for r in s.ranks}
    out = {}
    for s in new.stages:
        per = _PARAM + _OPTIMIZER / s.dp
        for r in s.ranks:
            out[r] = sum(params[i] for i in s.layers if i not in held.get(r, ())) * per
    return out


def _with_ranks(plan: Plan, assignment: Sequence[Sequence[int]], per_mb: int | None = None) -> Plan:
    """``plan``'s stages (layers, clocks) with ``assignment[s]`` as stage ``s``'s ranks,
    every stage's micro-batch shares re-split evenly over global micro-batches of
    ``per_mb`` samples (default: the plan's)."""
    per_mb = per_mb or plan.global_batch // plan.num_micro_batches
    stages = tuple(
        dataclasses.replace(s, ranks=tuple(ranks), **split_shares(per_mb, len(ranks), plan.grain))
        for s, ranks in zip(plan.stages, assignment, strict=True)
    )
    return dataclasses.replace(plan, num_micro_batches=plan.global_batch // per_mb, stages=stages)


def _pipeline(
    plan: Plan,
    ranks: Sequence[int],
    pp: int,
    layers: Sequence[LayerCost],
    device: DeviceSpec,
    samples: int | None = None,
) -> Plan:
    """A pipeline of ``pp`` stages over ``ranks`` (in order, as even in width as they
    go), its layers partitioned by the graph planner, with the largest global
    micro-batch (a divisor of the global batch, at most the plan's or ``samples``)
    whose activations fit. Raises Infeasible if none fits in memory."""
    widths = [len(ranks) // pp + (k < len(ranks) % pp) for k in range(pp)]
    largest = max(plan.global_batch // plan.num_micro_batches, samples or 0)
    sizes = [
        g
        for g in range(largest, 0, -1)
        if plan.global_batch % g == 0
        and g % plan.grain == 0
        and plan.global_batch // g <= MAX_MICRO_BATCHES
    ]
    for per_mb in sizes:
        count = plan.global_batch // per_mb
        specs = [
            StageSpec(
                dp=w,
                micro_batch=max(split_shares(per_mb, w, plan.grain)["sizes"]),
                mhz=device.base_mhz,
                memory_cap_bytes=device.memory_bytes,
            )
            for w in widths
        ]
        try:
            counts = plan_layers(layers, specs, device, num_micro_batches=count).counts
        except Infeasible:
            continue
        stages, start, at = [], 0, 0
        for k, (n, width) in enumerate(zip(counts, widths, strict=True)):
            members = tuple(ranks[at : at + width])
            shares = split_shares(per_mb, width, plan.grain)
            stages.append(StagePlan(k, start, start + n, members, **shares))
            start, at = start + n, at + width
        return dataclasses.replace(plan, num_micro_batches=count, stages=tuple(stages))
    raise Infeasible(f"no {pp}-stage pipeline of widths {widths} fits in memory")


def reshape(
    plan: Plan,
    failed: Collection[int],
    joined: Sequence[int] = (),
    *,
    rebalancing: Rebalancing,
    horizon: int = HORIZON_STEPS,
    max_stages: int | None = None,
    samples: int | None = None,
    search: bool = True,
    shorter: bool = False,
) -> Reshaped:
    """The cheapest plan for ``plan`` without ``failed`` and with ``joined``, letting
    ranks change stage and the pipeline change its number of stages (see the module
    docstring). The result is one generation after ``plan``.

    Candidates:

    * the plan without stage changes (:func:`~elaswave.engine.recovery.next_plan`),
      when every stage keeps a rank;
    * with at least as many ranks as stages: joiners on the narrowest stages, each
      emptied stage filled from the donor that prices best, then every vector of stage
      widths when there are at most :data:`EXHAUSTIVE` (each stage keeping its first
      ranks), else up to :data:`MAX_MOVES` single moves from a widest stage while one
      lowers the price; each in the plan's global micro-batches or ``samples`` (the
      job's own, which a pipeline that shrank its micro-batches goes back to);
    * with fewer ranks than stages, every shorter pipeline that fits in memory; with
      more, every longer one up to ``max_stages`` (the job's own stage count, for a
      pipeline that lost stages before), and with ``shorter`` every shorter one whose
      stages the ranks fill evenly, down to the first that does not fit in memory (a
      pipeline of fewer stages holds more of the model on each rank): 18 ranks left of
      8 stages x 3 replicas make 6 full stages x 3 rather than 8 stages of 2 or 3.

    ``search=False`` keeps the first assignment (joiners on the narrowest stages, each
    emptied stage filled from the best donor) and prices no other vector of widths: what
    a running job's every process can recompute within a plan's acknowledgment deadline
    (the full search rebalances each of up to :data:`EXHAUSTIVE` candidates).

    Raises Unrecoverable when no rank is left or no candidate fits in memory.
    """
    if rebalancing.device is None or not rebalancing.layers:
        raise ValueError("reshape needs the cost model's layers and device")
    failed = set(failed)
    survivors = [[r for r in s.ranks if r not in failed] for s in plan.stages]
    total = sum(map(len, survivors)) + len(joined)
    if total == 0:
        raise Unrecoverable(f"ranks {sorted(failed)} failed: no rank is left to train")
    pricing = _Pricing.of(plan, failed, rebalancing, horizon=horizon, samples=samples)
    candidates: list[tuple[Plan, str]] = []
    if all(survivors):
        candidates += _kept(plan, failed, rebalancing, joined)
    if total >= plan.pp and (reassigned := _reassigned(pricing, survivors, joined, search)):
        candidates.append(reassigned)
    ranks = [r for s in survivors for r in s] + list(joined)
    most_stages = max(plan.pp, max_stages or plan.pp)
    candidates += _other_pipelines(
        pricing, ranks, most_stages=most_stages, samples=samples, shorter=shorter
    )
    if not candidates:
        raise Unrecoverable(
            f"{total} ranks left for a pipeline of {plan.pp} stages, and no pipeline of "
            f"at most {most_stages} stages over them fits in their memory"
        )
    return _cheapest(pricing, candidates)


def reformed(
    plan: Plan,
    failed: Collection[int],
    joined: Sequence[int] = (),
    *,
    kept: Plan,
    rebalancing: Rebalancing,
    horizon: int = HORIZON_STEPS,
) -> Reshaped | None:
    """A pipeline of another number of stages over ``plan``'s survivors and ``joined``
    that prices lower than ``kept``, the plan keeping its stages (:func:`receive_bytes`
    counts both moves); None when there is none. Longer ones, up to
    ``rebalancing.stages``, when a pipeline that lost stages gets joiners; with
    ``rebalancing.reform``, shorter ones whose stages the ranks fill evenly (damaged
    replicas re-formed into fewer, full stages). Each is laid out and priced as
    :func:`reshape` lays out and prices its other pipelines."""
    if rebalancing.device is None or not rebalancing.layers:
        return None
    longer = bool(joined) and plan.pp < (rebalancing.stages or 0)
    if not longer and not (rebalancing.reform and failed):
        return None
    failed = set(failed)
    ranks = [r for s in plan.stages for r in s.ranks if r not in failed] + list(joined)
    pricing = _Pricing.of(plan, failed, rebalancing, horizon=horizon, samples=rebalancing.samples)
    others = _other_pipelines(
        pricing, ranks, most_stages=max(plan.pp, rebalancing.stages or 0) if longer else plan.pp,
        samples=rebalancing.samples, shorter=rebalancing.reform,
    )  # fmt: skip
    others = [(p, why) for p, why in others if p.pp != plan.pp]
    if not others:
        return None
    best = _cheapest(pricing, others)
    if pricing.priced(best.plan)[0] >= pricing.priced(kept)[0]:
        return None
    return best


@dataclass(frozen=True, kw_only=True)
class _Pricing:
    """What every candidate of one :func:`reshape` is priced against."""

    plan: Plan
    """The plan being reshaped; candidates are one generation after it."""
    rebalancing: Rebalancing
    """The job's throughput planner policy, applied to every candidate."""
    layers: Sequence[LayerCost]
    device: DeviceSpec
    slow: Mapping[int, float]
    """Slowdowns of the ranks that did not fail."""
    horizon: int
    """Steps over which a candidate's step is weighed against its one-off move."""
    sizes: tuple[int, ...]
    """Samples per global micro-batch a reassignment is tried in: the plan's, then the
    job's own when they differ and divide the global batch."""

    @classmethod
    def of(
        cls,
        plan: Plan,
        failed: Collection[int],
        rebalancing: Rebalancing,
        *,
        horizon: int,
        samples: int | None,
    ) -> _Pricing:
        assert rebalancing.device is not None
        current = plan.global_batch // plan.num_micro_batches
        sizes = [current]
        if samples is not None and samples != current and plan.global_batch % samples == 0:
            sizes.append(samples)  # the job's own micro-batches, if they fit again
        return cls(
            plan=plan,
            rebalancing=rebalancing,
            layers=rebalancing.layers,
            device=rebalancing.device,
            slow={r: f for r, f in rebalancing.slowdowns.items() if r not in failed},
            horizon=horizon,
            sizes=tuple(sizes),
        )

    def finish(self, trial: Plan) -> Plan:
        """``trial`` rebalanced under the policy (Infeasible if it cannot fit)."""
        if self.rebalancing.policy is not Policy.NONE:
            trial = rebalance(
                trial, layers=self.layers, device=self.device, policy=self.rebalancing.policy,
                slowdowns={r: f for r, f in self.slow.items() if r in trial.ranks},
                power_budget=self.rebalancing.power_budget,
            ).plan  # fmt: skip
        return dataclasses.replace(trial, generation=self.plan.generation + 1)

    def priced(self, trial: Plan) -> tuple[float, float, float]:
        """(price, simulated step, most bytes one rank receives) of ``trial``."""
        step = plan_step_time(trial, self.layers, self.device, slowdowns=self.slow).step_s
        most = max(receive_bytes(self.plan, trial, self.layers).values(), default=0.0)
        return step * self.horizon + most / self.device.p2p_bytes_per_s, step, most

    def shaped(self, assignment: Sequence[Sequence[int]]) -> tuple[float, Plan | None]:
        """(price, plan) of the stages' current layers over ``assignment`` (in the plan's
        or the job's global micro-batches, whichever prices lower); (inf, None) when the
        layers cannot fit in the ranks' memory."""
        best: tuple[float, Plan | None] = (math.inf, None)
        for per_mb in self.sizes:
            try:
                trial = self.finish(_with_ranks(self.plan, assignment, per_mb))
            except Infeasible:
                continue
            if (trial_price := self.priced(trial)[0]) < best[0]:
                best = (trial_price, trial)
        return best


def _kept(
    plan: Plan, failed: Collection[int], rebalancing: Rebalancing, joined: Sequence[int]
) -> list[tuple[Plan, str]]:
    """The plan without stage changes, when the ranks as they are can hold their layers."""
    try:
        kept, why = next_plan(plan, failed, rebalancing, joined=joined)
    except Unrecoverable:
        return []  # the ranks as they are cannot hold their layers: some must move
    return [(dataclasses.replace(kept, generation=plan.generation + 1), why)]


def _move(assignment: Sequence[Sequence[int]], src: int, dst: int) -> list[list[int]]:
    """``assignment`` with the last rank of stage ``src`` moved to stage ``dst``."""
    out = [list(x) for x in assignment]
    out[dst].append(out[src].pop())
    return out


def _reassigned(
    pricing: _Pricing,
    survivors: Sequence[Sequence[int]],
    joined: Sequence[int],
    search: bool,
) -> tuple[Plan, str] | None:
    """The best plan of the stages' layers over survivors and joiners when ranks may
    change stage (see :func:`reshape`), and the moves it makes; None if none fits."""
    assignment = _first_assignment(pricing, survivors, joined)
    best = _search_widths(pricing, assignment, search)
    if best is None:
        return None
    moves = _describe_moves(pricing.plan, best)
    return best, "; ".join(moves) or "ranks keep their stages"


def _first_assignment(
    pricing: _Pricing, survivors: Sequence[Sequence[int]], joined: Sequence[int]
) -> list[list[int]]:
    """Joiners on the narrowest stages, then each emptied stage filled from the donor
    that prices best."""
    num_stages = pricing.plan.pp
    assignment = [list(s) for s in survivors]
    for rank in joined:  # joiners first fill the narrowest stages
        k = min(range(num_stages), key=lambda p: (len(assignment[p]), p))
        assignment[k].append(rank)
    for k in range(num_stages):  # an emptied stage takes a rank from the best donor
        if not assignment[k]:
            donors = [p for p in range(num_stages) if len(assignment[p]) > 1]
            src = min(donors, key=lambda p: (pricing.shaped(_move(assignment, p, k))[0], p))
            assignment = _move(assignment, src, k)
    return assignment


def _search_widths(pricing: _Pricing, assignment: list[list[int]], search: bool) -> Plan | None:
    """The cheapest plan from ``assignment``: every vector of stage widths when there
    are at most :data:`EXHAUSTIVE`, else up to :data:`MAX_MOVES` single moves from a
    widest stage while one lowers the price (none of either without ``search``)."""
    num_stages = pricing.plan.pp
    best_price, best = pricing.shaped(assignment)
    vectors = _width_vectors(sum(map(len, assignment)), num_stages) if search else []
    if vectors is not None:  # few enough: price every vector of widths
        for widths in vectors:
            trial_assignment = _reassign(assignment, widths)
            trial_price, trial = pricing.shaped(trial_assignment)
            if trial_price < best_price:
                assignment, best, best_price = trial_assignment, trial, trial_price
    for _ in range(MAX_MOVES if vectors is None else 0):  # steepest descent
        widest = max(map(len, assignment))
        trials = [
            (*pricing.shaped(_move(assignment, a, b)), a, b)
            for a in range(num_stages)
            for b in range(num_stages)
            if a != b and len(assignment[a]) == widest > 1
        ]
        if not trials:
            break
        trial_price, trial, a, b = min(trials, key=lambda t: (t[0], t[2], t[3]))
        if trial_price >= best_price:
            break
        assignment, best, best_price = _move(assignment, a, b), trial, trial_price
    return best


def _other_pipelines(
    pricing: _Pricing,
    ranks: Sequence[int],
    *,
    most_stages: int,
    samples: int | None,
    shorter: bool,
) -> list[tuple[Plan, str]]:
    """Pipelines of another number of stages over ``ranks`` (see :func:`reshape`)."""
    plan, total = pricing.plan, len(ranks)
    if total >= plan.pp:  # longer pipelines, for one that lost stages before
        others = list(range(plan.pp + 1, min(total, most_stages) + 1))
        if shorter:  # fewer stages, every one as wide as the others
            others += [pp for pp in range(plan.pp - 1, 0, -1) if total % pp == 0]
    else:  # too few ranks for every stage: shorter ones
        others = list(range(1, total + 1))
    out = []
    for pp in others:
        try:
            other = pricing.finish(
                _pipeline(plan, ranks, pp, pricing.layers, pricing.device, samples)
            )
        except Infeasible:  # its layers do not fit, even in the smallest micro-batches
            if shorter and pp < plan.pp <= total:
                break  # fewer stages hold more layers each: none shorter fits either
            continue
        shape = [s.dp for s in other.stages]
        out.append((other, f"{total} ranks for {plan.pp} stages: the pipeline "
                    f"becomes {pp} stages of widths {shape}"))  # fmt: skip
    return out


def _cheapest(pricing: _Pricing, candidates: Sequence[tuple[Plan, str]]) -> Reshaped:
    """The candidate of lowest price (the first of equals), as a :class:`Reshaped`."""
    scored = [(pricing.priced(p), p, why) for p, why in candidates]
    (_, step, most), new, why = min(scored, key=lambda c: c[0][0])
    before = {r: s.stage for s in pricing.plan.stages for r in s.ranks}
    moved = tuple(
        (r, before.get(r), s.stage) for s in new.stages for r in s.ranks if before.get(r) != s.stage
    )
    return Reshaped(new, moved, step, most, f"{why}; simulated step {step:.3f} s")


def _width_vectors(total: int, pp: int) -> list[tuple[int, ...]] | None:
    """Every way to give ``pp`` stages at least one of ``total`` ranks; None past
    :data:`EXHAUSTIVE` of them (too many to price one by one)."""
    if math.comb(total - 1, pp - 1) > EXHAUSTIVE:
        return None
    return [w for w in itertools.product(range(1, total - pp + 2), repeat=pp) if sum(w) == total]


def _reassign(assignment: Sequence[Sequence[int]], widths: Sequence[int]) -> list[list[int]]:
    """``assignment`` changed to ``widths`` moving as few ranks as possible: each stage
    keeps its first ranks up to its width; the others fill the stages short of theirs."""
    keep = [list(a[:w]) for a, w in zip(assignment, widths, strict=True)]
    spare = [r for a, w in zip(assignment, widths, strict=True) for r in a[w:]]
    for k, w in enumerate(widths):
        while len(keep[k]) < w:
            keep[k].append(spare.pop())
    return keep


def _describe_moves(old: Plan, new: Plan) -> list[str]:
    before = {r: s.stage for s in old.stages for r in s.ranks}
    return [
        f"rank {r} moves from stage {before[r]} to stage {s.stage}"
        if r in before
        else f"rank {r} joins stage {s.stage}"
        for s in new.stages
        for r in s.ranks
        if before.get(r) != s.stage
    ]
