"""The training settings of a job, in the sections a user looks for them in.

A job is a model, its data and its optimizer (each configured where it lives), and how
it trains, in seven sections grouped by the question a user asks:

* :class:`LayoutConfig`: where the ranks are: the parallel mesh (dp x pp x tp), the hosts
  and how their processes start, the device, how the layers are first cut into stages.
* :class:`ScheduleConfig`: what the ranks compute, the same on any layout: steps,
  batches, seed, precision, dropout randomness (and the user's script in its place).
* :class:`ElasticConfig`: how the job answers a change (a failure, a straggler, a
  joining rank): recover or stop, rebalance and migrate, watch for stragglers, wait.
* :class:`LivenessConfig`: how a lost or hung process is noticed and how long anyone
  waits for another: heartbeats, acknowledgements, collectives, the Core's restarts.
* :class:`StateConfig`: where the training state is kept besides the workers' memory:
  host snapshots, disk checkpoints, and the checkpoint this run resumes from.
* :class:`NetworkConfig`: the Core's bus: the address it binds on and its keys.
* :class:`InjectionConfig`: faults injected on purpose, to test recovery and delivery.

Each setting is a field written once, with its default, docstring, flag help
(:mod:`.setting`) and check (its section's ``__post_init__``); what depends on two
sections is checked by :class:`~elaswave.runtime.job.config.JobConfig`. A setting's name
is the same everywhere: the field, the TOML key (in its section's table, or flat in
``[train]`` as before sections existed), the key in RUN_DIR/job.json, and its flag.
"""

from __future__ import annotations

import dataclasses
import enum
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elaswave.bus.keys import BusKeys, check_bind, load_keys
from elaswave.bus.reliable import BusFaults
from elaswave.comm.spec import DEVICES, Device, parse_device
from elaswave.engine.migration import MIGRATION_MODES, MigrationMode
from elaswave.engine.rebalance import POLICIES, Policy
from elaswave.engine.schedule import ScheduleSetting
from elaswave.model.config import RNG_KINDS, RngKind
from elaswave.runtime.job.setting import (
    Alias,
    check,
    check_positive_int,
    choose,
    is_int,
    is_number,
    listed,
    setting,
)

MAX_WAIT_FOR_NODES_S = 86400
"""The longest wait for joining ranks a job may ask for (a day)."""
MAX_RESTARTS = 1_000_000
"""The most worker restarts a job may ask for (``--max-restarts``)."""


class Partition(enum.StrEnum):
    """How the layers are first cut into pipeline stages (``--partition``)."""

    EVEN = "even"
    """Equal layer counts."""
    BALANCED = "balanced"
    """The graph planner's minimax partition under the cost model."""


class Precision(enum.StrEnum):
    """The compute precision (``--precision``)."""

    FP32 = "fp32"
    BF16 = "bf16"
    """bfloat16 compute (autocast) with fp32 parameters, gradients and optimizer state."""


@dataclass(frozen=True, kw_only=True)
class LayoutConfig:
    """Where the ranks are: the parallel mesh, the hosts, the device, the first cut."""

    dp: int = setting(2, help="data-parallel replicas per stage")
    """Data-parallel replicas per pipeline stage."""
    pp: int = setting(2, help="pipeline stages")
    """Pipeline stages."""
    tp: int = setting(
        1,
        help="tensor-parallel members of every (stage, replica), one failure unit "
        "(the built-in model; ranks ordered tp fastest, then dp, then pp)",
    )
    """Tensor-parallel members of every (stage, replica): ranks are numbered as Megatron
    does, tp fastest, then dp, then pp. The TP group is the unit the plan places and
    the Core recovers: losing any member takes its (stage, replica) out."""
    world_size: int | None = setting(None, help="processes to start (must equal dp x pp x tp)")
    """Processes to start; must equal dp x pp x tp when given."""
    ranks_per_node: int = setting(
        1,
        help="consecutive ranks per node (default 1)",
        aliases=(
            Alias(
                flag="--nproc-per-node",
                help="workers per host of a multi-host job (torchrun's name for --ranks-per-node)",
            ),
        ),
    )
    """Consecutive ranks that share a node (a snapshot is kept on a different node)."""
    nnodes: int = setting(1, help="hosts of the job, one agent each (default 1)")
    """Hosts of the job, one agent each (``--nnodes``); ``ranks_per_node`` workers per
    host (``--nproc-per-node``). More than one needs ``rdzv_endpoint``."""
    rdzv_endpoint: str = setting(
        "",
        metavar="HOST:PORT",
        help="node 0's address and the port its store serves the other hosts on",
    )
    """``HOST:PORT`` where node 0 serves the store the other hosts' agents meet at
    (``--rdzv-endpoint``); HOST is node 0's address, which the bus binds on too."""
    device: Device = setting(Device.CPU, help=f"one of {', '.join(DEVICES)}")
    """cpu (gloo), cuda (nccl), npu (hccl via torch_npu), or emulated (gloo on CPU,
    keeping the time of the cost model's emulated accelerator)."""
    partition: Partition = setting(
        Partition.EVEN,
        help="initial layers per stage: even (default) or balanced (minimax under the cost model)",
    )
    """Initial layers per stage: even (equal counts) or balanced (the graph planner's
    minimax partition under the cost model)."""
    worker_prefix: str = setting(
        "",
        metavar="WORDS",
        help="run each worker under these words, {rank} replaced by its rank (e.g. "
        "'ip netns exec host{rank}')",
    )
    """Words run in front of every worker's command, ``{rank}`` replaced by its rank: a
    network namespace per host (``ip netns exec host{rank}``), a NUMA binding. Empty:
    none."""

    def __post_init__(self) -> None:
        check_positive_int(self, "dp", "pp", "tp")
        object.__setattr__(self, "device", parse_device(self.device))
        if self.world_size is not None and self.world_size != self.num_ranks:
            raise ValueError(
                f"world size {self.world_size} != dp x pp x tp = {self.dp} x {self.pp} x "
                f"{self.tp} = {self.num_ranks}; set --world-size {self.num_ranks} or change "
                "--dp/--pp/--tp"
            )
        self.worker_command(0)  # refuses a prefix that does not parse
        self._check_hosts()
        if self.tp > 1 and self.ranks_per_node % self.tp and self.tp % self.ranks_per_node:
            raise ValueError(
                f"tp = {self.tp} with {self.ranks_per_node} ranks per node: a TP group must "
                "fill whole nodes or fit in one (ranks per node a multiple or a divisor of "
                f"{self.tp})"
            )
        choose(self, "partition", Partition, f"valid values are {listed(Partition)}")

    def _check_hosts(self) -> None:
        check(self, "nnodes", lambda v: is_int(v) and v >= 1, "must be a positive integer")
        if self.nnodes > 1:
            if not self.rdzv_endpoint:
                raise ValueError(
                    f"nnodes = {self.nnodes} needs --rdzv-endpoint HOST:PORT (node 0's address)"
                )
            if self.tp > self.ranks_per_node:
                raise ValueError(
                    f"tp = {self.tp} with --nproc-per-node {self.ranks_per_node} on "
                    f"{self.nnodes} hosts: a TP group must fit in one host (its members "
                    "exchange every layer's activations), so --nproc-per-node must be a "
                    f"multiple of {self.tp}"
                )
            if self.nnodes * self.ranks_per_node != self.num_ranks:
                raise ValueError(
                    f"nnodes x nproc-per-node = {self.nnodes} x {self.ranks_per_node} = "
                    f"{self.nnodes * self.ranks_per_node} workers, but dp x pp x tp = "
                    f"{self.dp} x {self.pp} x {self.tp} = {self.num_ranks}"
                )
        check(self, "ranks_per_node", lambda v: isinstance(v, int) and v >= 1, "must be at least 1")

    def worker_command(self, rank: int) -> list[str]:
        """``worker_prefix`` for ``rank``, split into words."""
        if not isinstance(self.worker_prefix, str):
            raise ValueError(f"worker_prefix = {self.worker_prefix!r}: must be a string")
        try:
            return shlex.split(self.worker_prefix.replace("{rank}", str(rank)))
        except ValueError as exc:
            raise ValueError(f"worker_prefix = {self.worker_prefix!r}: {exc}") from None

    @property
    def num_ranks(self) -> int:
        """Worker processes at the start: dp x pp x tp."""
        return self.dp * self.pp * self.tp

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
    def local_processes(self) -> int:
        """Worker processes at the start on each host."""
        return self.num_ranks if self.nnodes == 1 else self.ranks_per_node


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """What the ranks compute, the same on any layout."""

    steps: int = setting(20, help="optimizer steps")
    """Optimizer steps to train."""
    global_batch: int = setting(16, help="samples per step")
    """Samples per step, summed over replicas and micro-batches."""
    micro_batch: int = setting(2, help="samples per micro-batch per replica")
    """Samples per micro-batch on each replica."""
    seed: int = setting(0, help="seed of initialisation and dropout")
    """Seed of parameter initialisation and dropout streams."""
    precision: Precision = setting(
        Precision.FP32,
        help="fp32 (default) or bf16: bfloat16 compute with fp32 parameters, gradient "
        "reduction, optimizer state and snapshots",
    )
    """``fp32``, or ``bf16``: compute in bfloat16 (autocast) with fp32 parameters,
    gradients (reduced in fp32), ZeRO master shards, Adam state and snapshots; activations
    cross stages in bfloat16 (``--precision``)."""
    rng: RngKind = setting(
        RngKind.COUNTER, help="dropout randomness: counter (default) or stateful"
    )
    """Dropout randomness: counter (keyed by sample and layer, layout-independent) or
    stateful (one generator per rank in execution order: the baseline)."""
    pipeline_schedule: ScheduleSetting = setting(
        ScheduleSetting.AUTO,
        help="pipeline schedule: auto (default: the planner takes the one it simulates "
        "fastest within the device's memory, for every plan), 1f1b, zb-h1 (the backward "
        "split in input- and weight-gradient halves, the weight halves in what would be "
        "1F1B's bubbles) or zb-cost (zero-bubble lists planned for the plan's own stage "
        "costs and memory)",
        aliases=(Alias(flag="--schedule", help="the same as --pipeline-schedule"),),
    )
    """The pipeline schedule every stage runs (:mod:`elaswave.engine.schedule`): ``auto``
    (the default): whichever the planner simulates fastest within the device's memory,
    chosen again at every change; or one of 1F1B; ZB-H1, whose backward is split and
    whose weight-gradient halves fill the bubbles; zb-cost, zero-bubble lists planned
    for the plan's own stage costs and memory."""
    eval_every: int = setting(
        0,
        metavar="K",
        help="every K steps (and after the last) report the loss on held-out tokens "
        "(--eval-data, or the heldout.bin beside --data's train.bin; default 0: never)",
    )
    """Every K steps and after the last, the mean loss per token of the held-out windows
    (``data.heldout``), computed inside the step by the pipeline with no gradients, the
    same on any layout (0: never)."""
    eval_batches: int = setting(
        1,
        metavar="N",
        help="held-out windows per evaluation, in global batches (default 1)",
    )
    """Held-out windows each evaluation reads: the first ``eval_batches x global_batch``
    of the held-out tokens."""
    trace_steps: int = setting(
        2,
        metavar="N",
        help="record the per-stage action trace of the first N steps (default 2)",
    )
    """Record the per-stage action trace of the first N steps."""
    script: tuple[str, ...] = setting(
        (),
        set_by="elaswave run SCRIPT [ARGS]",
        help="the script and its arguments every worker runs in place of the built-in loop",
    )
    """``elaswave run``: the user's script and its arguments, run in every worker in
    place of the built-in loop (:mod:`elaswave.embedded`). Empty: ``elaswave train``."""

    def __post_init__(self) -> None:
        check_positive_int(self, "steps", "global_batch", "micro_batch", "eval_batches")
        check(self, "eval_every", lambda v: is_int(v) and v >= 0, "must be 0 (never) or more")
        choose(self, "precision", Precision, f"valid values are {listed(Precision)}")
        choose(self, "rng", RngKind, f"valid values are {', '.join(RNG_KINDS)}")
        choose(
            self, "pipeline_schedule", ScheduleSetting,
            f"valid values are {listed(ScheduleSetting)}",
        )  # fmt: skip
        object.__setattr__(self, "script", tuple(self.script))

    def evaluates(self, step: int) -> bool:
        """Whether step ``step`` ends with a held-out evaluation."""
        every = self.eval_every
        return bool(every) and ((step + 1) % every == 0 or step == self.steps - 1)


@dataclass(frozen=True, kw_only=True)
class ElasticConfig:
    """How the job answers a change: a failure, a straggler, a joining rank."""

    recovery: bool = setting(
        True, help="stop the job at a worker failure instead of recovering inside the step"
    )
    """Recover from worker failures inside the step; False stops the job instead."""
    rebalance: Policy = setting(
        Policy.RESIZE,
        help="answer to a failure or straggler: none, resize (default), migrate "
        "(+ layer migration) or migrate+dvfs (+ frequency scaling)",
    )
    """How a change (failure, straggler) is answered: none, resize (micro-batch resizing
    only), migrate (+ layer migration), or migrate+dvfs (+ frequency scaling)."""
    migration: MigrationMode = setting(
        MigrationMode.NONBLOCKING,
        help="how migrating layers' parameters move: nonblocking (default: streamed while "
        "the source computes a shadow for the early micro-batches) or blocking",
    )
    """How migrating layers' parameters move: nonblocking (streamed during the next step
    while the source runs a shadow of the layer for its early micro-batches) or blocking
    (in place before the job resumes)."""
    migration_early: int | None = setting(
        None,
        metavar="N",
        help="micro-batches of a non-blocking migration's transition step that keep the old "
        "layer placement (default: planned from the cost model)",
    )
    """Micro-batches of a non-blocking migration's transition step that keep the old
    layer placement (shadows on the sources). None: planned from the cost model, 0 when
    the parameter streams arrive before the targets need them."""
    straggler_detection: bool | None = setting(
        None,
        help="watch for fail-slow ranks (default: on for emulated and accelerator devices, "
        "off for cpu)",
    )
    """Watch for fail-slow ranks. None: on for emulated and accelerator devices, off for
    cpu, where measured compute time reflects how the OS shares the host's cores among
    the workers, not the speed of a device."""
    straggler_window: int = setting(
        5, help="steps over which each rank's median slowness is taken (default 5)"
    )
    """Steps over which the fail-slow detector takes each rank's median slowness."""
    straggler_threshold: float = setting(
        1.25,
        help="a rank slower than this factor times its peers' median is slow in a step "
        "(default 1.25)",
    )
    """A rank slower than this factor times its peers' median is slow in a step."""
    straggler_min_steps: int = setting(
        2,
        help="consecutive slow (or normal again) evaluations before a rank is flagged "
        "(cleared) (default 2)",
    )
    """Consecutive slow (or normal again) evaluations before a rank is flagged (cleared)."""
    wait_for_nodes_s: float = setting(
        0.0,
        metavar="SECONDS",
        help="when too few ranks are left to fill every pipeline stage, wait this long for "
        "joining ranks with the state in memory before stopping (default 0: stop at once)",
    )
    """When too few ranks are left to fill every pipeline stage (no state lost), seconds
    the job waits for joining ranks, its state in memory, before it stops (0: at once)."""
    shorten_after_wait: bool = setting(
        True,
        help="when a wait for joining ranks runs out, go on with fewer pipeline stages if "
        "they fit in memory (off: write a checkpoint and stop, for --resume)",
    )
    """When ``wait_for_nodes_s`` runs out: the survivors go on on a shorter pipeline, in
    memory, if one fits; off (or none fits), they write a checkpoint and the job stops."""
    max_restarts: int = setting(
        0,
        metavar="K",
        help="start a worker that failed on a host that is still up again, as a joiner on "
        "the device it freed, up to K times in the job (torchrun's --max-restarts, without "
        "stopping the others; default 0: never)",
    )
    """Workers (TP groups) started again in the job after one failed on a host that is
    still up (a crash, a fenced hang): each joins on the device it freed, the others
    training on (:mod:`elaswave.runtime.host.restarts`). 0: a failed worker's device
    stays idle until a join asks for it."""
    reform: bool = setting(
        False,
        help="after a loss, re-form damaged replicas into a pipeline of fewer, full stages "
        "when the cost model prices that faster (default off: under churn nodes come back "
        "within minutes and the layers would move twice)",
    )
    """After a loss that leaves every stage a rank, re-form the damaged replicas into a
    pipeline of fewer, full stages when the cost model prices it faster, move included
    (:func:`elaswave.engine.reshape.reformed`). Off by default: under churn nodes come
    back within minutes, and a shortened pipeline moves its layers twice. A pipeline
    that lost stages grows back when joiners come and a longer one prices faster,
    whatever this says."""

    def __post_init__(self) -> None:
        if self.straggler_window < 1 or self.straggler_min_steps < 1:
            raise ValueError(
                f"straggler_window = {self.straggler_window}, straggler_min_steps = "
                f"{self.straggler_min_steps}: both must be at least 1"
            )
        check(self, "straggler_threshold", lambda v: v > 1.0, "must be above 1")
        choose(self, "rebalance", Policy, f"valid policies are {', '.join(POLICIES)}")
        valid = f"valid modes are {', '.join(MIGRATION_MODES)}"
        choose(self, "migration", MigrationMode, valid)
        if self.migration not in MIGRATION_MODES:  # none is the Core's decision, not a request
            raise ValueError(f"migration = {str(self.migration)!r}: {valid}")
        check(self, "max_restarts", lambda v: is_int(v) and 0 <= v <= MAX_RESTARTS,
              f"must be an integer from 0 to {MAX_RESTARTS}")  # fmt: skip
        early = self.migration_early
        if early is not None and early < 0:
            raise ValueError(f"migration_early = {early}: must be at least 0")
        check(
            self,
            "wait_for_nodes_s",
            lambda v: 0 <= v <= MAX_WAIT_FOR_NODES_S,
            f"must be from 0 to {MAX_WAIT_FOR_NODES_S} seconds (0: stop at once when a stage "
            "cannot be filled)",
        )

    @property
    def shortens(self) -> bool:
        """Whether fewer ranks than stages continue on a shorter pipeline (no wait asked
        for) rather than waiting for joiners."""
        return self.wait_for_nodes_s == 0


@dataclass(frozen=True, kw_only=True)
class LivenessConfig:
    """How a lost or hung process is noticed, and how long anyone waits for another."""

    heartbeat_interval_s: float = setting(
        0.2, help="seconds between a worker's heartbeats (default 0.2)"
    )
    """Seconds between a worker's heartbeats."""
    heartbeat_timeout_s: float = setting(3.0, help="seconds of silence before a worker is fenced")
    """A worker silent this long is declared hung and fenced (SIGKILL), then recovered."""
    plan_ack_timeout_s: float = setting(
        5.0, help="seconds every participant has to acknowledge a recovery plan (default 5)"
    )
    """Seconds the Core waits for every participant to acknowledge a recovery plan;
    one that does not is fenced and the plan superseded."""
    comm_timeout_s: float = setting(60.0, help="seconds any collective may wait")
    """Bound on any single collective or point-to-point wait."""
    core_restarts: int = setting(
        3, help="times a lost Core is started again while the workers train on (default 3)"
    )
    """Times the job host starts the Core again after it is lost (0: a lost Core stops
    the job, which can be resumed from its latest checkpoint)."""
    core_restart_delay_s: float = setting(
        0.0, help="seconds to wait before starting a lost Core again (default 0)"
    )
    """Seconds the job host waits before starting a lost Core again (a back-off)."""
    core_outage_s: float = setting(
        10.0,
        help="seconds workers train without hearing the Core before they all pause at one "
        "step boundary and wait for it (default 10)",
    )
    """Seconds workers train on without hearing from the Core; after that they all stop
    at the same step boundary and wait for it, keeping their state."""
    health_log_mib: int = setting(
        1024,
        help="MiB of the newest step timings and heartbeats the run directory keeps in "
        "RUN_DIR/health (default 1024)",
    )
    """What the Core's health log keeps (:mod:`elaswave.bus.rolling`): every rank's step
    timings and the sampled heartbeats, the oldest dropped; the event log keeps the rest
    for the run's life."""

    def __post_init__(self) -> None:
        seconds = "must be 0 to 600 seconds"
        check(self, "plan_ack_timeout_s", lambda v: is_number(v) and 0 < v <= 600, seconds)
        check(
            self,
            "core_restarts",
            lambda v: is_int(v) and 0 <= v <= 100,
            "must be an integer from 0 to 100",
        )
        check(self, "core_restart_delay_s", lambda v: is_number(v) and 0 <= v <= 600, seconds)
        check(
            self,
            "core_outage_s",
            lambda v: is_number(v) and 0 < v <= 3600,
            "must be more than 0 and at most 3600 seconds",
        )
        check(
            self,
            "health_log_mib",
            lambda v: is_int(v) and 1 <= v <= 1 << 20,
            "must be an integer number of MiB from 1 to 1048576",
        )
        if not 0 < self.heartbeat_interval_s < self.heartbeat_timeout_s:
            raise ValueError(
                f"heartbeat interval {self.heartbeat_interval_s!r} s must be positive and below "
                f"the heartbeat timeout {self.heartbeat_timeout_s!r} s"
            )
        check(self, "comm_timeout_s", lambda v: v > 0, "must be positive")


@dataclass(frozen=True, kw_only=True)
class StateConfig:
    """Where the training state is kept besides the workers' memory."""

    snapshots: bool = setting(
        True,
        help="keep no host snapshots of optimizer shards (a lost shard is then unrecoverable)",
    )
    """Keep per-step host snapshots of every optimizer shard on another rank."""
    snapshot_copies: int = setting(
        1,
        help="copies of each optimizer shard's host snapshot, each on another rank and, "
        "where the layout has them, on another node and stage (default 1; 2 survives "
        "losing any two ranks or nodes)",
    )
    """Copies of each shard's host snapshot: losing any K ranks (or K nodes) loses no
    state where the layout has K other nodes for every owner."""
    verify_snapshots: bool = setting(
        False, help="record per-step digests of every optimizer shard and its snapshot"
    )
    """Record per-step digests of every shard and snapshot in the worker results."""
    checkpoint_every: int = setting(0, help="write a checkpoint every K steps")
    """Write a disk checkpoint every K steps, in the background (0: never)."""
    restore_in_job: bool = setting(
        True,
        help="when state is lost, restore the newest checkpoint inside the running job "
        "(off: the job stops, and --resume continues it)",
    )
    """Restore lost state from the newest complete checkpoint inside the running
    processes (with ``checkpoint_every``); off, the job stops naming ``--resume``."""
    resume_dir: str | None = setting(
        None,
        set_by="--resume RUN_DIR",
        help="the run directory whose latest complete checkpoint this run starts from",
    )
    """Run directory whose latest complete checkpoint this run starts from."""
    resume_step: int | None = setting(
        None, set_by="--resume RUN_DIR", help="the step of that checkpoint"
    )
    """The checkpoint's step; training continues at the next one."""
    resume_tp: int | None = setting(
        None, set_by="--resume RUN_DIR", help="the tp that checkpoint was written with"
    )
    """The tp the checkpoint was written with: each TP member's pieces are its own
    slices of every layer, so the resumed job keeps it (on any dp x pp)."""

    def __post_init__(self) -> None:
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every = {self.checkpoint_every}: must be >= 0")
        check_positive_int(self, "snapshot_copies")
        if self.resume_tp is not None:
            check_positive_int(self, "resume_tp")

    @property
    def first_step(self) -> int:
        """The step training starts at: the one after the resumed checkpoint's."""
        return 0 if self.resume_step is None else self.resume_step + 1


@dataclass(frozen=True, kw_only=True)
class NetworkConfig:
    """The Core's bus: the address it binds on and the keys it admits."""

    bus_host: str = setting(
        "127.0.0.1", help="IP address the bus binds on (default 127.0.0.1; others need keys)"
    )
    """IP address the Core's bus binds on. Beyond loopback it needs ``bus_keys``."""
    bus_keys: str | None = setting(
        None, help="directory of the job's CURVE keys (elaswave keys DIR)"
    )
    """Directory of the job's CURVE keys (``elaswave keys DIR``): the bus then encrypts
    and admits only processes holding them."""

    def __post_init__(self) -> None:
        check_bind(self.bus_host, keyed=self.bus_keys is not None)

    def keys(self) -> BusKeys | None:
        """The job's bus keys, read from ``bus_keys`` (None without). Read where the bus
        is used, not on validation: a run directory stays readable (replay, reports) on
        a host that does not hold its keys."""
        return None if self.bus_keys is None else load_keys(Path(self.bus_keys))


@dataclass(frozen=True, kw_only=True)
class InjectionConfig:
    """Faults injected on purpose, to test recovery and the bus's delivery."""

    faults: tuple[str, ...] = setting(
        (),
        flag="--fault",
        metavar="SPEC",
        help="inject a fault, repeatable: kill:RANK@STEP[:PHASE], "
        "kill-node:NODE@STEP[:PHASE], hang:RANK@STEP[:PHASE], slow:RANK=FACTOR@STEP "
        "(compute FACTOR x slower) or join@STEP (a worker joins); PHASE: forward, "
        "backward, grad-sync, snapshot, optimizer, eval (a step that evaluates)",
    )
    """Injected faults: kill:RANK@STEP[:PHASE], kill-node:NODE@STEP[:PHASE]."""
    bus_faults: str = setting(
        "",
        metavar="SPEC",
        help="inject faults into every process's received bus messages, to test delivery: "
        "drop=P,dup=P,reorder=P,delay=SECONDS,seed=N",
    )
    """Faults every process injects into the bus messages it receives, for testing
    delivery: ``drop=P,dup=P,reorder=P,delay=SECONDS,seed=N`` (see
    :class:`~elaswave.bus.reliable.BusFaults`); empty: none."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "faults", tuple(self.faults))
        BusFaults.parse(self.bus_faults)

    def bus_fault_spec(self) -> BusFaults | None:
        """The injected bus faults, None when there are none."""
        faults = BusFaults.parse(self.bus_faults)
        return faults if faults.active else None


SECTIONS: dict[str, type] = {
    "layout": LayoutConfig,
    "schedule": ScheduleConfig,
    "elastic": ElasticConfig,
    "liveness": LivenessConfig,
    "state": StateConfig,
    "network": NetworkConfig,
    "injection": InjectionConfig,
}
"""The sections by name: :class:`~elaswave.runtime.job.config.JobConfig`'s field, the
TOML table and the object in RUN_DIR/job.json."""

FLAT = "train"
"""The table that holds every training setting flat (``[train] dp = 2``): the TOML
files and job.json of runs from before the settings had sections."""

SECTION_OF: dict[str, str] = {
    f.name: name for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)
}
"""Each setting's section, by the setting's name (names are unique across sections)."""


def sectioned(flat: Mapping[str, Any], *, where: str = FLAT) -> dict[str, dict[str, Any]]:
    """Flat settings (``{"dp": 2, "steps": 8}``) by section; ValueError for a name that
    is no setting, naming ``where`` they were found."""
    out: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        if key not in SECTION_OF:
            raise ValueError(f"unknown key [{where}] {key!r}; valid keys: {', '.join(SECTION_OF)}")
        out.setdefault(SECTION_OF[key], {})[key] = value
    return out
