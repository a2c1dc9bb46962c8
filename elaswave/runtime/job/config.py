"""The job: everything a worker needs to join a run, as frozen dataclasses.

The launcher validates a :class:`JobConfig` once, writes it to RUN_DIR/job.json, and
every worker loads the same file, so all ranks agree on the model, data and layout, and
on the layer costs the planners price (the formulas, or a measured profile).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elaswave import rundir
from elaswave.bus.keys import BusKeys, check_bind, load_keys
from elaswave.bus.reliable import BusFaults
from elaswave.comm.spec import parse_device
from elaswave.data.corpus import DataConfig
from elaswave.engine.cost import DeviceSpec, LayerCost, LayerKind, layer_costs
from elaswave.engine.cost import device as cost_device
from elaswave.engine.migration import MIGRATION_MODES
from elaswave.engine.plan import Plan, initial_plan
from elaswave.engine.rebalance import POLICIES, balanced_counts
from elaswave.fabric.adamw import OptimizerConfig
from elaswave.fabric.remap import FP32_BYTES
from elaswave.model.config import ModelConfig
from elaswave.model.rng import RNG_KINDS
from elaswave.model.tensor_parallel import TpShard, check_divisible, refuse_tp
from elaswave.runtime.job.faults import validate_faults

EMULATED_DEVICE = "emulated"
"""The cost model's device preset that ``--device emulated`` keeps the time of."""

PARTITIONS = ("even", "balanced")
MAX_WAIT_FOR_NODES_S = 86400
"""The longest wait for joining ranks a job may ask for (a day)."""


PRECISIONS = ("fp32", "bf16")
"""Compute precisions (:attr:`TrainConfig.precision`)."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Layout and schedule of a training run."""

    dp: int = 2
    """Data-parallel replicas per pipeline stage."""
    pp: int = 2
    """Pipeline stages."""
    tp: int = 1
    """Tensor-parallel members of every (stage, replica): ranks are numbered as Megatron
    does, tp fastest, then dp, then pp. The TP group is the unit the plan places and
    the Core recovers: losing any member takes its (stage, replica) out."""
    steps: int = 20
    """Optimizer steps to train."""
    global_batch: int = 16
    """Samples per step, summed over replicas and micro-batches."""
    micro_batch: int = 2
    """Samples per micro-batch on each replica."""
    seed: int = 0
    """Seed of parameter initialisation and dropout streams."""
    device: str = "cpu"
    """cpu (gloo), cuda (nccl), npu (hccl via torch_npu), or emulated (gloo on CPU,
    keeping the time of the cost model's emulated accelerator)."""
    world_size: int | None = None
    """Processes to start; must equal dp x pp x tp when given."""
    comm_timeout_s: float = 60.0
    """Bound on any single collective or point-to-point wait."""
    trace_steps: int = 2
    """Record the per-stage 1F1B action trace of the first N steps."""
    ranks_per_node: int = 1
    """Consecutive ranks that share a node (a snapshot is kept on a different node)."""
    snapshots: bool = True
    """Keep per-step host snapshots of every optimizer shard on another rank."""
    verify_snapshots: bool = False
    """Record per-step digests of every shard and snapshot in the worker results."""
    faults: tuple[str, ...] = ()
    """Injected faults: kill:RANK@STEP[:PHASE], kill-node:NODE@STEP[:PHASE]."""
    rng: str = "counter"
    """Dropout randomness: counter (keyed by sample and layer, layout-independent) or
    stateful (one generator per rank in execution order: the baseline)."""
    heartbeat_interval_s: float = 0.2
    """Seconds between a worker's heartbeats."""
    heartbeat_timeout_s: float = 3.0
    """A worker silent this long is declared hung and fenced (SIGKILL), then recovered."""
    checkpoint_every: int = 0
    """Write a disk checkpoint every K steps, in the background (0: never)."""
    resume_dir: str | None = None
    """Run directory whose latest complete checkpoint this run starts from."""
    resume_step: int | None = None
    """The checkpoint's step; training continues at the next one."""
    recovery: bool = True
    """Recover from worker failures inside the step; False stops the job instead."""
    rebalance: str = "resize"
    """How a change (failure, straggler) is answered: none, resize (micro-batch resizing
    only), migrate (+ layer migration), or migrate+dvfs (+ frequency scaling)."""
    migration: str = "nonblocking"
    """How migrating layers' parameters move: nonblocking (streamed during the next step
    while the source runs a shadow of the layer for its early micro-batches) or blocking
    (in place before the job resumes)."""
    migration_early: int | None = None
    """Micro-batches of a non-blocking migration's transition step that keep the old
    layer placement (shadows on the sources). None: planned from the cost model, 0 when
    the parameter streams arrive before the targets need them."""
    straggler_detection: bool | None = None
    """Watch for fail-slow ranks. None: on for emulated and accelerator devices, off for
    cpu, where measured compute time reflects how the OS shares the host's cores among
    the workers, not the speed of a device."""
    straggler_window: int = 5
    """Steps over which the fail-slow detector takes each rank's median slowness."""
    straggler_threshold: float = 1.25
    """A rank slower than this factor times its peers' median is slow in a step."""
    straggler_min_steps: int = 2
    """Consecutive slow (or normal again) evaluations before a rank is flagged (cleared)."""
    partition: str = "even"
    """Initial layers per stage: even (equal counts) or balanced (the graph planner's
    minimax partition under the cost model)."""
    bus_host: str = "127.0.0.1"
    """IP address the Core's bus binds on. Beyond loopback it needs ``bus_keys``."""
    bus_keys: str | None = None
    """Directory of the job's CURVE keys (``elaswave keys DIR``): the bus then encrypts
    and admits only processes holding them."""
    bus_faults: str = ""
    """Faults every process injects into the bus messages it receives, for testing
    delivery: ``drop=P,dup=P,reorder=P,delay=SECONDS,seed=N`` (see
    :class:`~elaswave.bus.reliable.BusFaults`); empty: none."""
    precision: str = "fp32"
    """``fp32``, or ``bf16``: compute in bfloat16 (autocast) with fp32 parameters,
    gradients (reduced in fp32), ZeRO master shards, Adam state and snapshots; activations
    cross stages in bfloat16 (``--precision``)."""
    nnodes: int = 1
    """Hosts of the job, one agent each (``--nnodes``); ``ranks_per_node`` workers per
    host (``--nproc-per-node``). More than one needs ``rdzv_endpoint``."""
    rdzv_endpoint: str = ""
    """``HOST:PORT`` where node 0 serves the store the other hosts' agents meet at
    (``--rdzv-endpoint``); HOST is node 0's address, which the bus binds on too."""
    script: tuple[str, ...] = ()
    """``elaswave run``: the user's script and its arguments, run in every worker in
    place of the built-in loop (:mod:`elaswave.embedded`). Empty: ``elaswave train``."""
    worker_prefix: str = ""
    """Words run in front of every worker's command, ``{rank}`` replaced by its rank: a
    network namespace per host (``ip netns exec host{rank}``), a NUMA binding. Empty:
    none."""
    plan_ack_timeout_s: float = 5.0
    """Seconds the Core waits for every participant to acknowledge a recovery plan;
    one that does not is fenced and the plan superseded."""
    core_restarts: int = 3
    """Times the job host starts the Core again after it is lost (0: a lost Core stops
    the job, which can be resumed from its latest checkpoint)."""
    core_restart_delay_s: float = 0.0
    """Seconds the job host waits before starting a lost Core again (a back-off)."""
    core_outage_s: float = 10.0
    """Seconds workers train on without hearing from the Core; after that they all stop
    at the same step boundary and wait for it, keeping their state."""
    wait_for_nodes_s: float = 0.0
    """When too few ranks are left to fill every pipeline stage (no state lost), seconds
    the job waits for joining ranks, its state in memory, before it stops (0: at once)."""

    def worker_command(self, rank: int) -> list[str]:
        """``worker_prefix`` for ``rank``, split into words."""
        if not isinstance(self.worker_prefix, str):
            raise ValueError(f"worker_prefix = {self.worker_prefix!r}: must be a string")
        try:
            return shlex.split(self.worker_prefix.replace("{rank}", str(rank)))
        except ValueError as exc:
            raise ValueError(f"worker_prefix = {self.worker_prefix!r}: {exc}") from None

    def bus_fault_spec(self) -> BusFaults | None:
        """The injected bus faults, None when there are none."""
        faults = BusFaults.parse(self.bus_faults)
        return faults if faults.active else None

    def keys(self) -> BusKeys | None:
        """The job's bus keys, read from ``bus_keys`` (None without). Read where the bus
        is used, not on validation: a run directory stays readable (replay, reports) on
        a host that does not hold its keys."""
        return None if self.bus_keys is None else load_keys(Path(self.bus_keys))

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "tp", "steps", "global_batch", "micro_batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} = {value!r}: must be a positive integer")
        parse_device(self.device)
        if self.world_size is not None and self.world_size != self.num_ranks:
            raise ValueError(
                f"world size {self.world_size} != dp x pp x tp = {self.dp} x {self.pp} x "
                f"{self.tp} = {self.num_ranks}; set --world-size {self.num_ranks} or change "
                "--dp/--pp/--tp"
            )
        check_bind(self.bus_host, keyed=self.bus_keys is not None)
        BusFaults.parse(self.bus_faults)
        self.worker_command(0)  # refuses a prefix that does not parse
        if self.precision not in PRECISIONS:
            raise ValueError(
                f"precision = {self.precision!r}: valid values are {', '.join(PRECISIONS)}"
            )
        if not isinstance(self.nnodes, int) or isinstance(self.nnodes, bool) or self.nnodes < 1:
            raise ValueError(f"nnodes = {self.nnodes!r}: must be a positive integer")
        if self.nnodes > 1:
            if not self.rdzv_endpoint:
                raise ValueError(
                    f"nnodes = {self.nnodes} needs --rdzv-endpoint HOST:PORT (node 0's address)"
                )
            if self.nnodes * self.ranks_per_node != self.num_ranks:
                raise ValueError(
                    f"nnodes x nproc-per-node = {self.nnodes} x {self.ranks_per_node} = "
                    f"{self.nnodes * self.ranks_per_node} workers, but dp x pp x tp = "
                    f"{self.dp} x {self.pp} x {self.tp} = {self.num_ranks}"
                )
        ack = self.plan_ack_timeout_s
        if isinstance(ack, bool) or not isinstance(ack, int | float) or not 0 < ack <= 600:
            raise ValueError(
                f"plan_ack_timeout_s = {self.plan_ack_timeout_s!r}: must be 0 to 600 seconds"
            )
        restarts = self.core_restarts
        if isinstance(restarts, bool) or not isinstance(restarts, int) or not 0 <= restarts <= 100:
            raise ValueError(f"core_restarts = {restarts!r}: must be an integer from 0 to 100")
        delay = self.core_restart_delay_s
        if isinstance(delay, bool) or not isinstance(delay, int | float) or not 0 <= delay <= 600:
            raise ValueError(f"core_restart_delay_s = {delay!r}: must be 0 to 600 seconds")
        outage = self.core_outage_s
        if (
            isinstance(outage, bool)
            or not isinstance(outage, int | float)
            or not 0 < outage <= 3600
        ):
            raise ValueError(
                f"core_outage_s = {outage!r}: must be more than 0 and at most 3600 seconds"
            )
        if not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node = {self.ranks_per_node!r}: must be at least 1")
        self._check_tp()
        if self.rng not in RNG_KINDS:
            raise ValueError(f"rng = {self.rng!r}: valid values are {', '.join(RNG_KINDS)}")
        object.__setattr__(self, "faults", tuple(self.faults))
        object.__setattr__(self, "script", tuple(self.script))
        validate_faults(
            self.faults,
            world_size=self.num_ranks,
            ranks_per_node=self.ranks_per_node,
            steps=self.steps,
        )
        if not 0 < self.heartbeat_interval_s < self.heartbeat_timeout_s:
            raise ValueError(
                f"heartbeat interval {self.heartbeat_interval_s!r} s must be positive and below "
                f"the heartbeat timeout {self.heartbeat_timeout_s!r} s"
            )
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every = {self.checkpoint_every}: must be >= 0")
        if self.resume_step is not None and not -1 <= self.resume_step < self.steps - 1:
            raise ValueError(
                f"the checkpoint is at step {self.resume_step}, at or past the last step "
                f"{self.steps - 1}: raise --steps to train further"
            )
        if self.straggler_window < 1 or self.straggler_min_steps < 1:
            raise ValueError(
                f"straggler_window = {self.straggler_window}, straggler_min_steps = "
                f"{self.straggler_min_steps}: both must be at least 1"
            )
        if not self.straggler_threshold > 1.0:
            raise ValueError(f"straggler_threshold = {self.straggler_threshold!r}: must be above 1")
        if self.rebalance not in POLICIES:
            raise ValueError(
                f"rebalance = {self.rebalance!r}: valid policies are {', '.join(POLICIES)}"
            )
        if self.migration not in MIGRATION_MODES:
            raise ValueError(
                f"migration = {self.migration!r}: valid modes are {', '.join(MIGRATION_MODES)}"
            )
        if self.migration_early is not None and self.migration_early < 0:
            raise ValueError(f"migration_early = {self.migration_early}: must be at least 0")
        if self.partition not in PARTITIONS:
            raise ValueError(
                f"partition = {self.partition!r}: valid values are {', '.join(PARTITIONS)}"
            )
        if not self.comm_timeout_s > 0:
            raise ValueError(f"comm_timeout_s = {self.comm_timeout_s!r}: must be positive")
        if not 0 <= self.wait_for_nodes_s <= MAX_WAIT_FOR_NODES_S:
            raise ValueError(
                f"wait_for_nodes_s = {self.wait_for_nodes_s!r}: must be from 0 to "
                f"{MAX_WAIT_FOR_NODES_S} seconds (0: stop at once when a stage cannot be filled)"
            )

    def _check_tp(self) -> None:
        """What tensor parallelism does not combine with (yet), named."""
        rpn, tp = self.ranks_per_node, self.tp
        if tp == 1:
            return
        if rpn % tp and tp % rpn:
            raise ValueError(
                f"tp = {tp} with {rpn} ranks per node: a TP group must fill whole nodes or "
                f"fit in one (ranks per node a multiple or a divisor of {tp})"
            )
        unsupported = {
            "--nnodes > 1": self.nnodes > 1,
            "--checkpoint-every": self.checkpoint_every > 0,
            "--resume": self.resume_dir is not None,
            "--wait-for-nodes": self.wait_for_nodes_s > 0,
        }
        for flag, used in unsupported.items():
            if used:
                raise ValueError(
                    f"tp = {tp} does not combine with {flag} in this version: use --tp 1, "
                    f"or leave {flag.split()[0]} out"
                )

    @property
    def units(self) -> int:
        """(stage, replica) places at the start: TP groups, the plan's ranks."""
        return self.dp * self.pp

    @property
    def units_per_node(self) -> int:
        """TP groups per node (1 when a group spans nodes): what the plan's snapshot
        placement counts in."""
        return max(1, self.ranks_per_node // self.tp)

    def physical(self, unit: int, member: int = 0) -> int:
        """The process rank of TP member ``member`` of plan rank ``unit``."""
        return unit * self.tp + member

    def unit_of(self, rank: int) -> tuple[int, int]:
        """(plan rank, TP member) of process rank ``rank``."""
        return divmod(rank, self.tp)

    @property
    def shortens(self) -> bool:
        """Whether fewer ranks than stages continue on a shorter pipeline (no wait asked
        for) rather than waiting for joiners."""
        return self.wait_for_nodes_s == 0

    @property
    def first_step(self) -> int:
        return 0 if self.resume_step is None else self.resume_step + 1

    @property
    def detects_stragglers(self) -> bool:
        if self.straggler_detection is not None:
            return self.straggler_detection
        return self.device != "cpu"

    @property
    def num_ranks(self) -> int:
        """Worker processes at the start: dp x pp x tp."""
        return self.dp * self.pp * self.tp

    @property
    def local_processes(self) -> int:
        """Worker processes at the start on each host."""
        return self.num_ranks if self.nnodes == 1 else self.ranks_per_node


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    profile: tuple[LayerCost, ...] = ()
    """Measured layer costs (:mod:`elaswave.runtime.host.profile`), priced on
    :attr:`cost_device` at its base clock, one per layer in index order; empty: the cost
    model's formulas."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "profile", tuple(self.profile))
        self._check_profile()
        if self.train.tp > 1:
            m = self.model
            refuse_tp(TpShard(0, self.train.tp), m)
            check_divisible(
                num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, ffn=m.ffn_hidden_size,
                vocab=m.vocab_size, tp=self.train.tp,
            )  # fmt: skip
            if self.profile:
                raise ValueError(
                    f"tp = {self.train.tp} with a measured profile: profiling measures whole "
                    "layers; use --profile off with --tp"
                )
        self.plan()  # validates layout against the model and batch

    def _check_profile(self) -> None:
        if not self.profile:
            return
        formulas = layer_costs(self.model, tp=self.train.tp, dtype_bytes=FP32_BYTES)
        if len(self.profile) != len(formulas):
            raise ValueError(
                f"profile has {len(self.profile)} layers; the model has {len(formulas)}: "
                "profile this model again (--profile on)"
            )
        for position, (cost, formula) in enumerate(zip(self.profile, formulas, strict=True)):
            if not isinstance(cost, LayerCost):
                raise ValueError(f"profile[{position}] = {cost!r}: expected a LayerCost")
            if cost.index != position:
                raise ValueError(
                    f"profile[{position}].index = {cost.index!r}: must be {position} "
                    "(one entry per layer, in index order)"
                )
            if cost.kind != formula.kind:
                raise ValueError(
                    f"profile[{position}].kind = {str(cost.kind)!r}: layer {position} is "
                    f"the model's {formula.kind}"
                )
            if cost.params != formula.params:
                raise ValueError(
                    f"profile[{position}].params = {cost.params!r}: layer {position} has "
                    f"{formula.params} parameters"
                )
            for name in (
                "fwd_flops_per_sample",
                "bwd_flops_per_sample",
                "activation_bytes_per_sample",
                "output_bytes_per_sample",
            ):
                value = getattr(cost, name)
                ok = isinstance(value, int | float) and not isinstance(value, bool)
                if not (ok and math.isfinite(value) and value >= 0):
                    raise ValueError(
                        f"profile[{position}].{name} = {value!r}: must be a finite number >= 0"
                    )

    def plan(self) -> Plan:
        t = self.train
        counts = None
        if t.partition == "balanced" and t.pp > 1:
            counts = balanced_counts(
                self.layer_costs,
                dp=t.dp,
                pp=t.pp,
                micro_batch=t.micro_batch,
                device=self.cost_device,
            )
        return initial_plan(
            num_layers=self.model.num_layers,
            dp=t.dp,
            pp=t.pp,
            global_batch=t.global_batch,
            micro_batch=t.micro_batch,
            layer_counts=counts,
        )

    @property
    def cost_device(self) -> DeviceSpec:
        """The device the cost model prices: the emulated one, whose relative layer costs
        also stand in for devices ElasWave has no model of (cpu)."""
        return cost_device(EMULATED_DEVICE)

    @property
    def power_budget(self) -> float:
        """What DVFS may draw, in plan ranks (TP groups) at the base clock: the launch
        size (dp x pp), so that survivors up-clock only with the power lost ranks freed."""
        return float(self.train.dp * self.train.pp)

    @property
    def layer_costs(self) -> list[LayerCost]:
        """What the planners price: the measured :attr:`profile` when there is one, else
        the cost model's formulas at the training precision (activations and what
        crosses stages in bf16 or fp32)."""
        if self.profile:
            return list(self.profile)
        return layer_costs(
            self.model,
            tp=self.train.tp,
            dtype_bytes=2 if self.train.precision == "bf16" else FP32_BYTES,
        )

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["profile"] = [{**c, "kind": str(c["kind"])} for c in out["profile"]]
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> JobConfig:
        return cls(
            model=ModelConfig(**raw.get("model", {})),
            data=DataConfig(**raw.get("data", {})),
            optim=OptimizerConfig(**raw.get("optim", {})),
            train=TrainConfig(**raw.get("train", {})),
            profile=_profile_from(raw.get("profile", [])),
        )


def _profile_from(raw: Any) -> tuple[LayerCost, ...]:
    """job.json's ``profile`` list as LayerCosts; ValueError naming a malformed entry."""
    if not isinstance(raw, list | tuple):
        raise ValueError(f"profile = {raw!r}: expected a list of layer costs")
    names = [f.name for f in dataclasses.fields(LayerCost)]
    out = []
    for position, entry in enumerate(raw):
        if not isinstance(entry, dict) or sorted(entry) != sorted(names):
            raise ValueError(
                f"profile[{position}] = {entry!r}: expected an object with keys {', '.join(names)}"
            )
        try:
            kind = LayerKind(entry["kind"])
        except ValueError:
            valid = ", ".join(k.value for k in LayerKind)
            raise ValueError(
                f"profile[{position}].kind = {entry['kind']!r}: valid kinds are {valid}"
            ) from None
        out.append(LayerCost(**{**entry, "kind": kind}))
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class Endpoints:
    """Where a worker finds the Core: the store and the bus broker."""

    store_host: str
    store_port: int
    bus_publish: str
    bus_subscribe: str
    bus_fetch: str = ""
    """The Core's log service, where a worker fetches bus messages it missed."""


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """What RUN_DIR/job.json holds."""

    run_id: str
    config: JobConfig
    endpoints: Endpoints

    def write(self, run_dir: Path, name: str = rundir.JOB) -> None:
        """Write it whole or not at all: readers poll for the file."""
        doc = {
            "run_id": self.run_id,
            "config": self.config.to_dict(),
            "endpoints": dataclasses.asdict(self.endpoints),
        }
        tmp = run_dir / f".{name}.tmp"
        tmp.write_text(json.dumps(doc, indent=2))
        os.replace(tmp, run_dir / name)

    @classmethod
    def read(cls, run_dir: Path, name: str = rundir.JOB) -> JobSpec:
        doc = json.loads((run_dir / name).read_text())
        return cls(
            run_id=doc["run_id"],
            config=JobConfig.from_dict(doc["config"]),
            endpoints=Endpoints(**doc["endpoints"]),
        )
