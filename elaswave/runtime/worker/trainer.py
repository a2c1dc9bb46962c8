"""What a worker trains with: a :class:`Trainer` and the parts it is built of.

A :class:`Trainer` holds everything a plan change replaces: the plan, the rank's layer
modules, the ZeRO optimizer shard, the snapshot sender and keepers, and the stage
runner, all over the current generation of the worker's dynamic communicator.
:mod:`elaswave.runtime.worker.reconfigure` turns one trainer into the next for every kind
of change; this module builds the parts a trainer is made of.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import structlog
import torch
import torch.distributed as dist
from torch import nn

from elaswave.comm.abort import AbortSignal
from elaswave.comm.backend import GroupBackend, host_backend
from elaswave.comm.communicator import Communicator
from elaswave.comm.dynamic import DynamicCommunicator
from elaswave.comm.spec import GroupSpec
from elaswave.data.corpus import SampleLoader
from elaswave.engine.plan import (
    TIED_GROUP,
    WORLD_GROUP,
    Plan,
    dp_group_name,
    snapshot_group_specs,
    tied_group_spec,
    world_group_spec,
)
from elaswave.engine.steptime import plan_lists
from elaswave.fabric.adamw import ShardState
from elaswave.fabric.checkpoint import load_layers, piece_dir, shard_of_layers
from elaswave.fabric.clip import GradClip
from elaswave.fabric.placement import snapshot_link_name
from elaswave.fabric.snapshot import SnapshotKeeper, SnapshotSender
from elaswave.fabric.tied import TiedGrad
from elaswave.fabric.zero import ZeroAdamW
from elaswave.model.hf import TIED_PARAMS
from elaswave.model.llama import layer_index
from elaswave.model.rng import DropoutRng
from elaswave.model.tensor_parallel import TpShard, split_dim
from elaswave.runtime.job.config import JobConfig
from elaswave.runtime.worker.emulation import Pacer
from elaswave.runtime.worker.evaluation import HeldOutEval
from elaswave.runtime.worker.faults import FaultInjector
from elaswave.runtime.worker.holders import (
    owner_decay_mask,
    owner_initial_state,
    owner_layout,
    placement_of,
)
from elaswave.runtime.worker.memento import Memento
from elaswave.runtime.worker.migration import ShadowStep
from elaswave.runtime.worker.pipeline import StageRunner
from elaswave.runtime.worker.tpgroup import TpLink

log = structlog.get_logger(__name__)

DEVICE_PREFIX = "dev/"
"""Store prefix of the device plane's groups (the host plane's have none)."""


@dataclass(frozen=True)
class WorkerContext:
    """What stays fixed for a worker's whole life."""

    cfg: JobConfig
    rank: int
    run_dir: Path
    store: dist.Store
    backend: GroupBackend
    """The device plane's backend (training traffic); the host plane's is
    :attr:`host_backend`."""
    device: torch.device
    layers: nn.ModuleList
    loader: SampleLoader
    rng: DropoutRng
    abort: AbortSignal
    faults: FaultInjector
    pacer: Pacer
    """Keeps the modelled device's time (``--device emulated``) and fail-slow delays."""
    member: int = 0
    """This process's member of the rank's TP group (:mod:`elaswave.runtime.worker.tpgroup`)."""
    tp: TpLink | None = None
    """The TP group (None without tensor parallelism)."""
    plane_store: dist.Store | None = None
    """Where this member's plane meets (its groups and links); None: ``store``."""
    evaluation: HeldOutEval | None = None
    """The held-out windows ``--eval-every`` evaluates (None: no evaluation)."""
    local_rank: int = 0
    """Which of its host's devices :attr:`device` is (its host's ``LOCAL_RANK``)."""

    @property
    def tp_shard(self) -> TpShard:
        """The piece of every layer this process holds."""
        return TpShard(self.member, self.cfg.layout.tp, self.tp)

    @property
    def leader(self) -> bool:
        """Whether this process speaks for its rank on the bus (TP member 0)."""
        return self.member == 0

    @property
    def host_backend(self) -> GroupBackend:
        """The host plane's backend (fault-tolerance traffic): gloo on every device."""
        return host_backend()

    @property
    def comm_store(self) -> dist.Store:
        return self.store if self.plane_store is None else self.plane_store

    @property
    def numels(self) -> dict[int, int]:
        """Parameters of every layer of the model, by layer index."""
        return {c.index: c.params for c in self.cfg.layer_costs}

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.cfg.liveness.comm_timeout_s)


@dataclass
class Trainer:
    plan: Plan
    links: DynamicCommunicator
    """The host plane: the worker's links for fault-tolerance traffic (snapshots, remap,
    layer streams, paybacks) between host buffers, over gloo, across generations."""
    device: Communicator
    """The device plane: the current generation's groups for training traffic (data
    parallelism, the pipeline) on the device's backend (:meth:`Plan.device_group_specs`)."""
    optimizer: ZeroAdamW
    runner: StageRunner
    layers: nn.ModuleList
    """This rank's layer modules under ``plan``, in layer order."""
    keepers: list[SnapshotKeeper] = field(default_factory=list)
    memento: Memento | None = None
    """What this rank committed before the change that made this trainer, kept until
    the change is settled (a torn apply rolls back to it)."""
    joined: bool = False
    """The change that made this trainer added this rank, which held nothing before:
    until it is settled, a roll-back of its plan sends the rank back to wait as a
    joiner (:func:`elaswave.runtime.worker.executor.recover`)."""

    @property
    def comm(self) -> Communicator:
        """The host plane's current generation of groups."""
        return self.links.comm

    def communicators(self) -> int:
        """Process groups open: the pooled links, and the device plane's groups where
        it has its own (under gloo its groups are views over the links)."""
        own = 0 if self.device is self.comm else len(self.device)
        return own + len(self.links.links)

    def tainted(self) -> list[str]:
        """Both planes' groups that must be rebuilt, not reused."""
        return sorted(set(self.comm.tainted()) | set(self.device.tainted()))

    @property
    def committed_step(self) -> int:
        return self.optimizer.committed_step

    def forget(self) -> None:
        """Drop the memento: the change that made this trainer is settled."""
        self.memento = None
        self.joined = False

    def close_snapshots(self) -> None:
        for keeper in self.keepers:
            keeper.close()
        if self.optimizer.snapshot is not None:
            self.optimizer.snapshot.close()


def snapshot_specs(ctx: WorkerContext, plan: Plan) -> list[GroupSpec]:
    if not ctx.cfg.state.snapshots:
        return []
    return snapshot_group_specs(plan, ctx.cfg.layout.units_per_node, ctx.cfg.state.snapshot_copies)


def build_runner(
    ctx: WorkerContext,
    plan: Plan,
    comm: Communicator,
    layers: nn.ModuleList,
    opt: ZeroAdamW,
    shadow: ShadowStep | None = None,
) -> StageRunner:
    return StageRunner(
        plan=plan,
        rank=ctx.rank,
        layers=layers,
        optimizer=opt,
        comm=comm,
        loader=ctx.loader,
        rng=ctx.rng,
        model=ctx.cfg.model,
        device=ctx.device,
        fault_hook=ctx.faults.at,
        pacer=ctx.pacer,
        shadow=shadow,
        bf16=ctx.cfg.schedule.precision == "bf16",
        per_route=not own_device_plane(ctx),
        receive_ahead=not own_device_plane(ctx),
        evaluation=ctx.evaluation,
        block=ctx.cfg.exact_block,
        actions=(
            plan_lists(plan, ctx.cfg.layer_costs, ctx.cfg.cost_device)[plan.locate(ctx.rank)[0]]
            if plan.schedule.priced
            else None
        ),
    )


def build_optimizer(
    ctx: WorkerContext,
    plan: Plan,
    comm: Communicator,
    layers: nn.ModuleList,
    state: ShardState | None = None,
    committed_step: int = -1,
) -> ZeroAdamW:
    stage, replica = plan.locate(ctx.rank)
    optimizer = ZeroAdamW(
        layers,
        layer_ids=list(plan.stages[stage].layers),
        dp_group=comm.collective(dp_group_name(stage)),
        replica=replica,
        cfg=ctx.cfg.optim,
        state=state,
        committed_step=committed_step,
    )
    optimizer.tied = tied_grad(ctx, plan, comm, layers)
    optimizer.clip = grad_clip(ctx, plan, comm, optimizer)
    return optimizer


def tied_grad(
    ctx: WorkerContext, plan: Plan, comm: Communicator, layers: nn.ModuleList
) -> TiedGrad | None:
    """How this rank sums the tied weight's gradient with its other copies (None where
    the model has no tied weight, or this rank holds no copy)."""
    if not ctx.cfg.model.tie_embeddings:
        return None
    slots = tuple(
        (position, names.index(name))
        for position, layer in enumerate(layers)
        for names in [[n for n, _ in layer.named_parameters()]]
        for name in TIED_PARAMS
        if name in names
    )
    if not slots:
        return None
    _, replica = plan.locate(ctx.rank)
    return TiedGrad(group=comm.collective(TIED_GROUP), slots=slots, keeps=replica == 0)


def grad_clip(
    ctx: WorkerContext, plan: Plan, comm: Communicator, optimizer: ZeroAdamW
) -> GradClip | None:
    """How ``optimizer`` clips the step's gradient (None when the job does not): over
    the plan's world group and the rank's TP group, a parameter kept whole on every TP
    member counted on member 0 only, a tied weight on its embedding's copy only."""
    max_norm = ctx.cfg.optim.max_grad_norm
    if max_norm is None:
        return None
    whole_elsewhere = ctx.tp is not None and ctx.member > 0  # counted on member 0
    head_copy = optimizer.tied is not None  # a tied weight counts on its embedding's copy

    def counts(name: str) -> bool:
        if whole_elsewhere and split_dim(name) is None:
            return False
        return not (head_copy and name == TIED_PARAMS[-1])

    counted = optimizer.shard_mask(counts) if whole_elsewhere or head_copy else None
    return GradClip(
        max_norm=max_norm,
        world=comm.collective(WORLD_GROUP),
        world_size=len(plan.ranks),
        tp=ctx.tp,
        counted=counted,
    )


def recipe_specs(ctx: WorkerContext, plan: Plan) -> list[GroupSpec]:
    """The world group where the job clips gradients (:func:`grad_clip`), the tied
    group where the model ties its embeddings (:func:`tied_grad`)."""
    specs = [world_group_spec(plan)] if ctx.cfg.optim.max_grad_norm is not None else []
    return specs + ([tied_group_spec(plan)] if ctx.cfg.model.tie_embeddings else [])


def device_specs(ctx: WorkerContext, plan: Plan) -> list[GroupSpec]:
    """The device plane's groups under ``plan`` where it has its own
    (:meth:`Plan.device_group_specs` and :func:`recipe_specs`)."""
    return plan.device_group_specs() + recipe_specs(ctx, plan)


def own_device_plane(ctx: WorkerContext) -> bool:
    """Whether training traffic gets a plane of its own: where work in flight parks
    (NCCL, HCCL, cpu-strict), one communicator per group. Under gloo, training traffic
    rides the dynamic communicator with the host plane's traffic, as the paper's design
    has it (DP rings and pipeline routes over pooled links, edited rather than rebuilt):
    whole gloo groups cost a change twice the communicator time, and gloo's own
    reduce-scatter cost dp2 a tenth of its steady-state throughput."""
    return ctx.backend.parks_in_flight


def host_specs(ctx: WorkerContext, plan: Plan) -> list[GroupSpec]:
    """The groups of the dynamic communicator under ``plan`` (without a change's remap
    links): the snapshot links, and under gloo the plan's DP rings and route links."""
    training = [] if own_device_plane(ctx) else plan.group_specs() + recipe_specs(ctx, plan)
    return training + snapshot_specs(ctx, plan)


def device_plane(
    ctx: WorkerContext, plan: Plan, links: DynamicCommunicator, store: dist.Store | None = None
) -> Communicator:
    """The device plane of ``plan``, built now (every member builds it together); under
    gloo the dynamic communicator's current groups (:func:`own_device_plane`).
    ``store``: where its groups meet (default the worker's)."""
    if not own_device_plane(ctx):
        return links.comm
    plane = Communicator(
        store or ctx.comm_store, ctx.rank, ctx.backend, timeout=ctx.timeout,
        generation=plan.generation, abort=ctx.abort, device=ctx.device, prefix=DEVICE_PREFIX,
    )  # fmt: skip
    plane.build(device_specs(ctx, plan))
    return plane


def initial_trainer(ctx: WorkerContext) -> Trainer:
    """The trainer at the start of the run, or at a checkpoint when resuming (this TP
    member's pieces of it)."""
    plan = ctx.cfg.plan()
    links = DynamicCommunicator(
        ctx.comm_store, ctx.rank, ctx.host_backend, timeout=ctx.timeout, abort=ctx.abort
    )
    links.build(host_specs(ctx, plan))
    comm, device = links.comm, device_plane(ctx, plan, links)
    layers = ctx.layers
    if ctx.cfg.state.resume_dir is None or ctx.cfg.state.resume_step is None:
        optimizer = build_optimizer(ctx, plan, device, layers)
        keepers = attach_snapshots(ctx, plan, comm, optimizer, step=-1, initial=None)
        runner = build_runner(ctx, plan, device, layers, optimizer)
        return Trainer(plan, links, device, optimizer, runner, layers, keepers)
    step = ctx.cfg.state.resume_step
    ckpt = piece_dir(Path(ctx.cfg.state.resume_dir), step, ctx.member, ctx.cfg.layout.tp)
    optimizer, initial = load_checkpoint(ctx, plan, device, layers, ckpt, step)
    keepers = attach_snapshots(ctx, plan, comm, optimizer, step=step, initial=initial)
    runner = build_runner(ctx, plan, device, layers, optimizer)
    return Trainer(plan, links, device, optimizer, runner, layers, keepers)


def load_checkpoint(
    ctx: WorkerContext,
    plan: Plan,
    device: Communicator,
    layers: nn.ModuleList,
    ckpt: Path,
    step: int,
) -> tuple[ZeroAdamW, dict[int, ShardState]]:
    """This rank's part of ``plan`` from the disk checkpoint ``ckpt`` of ``step``: its
    stage's layers get the checkpoint's master weights, its optimizer the shard of its
    replica; returns the optimizer and the host snapshots it holds (of owners in
    another stage) at the step."""
    stage, replica = plan.locate(ctx.rank)
    loaded = load_layers(ckpt, plan.stages[stage].layers)
    with torch.no_grad():
        for layer in layers:
            master, offset = loaded[layer_index(layer)][0], 0
            for param in layer.parameters():
                param.copy_(master[offset : offset + param.numel()].view_as(param))
                offset += param.numel()
    optimizer = build_optimizer(ctx, plan, device, layers, committed_step=step)
    shard = shard_of_layers(optimizer.layout, replica, loaded)
    where = optimizer.state.master.device  # the parameters' device (the checkpoint's: host)
    optimizer.state = ShardState(
        shard.master.to(where), shard.exp_avg.to(where), shard.exp_avg_sq.to(where),
        optimizer.decay_mask_of(replica),
    )  # fmt: skip
    initial = {}
    for owner in placement_of(ctx.cfg, plan).holds(ctx.rank):
        layout, owner_replica = owner_layout(ctx.cfg, plan, owner)
        held = load_layers(ckpt, [item.layer for item in layout.layers])
        initial[owner] = shard_of_layers(layout, owner_replica, held)
        initial[owner].decay_mask = owner_decay_mask(ctx.cfg, plan, owner)
    return optimizer, initial


def attach_snapshots(
    ctx: WorkerContext,
    plan: Plan,
    comm: Communicator,
    optimizer: ZeroAdamW,
    *,
    step: int,
    initial: dict[int, ShardState] | None,
) -> list[SnapshotKeeper]:
    """Send this rank's shard gradients to its holder; keep its owners' host copies.

    ``initial``: the owners' states after ``step`` (None at the start of training, when
    every replica can compute them from the identical initial parameters).
    """
    if not ctx.cfg.state.snapshots:
        return []
    placement = placement_of(ctx.cfg, plan)
    holders = placement.holders_of(ctx.rank)
    if holders:
        links = [(comm.p2p(snapshot_link_name(ctx.rank, h)), h) for h in holders]
        master = optimizer.state.master
        optimizer.snapshot = SnapshotSender(
            *links[0], generation=plan.generation, device=ctx.device, abort=ctx.abort,
            more=links[1:], initial_step=step, shard=(master.numel(), master.dtype),
        )  # fmt: skip
    keepers = []
    for owner in placement.holds(ctx.rank):
        state = (
            owner_initial_state(ctx.cfg, plan, owner, member=ctx.member)
            if initial is None
            else initial[owner]
        )
        keeper = SnapshotKeeper(
            owner=owner,
            link=comm.p2p(snapshot_link_name(owner, ctx.rank)),
            cfg=ctx.cfg.optim,
            initial=state,
            generation=plan.generation,
            initial_step=step,
            record_digests=ctx.cfg.state.verify_snapshots,
            holder_step=lambda: optimizer.committed_step,
            device=ctx.device,
        )
        keeper.start()
        keepers.append(keeper)
    return keepers
