"""The throughput planner: dataflow, graph and DVFS together (paper §4.1-4.3).

After micro-batch resizing (:mod:`elaswave.engine.dataflow`) the stage that lost ranks
runs larger micro-batches and becomes the pipeline's straggler; a slow rank (fail-slow)
does the same to its stage. :func:`rebalance` is a pure function of (plan, per-rank
slowdowns, policy) that restores balance along the policy's dimensions:

1. **Dataflow.** Inside each stage, samples are re-split in inverse proportion to the
   replicas' slowdowns, so a slow rank takes fewer (every policy but ``none``).
2. **Graph** (``migrate``). The minimax partition (:func:`elaswave.engine.graph.plan_layers`)
   over the stages as they now are (widths, micro-batches, clocks, slowdowns) moves
   layers off the straggler; adopted only if it shortens the slowest mini-step by more
   than ``min_gain``.
3. **DVFS** (``migrate+dvfs``). The stages still slowest (within ``min_gain`` of the
   slowest: coarse layers can leave several tied) are up-clocked, each as little as
   needed, to the next-slowest stage's time (:func:`elaswave.engine.dvfs.plan_frequency`,
   observing the cost model), within the job's power budget when one is given (the
   power the lost ranks no longer draw is what the survivors may spend).

Steps 2 and 3 price stages by per-stage mini-step tables. A stage whose shares rotate
(:attr:`~elaswave.engine.plan.StagePlan.rotate`) has no single price there: it costs
between its mean and its largest share depending on its neighbours, so steps 2 and 3
run at several prices, and on every regrouping of the global batch into micro-batches
that no stage rotates on (:func:`~elaswave.engine.dataflow.regroupings`; larger ones must
fit in memory: layers then move whatever that gains), and the candidate whose whole step
simulates shortest, replica by replica (:func:`~elaswave.engine.steptime.
plan_step_time`), is kept, its rotating shares held for the block of micro-batches
(:data:`ROTATION_BLOCKS`) that steps fastest.

It returns the next plan (generation + 1) and a reason naming what changed and the
predicted mini-step times; a plan identical to the input is returned unchanged.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from elaswave.engine.cost import DeviceSpec, LayerCost, StageSpec, layer_costs, segment_tables
from elaswave.engine.dataflow import regroup, regroupings
from elaswave.engine.dvfs import FrequencyDecision, plan_frequency
from elaswave.engine.graph import Infeasible, plan_layers
from elaswave.engine.plan import Plan, StagePlan
from elaswave.engine.steptime import plan_step_time, step_lower_bound
from elaswave.fabric.remap import FP32_BYTES
from elaswave.model.config import ModelConfig

__all__ = [
    "Policy",
    "RebalanceDecision",
    "balanced_counts",
    "power",
    "rebalance",
    "split_by_speed",
]


class Policy(enum.StrEnum):
    """Which dimensions a change may rebalance (the paper's ablation)."""

    NONE = "none"
    """Keep the plan (no mitigation of a fail-slow rank)."""
    RESIZE = "resize"
    """Dataflow only: micro-batch resizing and speed-proportional splits."""
    MIGRATE = "migrate"
    """Dataflow and graph: layers migrate between stages."""
    MIGRATE_DVFS = "migrate+dvfs"
    """Dataflow, graph and DVFS."""


POLICIES = tuple(p.value for p in Policy)


@dataclass(frozen=True)
class RebalanceDecision:
    plan: Plan
    ministep_before_s: tuple[float, ...]
    """Predicted mini-step time of every stage under the input plan."""
    ministep_after_s: tuple[float, ...]
    """The same under the returned plan."""
    moved: tuple[tuple[int, int, int], ...]
    """(layer, from stage, to stage) of every layer that changes stage."""
    frequencies: Mapping[int, FrequencyDecision]
    """The DVFS planner's decision for each stage it up-clocks (``migrate+dvfs`` only)."""
    reason: str


def split_by_speed(total: int, slowdowns: Sequence[float]) -> tuple[int, ...]:
    """Split ``total`` samples so that the slowest replica's time ``size x slowdown`` is
    as small as possible (ties: earlier replicas take more). Exact: each sample goes to
    the replica whose time after taking it is smallest."""
    if total < 1 or not slowdowns or min(slowdowns) < 1.0:
        raise ValueError(f"cannot split {total} samples over slowdowns {list(slowdowns)}")
    sizes = [0] * len(slowdowns)
    for _ in range(total):
        best = min(range(len(sizes)), key=lambda j: ((sizes[j] + 1) * slowdowns[j], j))
        sizes[best] += 1
    return tuple(sizes)


def _by_speed_in(grain: int, total: int, slowdowns: Sequence[float]) -> tuple[int, ...]:
    """:func:`split_by_speed` in whole blocks of ``grain`` samples (:attr:`Plan.grain`)."""
    if total % grain:
        grain = 1
    return tuple(grain * n for n in split_by_speed(total // grain, slowdowns))


def _slowdowns(stage: StagePlan, slowdowns: Mapping[int, float]) -> list[float]:
    return [max(1.0, slowdowns.get(rank, 1.0)) for rank in stage.ranks]


def _stage_specs(
    plan: Plan,
    slowdowns: Mapping[int, float],
    device: DeviceSpec,
    memory_cap_bytes: float,
    rotation: float = 1.0,
) -> list[StageSpec]:
    """The planner's view of each stage. A rotating stage's compute is priced at
    ``mean + rotation x (largest - mean)`` of its shares: 1 is the largest (an upper
    bound), 0 the mean (what the replicas average); its memory at the largest."""
    specs = []
    for stage in plan.stages:
        slow = _slowdowns(stage, slowdowns)
        samples = None
        if stage.rotate:  # every replica takes every share in turn, at its own speed
            load, slowdown = stage.load, max(slow)
            if rotation < 1.0:
                mean = sum(stage.sizes) / stage.dp
                samples = mean + rotation * (load - mean)
        else:
            # The stage's mini-step is set by its slowest replica: max over replicas of
            # size x slowdown, expressed as the largest micro-batch times a factor >= 1.
            load = max(stage.sizes)
            worst = max(size * s for size, s in zip(stage.sizes, slow, strict=True) if size)
            slowdown = max(1.0, worst / load)
        specs.append(
            StageSpec(
                dp=stage.dp,
                micro_batch=load,
                mhz=stage.mhz if stage.mhz is not None else device.base_mhz,
                slowdown=slowdown,
                memory_cap_bytes=memory_cap_bytes,
                samples=samples,
            )
        )
    return specs


def _at(
    layers: Sequence[LayerCost],
    specs: Sequence[StageSpec],
    device: DeviceSpec,
    boundaries: Sequence[int],
    num_micro_batches: int,
) -> tuple[tuple[float, ...], list[int]]:
    """Each stage's mini-step time with its layers, and the stages whose layers, at their
    specs' micro-batches, pass their memory caps (one pass over the tables)."""
    times, memory = segment_tables(layers, specs, device, num_micro_batches=num_micro_batches)
    spans = [(p, boundaries[p], boundaries[p + 1]) for p in range(len(boundaries) - 1)]
    return (
        tuple(float(times[p, a, b]) for p, a, b in spans),
        [p for p, a, b in spans if memory[p, a, b] > specs[p].memory_cap_bytes],
    )


def _times(
    layers: Sequence[LayerCost],
    specs: Sequence[StageSpec],
    device: DeviceSpec,
    boundaries: Sequence[int],
    num_micro_batches: int,
) -> tuple[float, ...]:
    return _at(layers, specs, device, boundaries, num_micro_batches)[0]


def power(stages: Sequence[StagePlan], device: DeviceSpec) -> float:
    """Power the stages' ranks draw together, in ranks at the base clock: dynamic power
    taken as cubic in the clock (voltage scales with frequency)."""
    return sum(s.dp * ((s.mhz or device.base_mhz) / device.base_mhz) ** 3 for s in stages)


def _upclock(
    stages: Sequence[StagePlan],
    specs: Sequence[StageSpec],
    *,
    layers: Sequence[LayerCost],
    device: DeviceSpec,
    boundaries: Sequence[int],
    num_micro_batches: int,
    times: Sequence[float],
    tie: float,
    power_budget: float | None,
) -> tuple[dict[int, FrequencyDecision], str]:
    """The residual stragglers and their clocks: every stage within ``tie`` (a fraction)
    of the slowest mini-step gates the step, and each is up-clocked as little as needed
    (:func:`plan_frequency`) to the slowest other stage's time. Several stages tie when
    layers are too coarse to balance them (every stage a failure took a rank from).

    With ``power_budget`` (:func:`power` units) the clocks must keep the job within it:
    the target is then the shortest mini-step the budget affords, found by bisection."""
    slowest = max(times)
    gating = [p for p, t in enumerate(times) if t >= slowest * (1.0 - tie)]
    others = [t for p, t in enumerate(times) if p not in gating]
    if not others:
        return {}, "every stage gates the step alike: no straggler to up-clock"

    def observe(stage: int, mhz: float) -> float:
        trial = list(specs)
        trial[stage] = dataclasses.replace(specs[stage], mhz=mhz)
        return _times(layers, trial, device, boundaries, num_micro_batches)[stage]

    def aim(target: float) -> dict[int, FrequencyDecision]:
        return {
            p: plan_frequency(
                functools.partial(observe, p),
                current_mhz=specs[p].mhz,
                max_mhz=device.max_mhz,
                target_s=target,
                tolerance_s=0.01 * target,
                min_step_mhz=10.0,
            )
            for p in gating
        }

    def draws(decisions: Mapping[int, FrequencyDecision]) -> float:
        clocked = [
            dataclasses.replace(s, mhz=decisions[p].mhz) if p in decisions else s
            for p, s in enumerate(stages)
        ]
        return power(clocked, device)

    target = max(others)
    decisions = aim(target)
    note = ""
    if power_budget is not None and draws(decisions) > power_budget:
        # Bisect the target between the affordable (slowest: no change) and the wanted.
        lo, hi, best = target, slowest, aim(slowest)
        while hi - lo > 0.005 * slowest:
            mid = (lo + hi) / 2
            trial = aim(mid)
            if draws(trial) <= power_budget:
                hi, best = mid, trial
            else:
                lo = mid
        decisions, target = best, hi
        note = (
            f"the power budget ({power_budget:g} ranks at base clock) affords "
            f"{target * 1e3:.1f} ms; "
        )
    up = {p: d for p, d in decisions.items() if d.mhz != specs[p].mhz}
    return up, note + "; ".join(f"stage {p}: {d.reason}" for p, d in decisions.items())


def _fmt(times: Sequence[float]) -> str:
    return "[" + ", ".join(f"{t * 1e3:.1f}" for t in times) + "] ms"


ROTATION_PRICES = (1.0, 0.5, 0.0)
"""Where between a rotating stage's largest share (1) and its mean share (0) the planner
prices it; each price yields a candidate plan and the simulated step picks one."""


@dataclass(frozen=True)
class _Candidate:
    stages: tuple[StagePlan, ...]
    num_micro_batches: int
    times: tuple[float, ...]
    moved: tuple[tuple[int, int, int], ...]
    frequencies: Mapping[int, FrequencyDecision]
    reasons: tuple[str, ...]


def _graph_and_clocks(
    stages: Sequence[StagePlan],
    specs: list[StageSpec],
    *,
    policy: Policy,
    layers: Sequence[LayerCost],
    device: DeviceSpec,
    num_micro_batches: int,
    min_gain: float,
    power_budget: float | None,
) -> _Candidate:
    """Steps 2 (graph) and 3 (DVFS) of :func:`rebalance` on stages priced by ``specs``."""
    stages = list(stages)
    boundaries = [s.layer_start for s in stages] + [stages[-1].layer_stop]
    times, over = _at(layers, specs, device, boundaries, num_micro_batches)
    reasons: list[str] = []
    moved: list[tuple[int, int, int]] = []
    pp = len(stages)
    if policy in (Policy.MIGRATE, Policy.MIGRATE_DVFS) and pp > 1:  # 2. graph
        try:
            partition = plan_layers(layers, specs, device, num_micro_batches=num_micro_batches)
        except Infeasible:
            if over:
                raise
            partition = None  # no partition fits: the current layers stay where they are
        # Larger micro-batches (regrouped) can leave the current layers past memory
        # (``over``): then the partition, which fits, is taken whatever it gains.
        if partition is not None and (
            over or partition.bottleneck_s < max(times) * (1.0 - min_gain)
        ):
            new_bounds = list(partition.boundaries)
            for layer in range(len(layers)):
                src = next(p for p in range(pp) if boundaries[p] <= layer < boundaries[p + 1])
                dst = next(p for p in range(pp) if new_bounds[p] <= layer < new_bounds[p + 1])
                if src != dst:
                    moved.append((layer, src, dst))
            boundaries = new_bounds
            stages = [
                dataclasses.replace(s, layer_start=boundaries[i], layer_stop=boundaries[i + 1])
                for i, s in enumerate(stages)
            ]
            times = _times(layers, specs, device, boundaries, num_micro_batches)
            if over:
                reasons.append(f"stages {over} would not fit their memory with their layers")
            reasons.append(
                f"layers {[m[0] for m in moved]} move stages "
                f"({', '.join(f'{m[0]}: {m[1]}->{m[2]}' for m in moved)}): {partition.reason}"
            )
        elif partition is None:
            reasons.append("no partition of the layers fits in memory: layers stay")
        else:
            reasons.append(
                f"no partition shortens the slowest mini-step by more than {min_gain:.0%} "
                f"(best {partition.bottleneck_s * 1e3:.1f} ms)"
            )

    frequencies: dict[int, FrequencyDecision] = {}
    if policy is Policy.MIGRATE_DVFS and pp > 1:  # 3. DVFS on the residual stragglers
        frequencies, why = _upclock(
            stages, specs, layers=layers, device=device, boundaries=boundaries,
            num_micro_batches=num_micro_batches, times=times, tie=min_gain,
            power_budget=power_budget,
        )  # fmt: skip
        for p, decision in frequencies.items():
            stages[p] = dataclasses.replace(stages[p], mhz=decision.mhz)
            specs[p] = dataclasses.replace(specs[p], mhz=decision.mhz)
        if frequencies:
            times = _times(layers, specs, device, boundaries, num_micro_batches)
        reasons.append(why)
    return _Candidate(
        tuple(stages), num_micro_batches, times, tuple(moved), frequencies, tuple(reasons)
    )


def _by_speed(plan: Plan, slowdowns: Mapping[int, float]) -> Plan:
    """``plan`` with the samples of every stage that has a slow rank split by speed
    (step 1): a slow rank keeps its smaller share, so those shares do not rotate."""
    stages = []
    for stage in plan.stages:
        slow = _slowdowns(stage, slowdowns)
        if max(slow) > 1.0:
            stage = dataclasses.replace(
                stage, sizes=_by_speed_in(plan.grain, sum(stage.sizes), slow), rotate=False,
                block=1,
            )  # fmt: skip
        stages.append(stage)
    return dataclasses.replace(plan, stages=tuple(stages))


ROTATION_BLOCKS = (1, 2, 3, 4, 8)
"""Rotation block lengths (:attr:`~elaswave.engine.plan.StagePlan.block`) the planner
simulates for a plan whose shares rotate."""

BLOCK_GAIN = 0.01
"""How much shorter than block 1's a longer block's simulated step must be to be kept:
less is within the step model's error, and block 1 is the plan users expect to read."""


def _in_blocks(stages: Sequence[StagePlan], block: int) -> tuple[StagePlan, ...]:
    """``stages`` with every rotating stage's shares held for ``block`` micro-batches."""
    return tuple(dataclasses.replace(s, block=block) if s.rotate else s for s in stages)


def _best_block(
    plan: Plan,
    slowdowns: Mapping[int, float],
    layers: Sequence[LayerCost],
    device: DeviceSpec,
) -> tuple[float, int]:
    """(simulated step, block) of the rotation block length in :data:`ROTATION_BLOCKS`
    under which ``plan`` steps fastest, if by more than :data:`BLOCK_GAIN` against
    block 1 (ties: the shorter block); a plan that does not rotate has only block 1.
    A block whose :func:`~elaswave.engine.steptime.step_lower_bound` cannot beat that
    is not simulated."""

    def trial(block: int) -> Plan:
        return dataclasses.replace(plan, stages=_in_blocks(plan.stages, block))

    def step(block: int) -> float:
        return plan_step_time(trial(block), layers, device, slowdowns=slowdowns).step_s

    single = step(1)
    need = single * (1.0 - BLOCK_GAIN)  # a block that cannot step faster is not walked
    longer = [b for b in ROTATION_BLOCKS if b > 1] if any(s.rotate for s in plan.stages) else []
    bound = {b: step_lower_bound(trial(b), layers, device, slowdowns=slowdowns) for b in longer}
    steps = {b: step(b) for b in longer if bound[b] < need}
    block = min(steps, key=lambda b: (steps[b], b), default=1)
    if block > 1 and steps[block] < need:
        return steps[block], block
    return single, 1


def _best_grouping(
    current: Plan,
    candidate: Callable[[Plan, float], _Candidate],
    slowdowns: Mapping[int, float],
    layers: Sequence[LayerCost],
    device: DeviceSpec,
) -> tuple[_Candidate, str]:
    """Of the rotating plan's candidates (one per rotation price) and those of every
    regrouping under which no stage rotates (:func:`~elaswave.engine.dataflow.
    regroupings`; skipped when its micro-batches do not fit in memory), the one whose
    step simulates shortest; ties go to the earlier (the current grouping, the higher
    price). Returns it and the comparison as a reason."""
    trials = [(f"{r:g}", current, r, "") for r in ROTATION_PRICES]
    for g in regroupings(current):
        regrouped_plan, regrouping = regroup(current, g)
        trials.append((f"{g}-sample", _by_speed(regrouped_plan, slowdowns), 1.0, regrouping))
    options: list[tuple[str, _Candidate, str]] = []
    skipped: list[str] = []
    failures: list[Infeasible] = []
    for label, trial, rotation, regrouping in trials:
        try:
            options.append((label, candidate(trial, rotation), regrouping))
        except Infeasible as exc:  # its micro-batches do not fit in memory
            failures.append(exc)
            if trial is not current:
                skipped.append(f"{label} micro-batches do not fit ({exc})")
    if not options:
        raise failures[0]
    simulated: dict[tuple[int, tuple[StagePlan, ...]], tuple[float, int]] = {}  # often agree
    for _, c, _ in options:
        key = (c.num_micro_batches, c.stages)
        if key not in simulated:
            trial = dataclasses.replace(current, stages=c.stages, num_micro_batches=key[0])
            simulated[key] = _best_block(trial, slowdowns, layers, device)
    steps = [simulated[(c.num_micro_batches, c.stages)][0] for _, c, _ in options]
    blocks = [simulated[(c.num_micro_batches, c.stages)][1] for _, c, _ in options]
    best = min(range(len(options)), key=steps.__getitem__)
    size = current.global_batch // current.num_micro_batches
    rotating = [
        f"{label} -> step {t * 1e3:.1f} ms" + (f" in blocks of {b} micro-batches" if b > 1 else "")
        for (label, _, regrouping), t, b in zip(options, steps, blocks, strict=True)
        if not regrouping
    ]
    regrouped = [
        f"{label} micro-batches -> step {t * 1e3:.1f} ms"
        for (label, _, regrouping), t in zip(options, steps, strict=True)
        if regrouping
    ]
    if rotating:
        why = f"rotating {size}-sample shares priced at {', '.join(rotating)}"
        why += " (0 mean share, 1 largest)"
    else:  # memory is priced at the largest share whatever the price: none fits
        why = f"rotating {size}-sample shares do not fit ({failures[0]})"
    if regrouped or skipped:
        why += "; regrouped: " + ", ".join(regrouped + skipped)
    label, chosen, regrouping = options[best]
    chosen = dataclasses.replace(chosen, stages=_in_blocks(chosen.stages, blocks[best]))
    return chosen, f"{why}: {label} chosen" + (f"; {regrouping}" if regrouping else "")


def rebalance(
    plan: Plan,
    *,
    layers: Sequence[LayerCost],
    device: DeviceSpec,
    policy: Policy | str,
    slowdowns: Mapping[int, float] | None = None,
    memory_cap_bytes: float | None = None,
    min_gain: float = 0.02,
    power_budget: float | None = None,
) -> RebalanceDecision:
    """The next plan under ``policy`` for ``plan`` with per-rank ``slowdowns`` (>= 1);
    ``power_budget`` (:func:`power` units, None: no limit beyond each device's maximum
    clock) bounds what DVFS may spend.

    When a stage's shares rotate, the mini-step tables can only bound its cost (each
    replica takes the largest share in some micro-batches, the mean on average, and how
    much of the difference its neighbours wait for depends on the whole pipeline): the
    graph and DVFS steps then run once per price in :data:`ROTATION_PRICES`, and the
    candidate whose step simulates shortest (:func:`~elaswave.engine.steptime.
    plan_step_time`, replica by replica) is the plan; ties go to the higher price."""
    policy = Policy(policy)
    slowdowns = dict(slowdowns or {})
    unknown = set(slowdowns) - set(plan.ranks)
    if unknown:
        raise ValueError(f"slowdowns given for ranks {sorted(unknown)} not in the plan")
    cap = device.memory_bytes if memory_cap_bytes is None else memory_cap_bytes
    num_mb = plan.num_micro_batches
    boundaries = [s.layer_start for s in plan.stages] + [plan.stages[-1].layer_stop]
    before = _times(layers, _stage_specs(plan, slowdowns, device, cap), device, boundaries, num_mb)
    if policy is Policy.NONE:
        return RebalanceDecision(plan, before, before, (), {}, "policy none: plan kept")

    reasons = []
    stages = list(plan.stages)
    if policy is Policy.MIGRATE_DVFS and any(s.mhz is not None for s in stages):
        # DVFS asks for the lowest clocks that align the stages: re-plan them from base.
        stages = [dataclasses.replace(s, mhz=None) for s in stages]
        reasons.append("stage clocks re-planned from base")
    current = _by_speed(dataclasses.replace(plan, stages=tuple(stages)), slowdowns)  # 1.
    for was, now in zip(stages, current.stages, strict=True):
        if now != was:
            reasons.append(f"stage {now.stage} splits samples {list(now.sizes)} by speed")
    stages = list(current.stages)

    def candidate(trial: Plan, rotation: float) -> _Candidate:
        return _graph_and_clocks(
            trial.stages, _stage_specs(trial, slowdowns, device, cap, rotation), policy=policy,
            layers=layers, device=device, num_micro_batches=trial.num_micro_batches,
            min_gain=min_gain, power_budget=power_budget,
        )  # fmt: skip

    rotating = any(s.rotate for s in stages) and policy is not Policy.RESIZE and plan.pp > 1
    if not rotating:
        chosen = candidate(current, 1.0)
    else:
        chosen, why = _best_grouping(current, candidate, slowdowns, layers, device)
        reasons.append(why)
    reasons += chosen.reasons
    new = dataclasses.replace(
        plan, stages=chosen.stages, num_micro_batches=chosen.num_micro_batches
    )
    if new == plan:
        return RebalanceDecision(
            plan, before, before, (), chosen.frequencies, "; ".join([*reasons, "plan kept"])
        )
    new = dataclasses.replace(new, generation=plan.generation + 1)
    summary = f"predicted mini-steps {_fmt(before)} -> {_fmt(chosen.times)}"
    return RebalanceDecision(
        new, before, chosen.times, chosen.moved, chosen.frequencies,
        "; ".join([*reasons, summary]),
    )  # fmt: skip


def balanced_counts(
    layers: ModelConfig | Sequence[LayerCost],
    *,
    dp: int,
    pp: int,
    micro_batch: int,
    device: DeviceSpec,
) -> tuple[int, ...]:
    """Layers per stage of the minimax partition of a static job (an AdaPipe-like
    balanced start, so that a later change is measured against a balanced pipeline).
    ``layers``: their costs, or a model whose formula costs (fp32) are taken."""
    spec = StageSpec(
        dp=dp, micro_batch=micro_batch, mhz=device.base_mhz, memory_cap_bytes=device.memory_bytes
    )
    if isinstance(layers, ModelConfig):
        layers = layer_costs(layers, dtype_bytes=FP32_BYTES)
    partition = plan_layers(layers, [spec] * pp, device)
    return partition.counts
