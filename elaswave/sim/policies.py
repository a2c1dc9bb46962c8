"""What each elastic policy makes of a failure, in plans and throughput (pure).

A simulated job is TP x PP x DP on nodes of ``devices_per_node`` devices. A plan rank is
one tensor-parallel group of ``tp`` devices, numbered stage-major like the runtime's
(``rank = stage * dp + replica``). How TP groups fill nodes is the job's
:class:`Layout`: ``stage-major`` (TP innermost, then DP, then PP, Megatron's default
order: a node holds TP groups of one stage in consecutive replicas) or
``replica-major`` (TP, then PP, then DP: consecutive nodes hold one replica's stages,
so losing ``k`` consecutive nodes of a replica's span loses whole replicas).

* **ElasWave** (ablations ``resize``, ``migrate``, ``migrate+dvfs``): the runtime's own
  planner (:func:`elaswave.engine.recovery.next_plan`) keeps the global batch, resizes
  micro-batches over the survivors, and repartitions layers and clocks.
* **ReCycle**: the failed ranks' micro-batches are re-routed to same-stage peers of the
  other replicas (:mod:`elaswave.sim.recycle`); the global batch is kept.
* **TorchFT**: a replica with a failed device leaves whole; the survivors continue with
  fewer replicas and a smaller global batch.
* **Restart** (checkpoint-restart, TorchElastic-style): every process stops and the job
  restarts on the surviving devices with as many whole replicas as they hold, keeping
  the global batch (more micro-batches per replica); the timeline charges the restart,
  the checkpoint load and the steps redone since the last checkpoint.

When the failed ranks are whole replicas, resizing or re-routing has nothing to gain over
letting them go, and ElasWave and ReCycle answer as TorchFT does. When a failure takes a
stage's last rank, ElasWave's ranks change stage (:func:`elaswave.engine.reshape.
reshape`: survivors of wider stages move to it, or the pipeline gets fewer stages);
ReCycle re-routes within a stage only, so it falls back to dropping replicas. A policy
that cannot go on raises Unrecoverable, and the timeline waits for nodes.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

from elaswave.engine.cost import DeviceSpec, LayerCost, StageSpec, layer_costs
from elaswave.engine.graph import plan_layers
from elaswave.engine.plan import Plan, initial_plan
from elaswave.engine.rebalance import Policy as Rebalance
from elaswave.engine.recovery import Rebalancing, next_plan, with_schedule
from elaswave.engine.reshape import reformed, reshape
from elaswave.engine.schedule import Schedule
from elaswave.engine.steptime import plan_step_time
from elaswave.fabric.errors import Unrecoverable
from elaswave.model.config import ModelConfig
from elaswave.sim.recycle import OutOfMemory, recycle_step


class SimPolicy(enum.StrEnum):
    ELASWAVE = "elaswave"
    """Micro-batch resizing, layer migration and DVFS."""
    ELASWAVE_MIGRATE = "elaswave-migrate"
    ELASWAVE_RESIZE = "elaswave-resize"
    RECYCLE = "recycle"
    TORCHFT = "torchft"
    RESTART = "restart"

    @property
    def is_elaswave(self) -> bool:
        return self in REBALANCE


class Layout(enum.StrEnum):
    """Order in which a job's TP groups fill nodes."""

    STAGE_MAJOR = "stage-major"
    """TP, DP, PP (Megatron's default): a node holds one stage's replicas."""
    REPLICA_MAJOR = "replica-major"
    """TP, PP, DP: consecutive nodes hold one replica's stages."""


REBALANCE = {
    SimPolicy.ELASWAVE: Rebalance.MIGRATE_DVFS,
    SimPolicy.ELASWAVE_MIGRATE: Rebalance.MIGRATE,
    SimPolicy.ELASWAVE_RESIZE: Rebalance.RESIZE,
}


@dataclass(frozen=True)
class SimJob:
    model: ModelConfig
    device: DeviceSpec
    tp: int
    pp: int
    dp: int
    micro_batch: int
    global_batch: int
    devices_per_node: int = 8
    layout: Layout = Layout.STAGE_MAJOR
    profile: tuple[LayerCost, ...] = ()
    """Measured layer costs priced on ``device`` (``elaswave sim --profile``), one per
    layer of ``model``, in place of the FLOP formulas; empty: the formulas."""
    schedules: tuple[Schedule, ...] = ()
    """The pipeline schedules ElasWave's planner chooses from, for its initial plan and
    at each change (its ``--schedule auto``: every schedule; one: that schedule, as
    ``--schedule zb-h1``); empty: its plans keep 1F1B, as the others'."""

    def __post_init__(self) -> None:
        if self.profile and len(self.profile) != self.model.num_layers:
            raise ValueError(
                f"the profile has {len(self.profile)} layers, the simulated model "
                f"{self.model.num_layers}: simulate the model that was profiled"
            )
        for name in ("tp", "pp", "dp", "micro_batch", "devices_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)}: must be at least 1")
        if self.devices_per_node % self.tp:
            raise ValueError(
                f"tp = {self.tp} does not divide {self.devices_per_node} devices per node: a "
                "tensor-parallel group must sit on one node"
            )
        if self.global_batch % (self.micro_batch * self.dp):
            raise ValueError(
                f"global batch {self.global_batch} is not a multiple of micro batch x dp = "
                f"{self.micro_batch * self.dp}"
            )

    @property
    def num_devices(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def num_nodes(self) -> int:
        return -(-self.num_devices // self.devices_per_node)

    @property
    def samples(self) -> int:
        """Samples in one global micro-batch of the static job."""
        return self.micro_batch * self.dp

    @property
    def power_budget(self) -> float:
        """What DVFS may draw, in ranks at the base clock: the job's launch size."""
        return float(self.pp * self.dp)

    @cached_property
    def layers(self) -> list[LayerCost]:
        if self.profile:
            return list(self.profile)
        return layer_costs(self.model, tp=self.tp, dtype_bytes=2)

    def plan(self) -> Plan:
        """The static job (see :meth:`static_plan`)."""
        return self.static_plan(self.dp, self.global_batch)

    @functools.cache  # noqa: B019  (a frozen job: the cache lives as long as it does)
    def static_plan(self, dp: int, global_batch: int) -> Plan:
        """A static job of ``dp`` replicas: the graph planner's minimax partition of the
        layers (a tuned static pipeline, so that every policy starts balanced), even
        micro-batches of ``micro_batch`` samples."""
        m = global_batch // (self.micro_batch * dp)
        spec = StageSpec(
            dp=dp, micro_batch=self.micro_batch, mhz=self.device.base_mhz,
            memory_cap_bytes=self.device.memory_bytes,
        )  # fmt: skip
        counts = plan_layers(self.layers, [spec] * self.pp, self.device, num_micro_batches=m)
        return initial_plan(
            num_layers=self.model.num_layers,
            dp=dp,
            pp=self.pp,
            global_batch=global_batch,
            micro_batch=self.micro_batch,
            layer_counts=counts.counts,
        )

    def ranks_of_node(self, node: int) -> list[int]:
        """The plan ranks (TP groups) whose devices sit on ``node``."""
        per = self.devices_per_node // self.tp
        groups = [g for g in range(node * per, (node + 1) * per) if g < self.pp * self.dp]
        if self.layout is Layout.STAGE_MAJOR:
            return groups
        # Group g is replica g // pp, stage g % pp.
        return [(g % self.pp) * self.dp + g // self.pp for g in groups]


@dataclass(frozen=True)
class PolicyPlan:
    """What a policy runs after an event: its plan, step time and why."""

    policy: SimPolicy
    plan: Plan
    step_s: float
    reason: str
    rerouted: frozenset[int] = frozenset()
    """ReCycle: failed ranks of ``plan`` whose micro-batches peers run."""
    stage_moves: tuple[tuple[int, int | None, int], ...] = ()
    """ElasWave: (rank, stage before, stage after) of ranks that change stage."""
    move_bytes: float = 0.0
    """ElasWave: most bytes one rank receives for the layers of its new stage."""

    @property
    def samples_per_step(self) -> int:
        return self.plan.global_batch

    @property
    def throughput(self) -> float:
        """Samples per second."""
        return self.plan.global_batch / self.step_s


def keep_replicas(plan: Plan, keep: Sequence[int], *, generation: int) -> Plan:
    """``plan`` with only the replica indexes ``keep`` in every stage, each with its
    micro-batch share: the global batch shrinks with them."""
    stages = tuple(
        dataclasses.replace(
            s, ranks=tuple(s.ranks[i] for i in keep), sizes=tuple(s.sizes[i] for i in keep)
        )
        for s in plan.stages
    )
    batch = sum(stages[0].sizes) * plan.num_micro_batches
    return Plan(generation, batch, plan.num_micro_batches, stages)


def _drop_replicas(plan: Plan, failed: Collection[int]) -> tuple[Plan, str]:
    """TorchFT: every replica index with a failed rank in any stage leaves all stages."""
    if len({s.dp for s in plan.stages}) != 1:
        raise Unrecoverable(
            f"stages of widths {[s.dp for s in plan.stages]} hold no whole replicas to keep"
        )
    lost = {s.ranks.index(r) for s in plan.stages for r in failed if r in s.ranks}
    keep = [i for i in range(plan.stages[0].dp) if i not in lost]
    if not keep:
        raise Unrecoverable("every replica lost a rank: nothing is left to train")
    new = keep_replicas(plan, keep, generation=plan.generation + 1)
    reason = (
        f"replicas {sorted(lost)} leave; {len(keep)} continue with global batch {new.global_batch}"
    )
    return new, reason


def _whole_replicas(plan: Plan, failed: set[int]) -> bool:
    """Whether ``failed`` is exactly some replica indexes of every stage."""
    lost = _lost_replicas(plan, failed)
    return bool(failed) and failed == {s.ranks[i] for s in plan.stages for i in lost}


def answer(
    policy: SimPolicy,
    job: SimJob,
    plan: Plan,
    failed: Collection[int],
    *,
    rerouted: Collection[int] = (),
    alive: Collection[int] | None = None,
    shorten: bool = True,
) -> PolicyPlan:
    """The plan ``policy`` runs after ``failed`` ranks leave ``plan``, and its step time.

    ``rerouted``: ranks of ``plan`` that failed earlier and whose work ReCycle already
    re-routes. ``alive``: every rank checkpoint-restart may relaunch on, spares
    included (default: the ranks of ``plan`` that did not fail). Raises Unrecoverable
    when nothing is left to train, and :class:`~elaswave.sim.recycle.OutOfMemory` when
    ReCycle's peers run out of memory.

    ``shorten``: ElasWave (the full policy; its ablations keep their stages) also prices
    a pipeline of fewer, full stages when every stage keeps a rank
    (:func:`_shorter_pipeline`), for a change that lasts. The timeline
    passes False: under churn nodes return within minutes and a shortened pipeline moves
    its layers twice (a spot trace of 317 events: 0.896 of fault-free with it, 0.901
    without).
    """
    failed = set(failed)
    if policy is SimPolicy.RECYCLE:
        return _recycle(job, plan, failed | set(rerouted))
    if policy is SimPolicy.RESTART:
        new, reason = restart_plan(job, set(plan.ranks) - failed if alive is None else alive)
    elif policy is SimPolicy.TORCHFT:
        new, reason = _drop_replicas(plan, failed)
    elif _whole_replicas(plan, failed):
        new, why = _drop_replicas(plan, failed)
        reason = f"the failed ranks are whole replicas: {why}"
    else:
        rebalancing = Rebalancing(
            policy=REBALANCE[policy], layers=job.layers, device=job.device,
            power_budget=job.power_budget, schedules=job.schedules, stages=job.pp,
            samples=job.samples,
        )  # fmt: skip
        shorten = shorten and policy is SimPolicy.ELASWAVE  # the ablations keep their stages
        try:
            new, reason = next_plan(plan, failed, rebalancing)
        except Unrecoverable as exc:  # a stage lost every rank: ranks change stage
            shaped = reshape(
                plan, failed, rebalancing=rebalancing, max_stages=job.pp, samples=job.samples,
                shorter=shorten,
            )  # fmt: skip
            moved = ", ".join(f"{r}: {a} -> {b}" for r, a, b in shaped.moved)
            reason = f"{exc}; ranks change stage ({moved}): {shaped.reason}"
            new = with_schedule(shaped.plan, rebalancing)
            step = shaped.step_s
            if new.schedule is not shaped.plan.schedule:
                step = plan_step_time(new, job.layers, job.device).step_s
            return PolicyPlan(
                policy, new, step, reason,
                stage_moves=shaped.moved, move_bytes=shaped.move_bytes,
            )  # fmt: skip
        step = plan_step_time(new, job.layers, job.device).step_s
        shorter = _shorter_pipeline(plan, failed, rebalancing, new) if shorten else None
        if shorter is not None:
            return dataclasses.replace(shorter, policy=policy)
        return PolicyPlan(policy, new, step, reason)
    step = plan_step_time(new, job.layers, job.device).step_s
    return PolicyPlan(policy, new, step, reason)


def _shorter_pipeline(
    plan: Plan, failed: set[int], rebalancing: Rebalancing, kept: Plan
) -> PolicyPlan | None:
    """The engine's pipeline of fewer, full stages over the survivors
    (:func:`~elaswave.engine.reshape.reformed`), when it prices lower than ``kept``."""
    shaped = reformed(
        plan, failed, kept=kept, rebalancing=dataclasses.replace(rebalancing, reform=True)
    )
    if shaped is None:
        return None
    new = with_schedule(shaped.plan, rebalancing)
    assert rebalancing.device is not None
    step = plan_step_time(new, rebalancing.layers, rebalancing.device).step_s
    moved = ", ".join(f"{r}: {a} -> {b}" for r, a, b in shaped.moved)
    return PolicyPlan(
        SimPolicy.ELASWAVE, new, step,
        f"fewer, full stages run faster than keeping {plan.pp} ({moved}): {shaped.reason}",
        stage_moves=shaped.moved, move_bytes=shaped.move_bytes,
    )  # fmt: skip


def recycle_time(
    job: SimJob, plan: Plan, rerouted: Collection[int], slowdowns: Mapping[int, float] | None
) -> float:
    """ReCycle's step time on ``plan`` with ``rerouted`` ranks' work on their peers."""
    if not rerouted:
        return plan_step_time(plan, job.layers, job.device, slowdowns=slowdowns).step_s
    return recycle_step(
        plan, rerouted, model=job.model, layers=job.layers, device=job.device, tp=job.tp,
        slowdowns=slowdowns,
    ).step_s  # fmt: skip


def _recycle(job: SimJob, plan: Plan, failed: set[int]) -> PolicyPlan:
    whole = _lost_replicas(plan, failed)
    if whole and len(whole) == plan.stages[0].dp:
        raise Unrecoverable("every replica lost a rank: nothing is left to train")
    notes = []
    if whole:  # whole replicas leave as in TorchFT; ranks of the others are re-routed
        plan, why = _drop_replicas(plan, {s.ranks[i] for s in plan.stages for i in whole})
        failed &= set(plan.ranks)
        notes.append(f"whole replicas leave: {why}")
    if failed:
        try:
            out = recycle_step(
                plan, failed, model=job.model, layers=job.layers, device=job.device, tp=job.tp
            )
        except OutOfMemory:
            raise
        except Unrecoverable as exc:
            new, why = _drop_replicas(plan, failed)
            step = plan_step_time(new, job.layers, job.device).step_s
            return PolicyPlan(
                SimPolicy.RECYCLE, new, step, f"{exc}; falls back to dropping replicas: {why}"
            )
        notes.append(out.reason)
        return PolicyPlan(SimPolicy.RECYCLE, plan, out.step_s, "; ".join(notes), frozenset(failed))
    step = plan_step_time(plan, job.layers, job.device).step_s
    return PolicyPlan(SimPolicy.RECYCLE, plan, step, "; ".join(notes))


def _lost_replicas(plan: Plan, failed: set[int]) -> list[int]:
    """Replica indexes whose rank failed in every stage (equal-width stages only)."""
    if len({s.dp for s in plan.stages}) != 1:
        return []
    return [i for i in range(plan.stages[0].dp) if all(s.ranks[i] in failed for s in plan.stages)]


def restart_plan(job: SimJob, alive: Collection[int]) -> tuple[Plan, str]:
    """Checkpoint-restart: the job relaunches on the ``alive`` ranks with as many whole
    replicas as they make (spares idle) and the global batch kept, rounded down to a
    multiple of micro-batch x replicas when it does not divide."""
    alive = sorted(alive)
    dp = len(alive) // job.pp
    if dp < 1:
        raise Unrecoverable(
            f"{len(alive)} ranks survive, fewer than the {job.pp} pipeline stages: cannot restart"
        )
    unit = job.micro_batch * dp
    batch = max(unit, job.global_batch // unit * unit)
    fresh = job.static_plan(dp, batch)
    stages = tuple(
        dataclasses.replace(s, ranks=tuple(alive[s.stage * dp + i] for i in range(dp)))
        for s in fresh.stages
    )
    new = Plan(fresh.generation, batch, fresh.num_micro_batches, stages)
    spare = len(alive) - dp * job.pp
    return new, (
        f"restart on {len(alive)} ranks: {dp} replicas, global batch {batch} in "
        f"{new.num_micro_batches} micro-batches" + (f", {spare} ranks idle" if spare else "")
    )


def elaswave_start(job: SimJob) -> Plan:
    """The plan ElasWave starts ``job`` on: the static job under the schedule of
    ``job.schedules`` that simulates fastest within memory (the first one's when it is
    the only one), as the runtime's initial plan under ``--schedule``."""
    plan = job.plan()
    if not job.schedules:
        return plan
    first = dataclasses.replace(plan, schedule=job.schedules[0])
    choosing = Rebalancing(layers=job.layers, device=job.device, schedules=job.schedules)
    return with_schedule(first, choosing)


def baseline(job: SimJob) -> PolicyPlan:
    """The job before any change."""
    plan = job.plan()
    return PolicyPlan(
        SimPolicy.ELASWAVE, plan, plan_step_time(plan, job.layers, job.device).step_s, ""
    )
