"""The training plan: which ranks run which layers on which samples.

A :class:`Plan` is the unit every elastic capability changes: micro-batch resizing edits
a stage's ``sizes``, layer migration edits ``layers``, a membership change edits
``ranks``. Workers derive their groups and their activation routes from the plan alone,
so applying a new plan needs no other state. Everything here is pure.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from elaswave.comm.spec import GroupSpec
from elaswave.data.sampler import even_split
from elaswave.engine.schedule import Schedule
from elaswave.fabric.placement import SnapshotPlacement, place_snapshots_across, snapshot_link_name


@dataclass(frozen=True)
class StagePlan:
    stage: int
    layer_start: int
    layer_stop: int
    ranks: tuple[int, ...]
    """Global ranks of the stage's DP replicas, in replica order."""
    sizes: tuple[int, ...]
    """Each replica's share of every global micro-batch (samples)."""
    mhz: float | None = None
    """The clock the stage's devices run at (DVFS); None: the device's base clock."""
    rotate: bool = False
    """The shares rotate over the replicas from one micro-batch to the next: in
    micro-batch ``mb`` replica ``j`` takes ``sizes[(j + mb) % dp]``. A micro-batch that
    the replicas do not divide (3 samples over 2) then costs between the mean share
    (1.5) and the largest (2): each replica averages the mean, but its neighbours wait
    for whichever replica holds their samples (:mod:`elaswave.engine.steptime`)."""
    block: int = 1
    """Micro-batches in a row that a rotating stage keeps the same shares for: in
    micro-batch ``mb`` replica ``j`` takes ``sizes[(j + mb // block) % dp]``. Blocks
    longer than one break the lockstep in which adjacent rotating stages keep meeting
    each other's largest share (the throughput planner simulates and picks the length);
    1 when the shares do not rotate. A step whose micro-batches end mid-period leaves
    some replicas up to a block's worth of samples above their mean (the step
    simulation counts it)."""

    @property
    def layers(self) -> range:
        return range(self.layer_start, self.layer_stop)

    @property
    def dp(self) -> int:
        return len(self.ranks)

    @property
    def period(self) -> int:
        """Micro-batches after which the shares repeat."""
        return self.dp * self.block if self.rotate else 1

    @property
    def load(self) -> int:
        """The largest share of a micro-batch any replica takes: what one replica's
        activations must hold room for, and the stage-level cost model's (upper-bound)
        price of a rotating stage."""
        return max(self.sizes)

    def turn(self, mb: int) -> int:
        """How far the shares have rotated by global micro-batch ``mb`` (0 when they
        do not rotate): replica ``j`` takes ``sizes[(j + turn) % dp]``."""
        return (mb // self.block) % self.dp if self.rotate else 0

    def shares(self, mb: int = 0) -> tuple[int, ...]:
        """Each replica's share of global micro-batch ``mb``."""
        k = self.turn(mb)
        return self.sizes[k:] + self.sizes[:k] if k else self.sizes

    def offsets(self, mb: int = 0) -> list[tuple[int, int]]:
        """[lo, hi) sample offsets of each replica inside global micro-batch ``mb``."""
        out, lo = [], 0
        for size in self.shares(mb):
            out.append((lo, lo + size))
            lo += size
        return out


@dataclass(frozen=True)
class Route:
    """Samples [lo, hi) of every global micro-batch flow from ``src`` to ``dst``."""

    src: int
    dst: int
    lo: int
    hi: int


@dataclass(frozen=True)
class Plan:
    generation: int
    global_batch: int
    num_micro_batches: int
    stages: tuple[StagePlan, ...]
    schedule: Schedule = Schedule.ONE_F_ONE_B
    """The pipeline schedule every stage runs (:mod:`elaswave.engine.schedule`)."""
    grain: int = 1
    """Every share is a whole number of blocks of this many samples (aligned on sample
    ids), each block computed on one rank: the job's micro-batch under float64 gradient
    sums (``[optim] grad_reduce_dtype``), whose exact sums then give every plan the same
    bits; 1 otherwise."""

    @property
    def pp(self) -> int:
        return len(self.stages)

    @property
    def ranks(self) -> list[int]:
        return [r for s in self.stages for r in s.ranks]

    def locate(self, rank: int) -> tuple[int, int]:
        """(stage, replica) of ``rank``."""
        for stage in self.stages:
            if rank in stage.ranks:
                return stage.stage, stage.ranks.index(rank)
        raise KeyError(f"rank {rank} is not in plan generation {self.generation}")

    def routes(self, stage: int, mb: int = 0) -> list[Route]:
        """Activation routes of micro-batch ``mb`` from ``stage`` to ``stage + 1``
        (gradients go back along them)."""
        a, b = self.stages[stage], self.stages[stage + 1]
        senders = [(r, lo, hi) for r, (lo, hi) in zip(a.ranks, a.offsets(mb), strict=True)]
        receivers = [(r, lo, hi) for r, (lo, hi) in zip(b.ranks, b.offsets(mb), strict=True)]
        out, j = [], 0
        for src, alo, ahi in senders:  # both cover the micro-batch in order: merge them
            while j < len(receivers) and receivers[j][2] <= alo:
                j += 1
            k = j
            while k < len(receivers) and receivers[k][1] < ahi:
                dst, blo, bhi = receivers[k]
                lo, hi = max(alo, blo), min(ahi, bhi)
                if lo < hi:
                    out.append(Route(src, dst, lo, hi))
                k += 1
        return out

    def group_specs(self) -> list[GroupSpec]:
        """Every group the plan needs: one DP group per stage, one link per route pair."""
        specs = [GroupSpec(dp_group_name(s.stage), s.ranks, collectives=True) for s in self.stages]
        for stage in range(self.pp - 1):
            period = math.lcm(self.stages[stage].period, self.stages[stage + 1].period)
            phases = range(min(period, self.num_micro_batches))  # later phases are unused
            pairs = {(r.src, r.dst) for mb in phases for r in self.routes(stage, mb)}
            specs += [
                GroupSpec(link_group_name(src, dst), (src, dst)) for src, dst in sorted(pairs)
            ]
        return specs

    def device_group_specs(self) -> list[GroupSpec]:
        """The device plane's groups (training traffic): one per stage for data
        parallelism, and per stage boundary one for activations (forward) and one for
        their gradients (backward), each over both stages' ranks. On a communicator a
        rank then only sends or only receives, so a receive waiting on one never holds
        up a send on the other (under NCCL a communicator runs its operations one after
        the other).
        A boundary's groups connect every rank of one stage with every rank of the
        other when built, in the direction of their traffic: a route may join any two."""
        specs = [GroupSpec(dp_group_name(s.stage), s.ranks, collectives=True) for s in self.stages]
        for stage in range(self.pp - 1):
            up, down = self.stages[stage].ranks, self.stages[stage + 1].ranks
            ahead = tuple((a, b) for a in up for b in down)  # any route may join any two
            for back in (False, True):
                pairs = tuple((b, a) for a, b in ahead) if back else ahead
                specs.append(GroupSpec(pipe_group_name(stage, back), up + down, p2p=pairs))
        return specs


def taken_back(plan: Plan, generation: int) -> Plan:
    """``plan``'s layout as generation ``generation``: what a change rolls every member
    back to when the plan after ``plan`` was torn (a participant failed while it was
    applied). Generations only grow, so the layout taken back gets the torn plan's."""
    return dataclasses.replace(plan, generation=generation)


def plan_key(generation: int) -> str:
    """The store key under which the Core publishes generation ``generation``'s plan for
    workers that join (they have not seen the changes that led to it)."""
    return f"plan/g{generation}"


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """A plan as plain data (JSON, msgpack); :func:`plan_from_dict` inverts it."""
    doc = dataclasses.asdict(plan)
    if plan.schedule is Schedule.ONE_F_ONE_B:  # the documents of plans before schedules
        del doc["schedule"]
    else:
        doc["schedule"] = str(plan.schedule)
    if plan.grain == 1:  # and before grains
        del doc["grain"]
    return doc


def plan_from_dict(doc: Mapping[str, Any]) -> Plan:
    """The plan ``doc`` describes; ValueError naming what is malformed."""
    try:
        stages = tuple(
            StagePlan(
                stage=int(s["stage"]),
                layer_start=int(s["layer_start"]),
                layer_stop=int(s["layer_stop"]),
                ranks=tuple(int(r) for r in s["ranks"]),
                sizes=tuple(int(n) for n in s["sizes"]),
                mhz=None if s.get("mhz") is None else float(s["mhz"]),
                rotate=_flag(s.get("rotate", False), "rotate"),
                block=_whole(s.get("block", 1), "block", "micro-batches"),
            )
            for s in doc["stages"]
        )
        return Plan(
            generation=int(doc["generation"]),
            global_batch=int(doc["global_batch"]),
            num_micro_batches=int(doc["num_micro_batches"]),
            stages=stages,
            schedule=parse_schedule(doc.get("schedule", Schedule.ONE_F_ONE_B)),
            grain=_whole(doc.get("grain", 1), "grain", "samples"),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed plan document: {exc!r}") from None


def parse_schedule(value: Any) -> Schedule:
    """The schedule a document names; ValueError naming it and the known ones."""
    try:
        return Schedule(value)
    except ValueError:
        known = ", ".join(x.value for x in Schedule)
        raise ValueError(f"schedule {value!r} (known: {known})") from None


def _whole(value: Any, name: str, unit: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} = {value!r}: must be a whole number of {unit}, at least 1")
    return value


def _flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} = {value!r}: must be true or false")
    return value


def snapshot_placement(plan: Plan, ranks_per_node: int, copies: int = 1) -> SnapshotPlacement:
    """Where every rank's optimizer-shard snapshot (``copies`` of it) lives: in another
    stage, on another node (:func:`~elaswave.fabric.placement.place_snapshots_across`)."""
    return place_snapshots_across([s.ranks for s in plan.stages], ranks_per_node, copies)


def snapshot_group_specs(plan: Plan, ranks_per_node: int, copies: int = 1) -> list[GroupSpec]:
    """One owner -> holder link per copy of each optimizer shard."""
    return [
        GroupSpec(snapshot_link_name(owner, holder), (owner, holder))
        for owner, holder in snapshot_placement(plan, ranks_per_node, copies).links()
    ]


def dp_group_name(stage: int) -> str:
    return f"dp.s{stage}"


WORLD_GROUP = "dp.all"
"""Every rank of the plan, in rank order: what the step's global gradient norm is summed
over (gradient clipping). A ring over pooled links under gloo, as the DP groups are."""


TIED_GROUP = "dp.tied"
"""Every rank that holds a copy of a tied weight: the first and the last stage's ranks
(:mod:`elaswave.fabric.tied`). A ring over pooled links under gloo."""


def tied_group_spec(plan: Plan) -> GroupSpec:
    """The plan's tied-weight group (:data:`TIED_GROUP`)."""
    ranks = set(plan.stages[0].ranks) | set(plan.stages[-1].ranks)
    return GroupSpec(TIED_GROUP, tuple(sorted(ranks)), collectives=True)


def world_group_spec(plan: Plan) -> GroupSpec:
    """The plan's world group (:data:`WORLD_GROUP`)."""
    return GroupSpec(WORLD_GROUP, tuple(sorted(plan.ranks)), collectives=True)


def pipe_group_name(stage: int, backward: bool) -> str:
    """The device group between stage ``stage`` and the next: activations travel
    forward on ``fwd.s{stage}``, their gradients back on ``bwd.s{stage}``."""
    return f"{'bwd' if backward else 'fwd'}.s{stage}"


def link_group_name(src: int, dst: int) -> str:
    return f"link.{src}-{dst}"


def even_partition(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Contiguous layer counts per stage, differing by at most one, larger first."""
    if num_stages > num_layers:
        raise ValueError(
            f"pp = {num_stages} stages but the model has only {num_layers} layers "
            f"(embedding + blocks + head); use pp <= {num_layers}"
        )
    return even_split(num_layers, num_stages)


def initial_plan(
    *,
    num_layers: int,
    dp: int,
    pp: int,
    global_batch: int,
    micro_batch: int,
    layer_counts: Sequence[int] | None = None,
    schedule: Schedule = Schedule.ONE_F_ONE_B,
    grain: int = 1,
) -> Plan:
    """The static plan: ranks stage-major (rank = stage*dp + replica), even micro-batches,
    every stage running ``schedule``, shares in blocks of ``grain`` samples from then on
    (:attr:`Plan.grain`)."""
    if dp < 1 or pp < 1:
        raise ValueError(f"dp = {dp}, pp = {pp}: both must be at least 1")
    if micro_batch < 1:
        raise ValueError(f"micro batch = {micro_batch}: must be at least 1")
    if grain < 1 or micro_batch % grain:
        raise ValueError(f"grain = {grain}: must divide the micro batch {micro_batch}")
    if global_batch % (dp * micro_batch):
        raise ValueError(
            f"global batch {global_batch} does not divide into micro-batches of {micro_batch} "
            f"on {dp} DP replicas (needs a multiple of dp x micro batch = {dp * micro_batch})"
        )
    counts = tuple(layer_counts) if layer_counts is not None else even_partition(num_layers, pp)
    if len(counts) != pp or sum(counts) != num_layers or min(counts) < 1:
        raise ValueError(
            f"layer counts {counts} must be {pp} positive counts summing to {num_layers}"
        )
    stages, start = [], 0
    for stage, count in enumerate(counts):
        ranks = tuple(stage * dp + replica for replica in range(dp))
        stages.append(StagePlan(stage, start, start + count, ranks, (micro_batch,) * dp))
        start += count
    return Plan(
        generation=0,
        global_batch=global_batch,
        num_micro_batches=global_batch // (dp * micro_batch),
        stages=tuple(stages),
        schedule=schedule,
        grain=grain,
    )


def plan_summary(plan: Plan) -> dict[str, Any]:
    """A plan as summary.json records it: its micro-batches per step, its pipeline
    schedule and, per stage, its layers, ranks, micro-batch shares (whether they
    rotate, and in blocks of how many micro-batches) and clock."""
    return {
        "generation": plan.generation,
        "num_micro_batches": plan.num_micro_batches,
        "schedule": plan.schedule.value,
        "stages": [
            {
                "layers": [s.layer_start, s.layer_stop],
                "ranks": list(s.ranks),
                "sizes": list(s.sizes),
                "rotate": s.rotate,
                "block": s.block,
                "mhz": s.mhz,
            }
            for s in plan.stages
        ],
    }
