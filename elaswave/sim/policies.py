"""What each elastic policy makes of a failure, in plans and throughput (pure).

A simulated job is TP x PP x DP on nodes of ``devices_per_node`` devices. A plan rank is
one tensor-parallel group of ``tp`` devices; ranks are numbered stage-major like the
runtime's (``rank = stage * dp + replica``) and devices fill nodes in rank order, so a
node holds whole TP groups of one stage (TP innermost, then DP, then PP, as Megatron
lays them out).

* **ElasWave** (ablations ``resize``, ``migrate``, ``migrate+dvfs``): the runtime's own
  planner (:func:`elaswave.engine.recovery.next_plan`) keeps the global batch, resizes
  micro-batches over the survivors, and repartitions layers and clocks.
* **TorchFT**: a replica with a failed device leaves whole; the survivors continue with
  fewer replicas and a smaller global batch.

When the failed ranks are whole replicas, resizing has nothing to gain over letting
them go, and ElasWave answers as TorchFT does; so it does when a failure takes a stage's
last rank and the pipeline cannot be kept.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from functools import cached_property

from elaswave.engine.cost import DeviceSpec, LayerCost, layer_costs
from elaswave.engine.plan import Plan, initial_plan
from elaswave.engine.rebalance import Policy as Rebalance
from elaswave.engine.recovery import Rebalancing, next_plan
from elaswave.fabric.errors import Unrecoverable
from elaswave.model.config import ModelConfig
from elaswave.sim.pipeline import plan_step_time


class SimPolicy(enum.StrEnum):
    ELASWAVE = "elaswave"
    """Micro-batch resizing, layer migration and DVFS."""
    ELASWAVE_MIGRATE = "elaswave-migrate"
    ELASWAVE_RESIZE = "elaswave-resize"
    TORCHFT = "torchft"


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

    def __post_init__(self) -> None:
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

    @cached_property
    def layers(self) -> list[LayerCost]:
        return layer_costs(self.model, tp=self.tp, dtype_bytes=2)

    def plan(self) -> Plan:
        return initial_plan(
            num_layers=self.model.num_layers,
            dp=self.dp,
            pp=self.pp,
            global_batch=self.global_batch,
            micro_batch=self.micro_batch,
        )

    def ranks_of_node(self, node: int) -> list[int]:
        """The plan ranks (TP groups) whose devices sit on ``node``."""
        per = self.devices_per_node // self.tp
        return [r for r in range(node * per, (node + 1) * per) if r < self.pp * self.dp]


@dataclass(frozen=True)
class Outcome:
    policy: SimPolicy
    plan: Plan
    step_s: float
    reason: str

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
    if len({s.dp for s in plan.stages}) != 1:
        return False
    lost = {s.ranks.index(r) for s in plan.stages for r in failed if r in s.ranks}
    return bool(failed) and failed == {s.ranks[i] for s in plan.stages for i in lost}


def answer(policy: SimPolicy, job: SimJob, plan: Plan, failed: Collection[int]) -> Outcome:
    """The plan ``policy`` runs after ``failed`` ranks leave ``plan``, and its step time."""
    failed = set(failed)
    if policy is SimPolicy.TORCHFT:
        new, reason = _drop_replicas(plan, failed)
    elif _whole_replicas(plan, failed):
        new, why = _drop_replicas(plan, failed)
        reason = f"the failed ranks are whole replicas: {why}"
    else:
        rebalancing = Rebalancing(policy=REBALANCE[policy], layers=job.layers, device=job.device)
        try:
            new, reason = next_plan(plan, failed, rebalancing)
        except Unrecoverable as exc:
            new, why = _drop_replicas(plan, failed)
            reason = f"{exc}; falls back to dropping replicas: {why}"
    step = plan_step_time(new, job.layers, job.device).step_s
    return Outcome(policy, new, step, reason)


def baseline(job: SimJob) -> Outcome:
    """The job before any change."""
    plan = job.plan()
    return Outcome(
        SimPolicy.ELASWAVE, plan, plan_step_time(plan, job.layers, job.device).step_s, ""
    )
