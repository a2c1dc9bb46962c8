"""What a worker trains with, and how a recovery plan turns one trainer into the next.

A :class:`Trainer` holds everything a plan change replaces: the plan, the ZeRO
optimizer shard, the snapshot sender and keepers, and the stage runner, all over the
current generation of the worker's dynamic communicator. The layers and their parameters
stay (fail-stop recovery moves no layer). :func:`recover` is the recovery executor: roll
back to the committed step, edit the communicator (only the groups and links the failure
touched), live-remap the optimizer shards of the stages that lost ranks, re-place
snapshots, and rebuild the runner.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from pathlib import Path

import structlog
import torch
import torch.distributed as dist
from torch import nn

from elaswave.comm.abort import AbortSignal
from elaswave.comm.backend import GroupBackend
from elaswave.comm.communicator import Communicator
from elaswave.comm.dynamic import DynamicCommunicator, RebuildStrategy
from elaswave.comm.group import GroupSpec, TagSpace, p2p_tag
from elaswave.data.corpus import SampleLoader
from elaswave.engine.plan import (
    Plan,
    dp_group_name,
    snapshot_group_specs,
    snapshot_placements,
)
from elaswave.fabric.checkpoint import load_layers, shard_of_layers, step_dir
from elaswave.fabric.layout import InterleavedLayout
from elaswave.fabric.remap import plan_remap
from elaswave.fabric.remap_exec import execute_remap, remap_link_name
from elaswave.fabric.snapshot import SnapshotKeeper, SnapshotSender, snapshot_link_name
from elaswave.fabric.zero import ShardState, ZeroAdamW
from elaswave.model.rng import DropoutRng
from elaswave.runtime.config import JobConfig
from elaswave.runtime.faults import FaultInjector
from elaswave.runtime.pipeline import StageRunner

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class WorkerContext:
    """What stays fixed for a worker's whole life."""

    cfg: JobConfig
    rank: int
    run_dir: Path
    store: dist.Store
    backend: GroupBackend
    device: torch.device
    layers: nn.ModuleList
    loader: SampleLoader
    rng: DropoutRng
    abort: AbortSignal
    faults: FaultInjector

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.cfg.train.comm_timeout_s)


@dataclass
class Trainer:
    plan: Plan
    links: DynamicCommunicator
    """The worker's groups and links across generations (shared by successive trainers)."""
    optimizer: ZeroAdamW
    runner: StageRunner
    keepers: list[SnapshotKeeper] = field(default_factory=list)

    @property
    def comm(self) -> Communicator:
        """The current generation's groups."""
        return self.links.comm

    @property
    def committed_step(self) -> int:
        return self.optimizer.committed_step

    def close_snapshots(self) -> None:
        for keeper in self.keepers:
            keeper.close()
        if self.optimizer.snapshot is not None:
            self.optimizer.snapshot.close()


def _snapshot_specs(ctx: WorkerContext, plan: Plan) -> list[GroupSpec]:
    if not ctx.cfg.train.snapshots:
        return []
    return snapshot_group_specs(plan, ctx.cfg.train.ranks_per_node)


def _runner(ctx: WorkerContext, plan: Plan, comm: Communicator, opt: ZeroAdamW) -> StageRunner:
    return StageRunner(
        plan=plan,
        rank=ctx.rank,
        layers=ctx.layers,
        optimizer=opt,
        comm=comm,
        loader=ctx.loader,
        rng=ctx.rng,
        model=ctx.cfg.model,
        device=ctx.device,
        fault_hook=ctx.faults.at,
    )


def _optimizer(
    ctx: WorkerContext,
    plan: Plan,
    comm: Communicator,
    state: ShardState | None = None,
    committed_step: int = -1,
) -> ZeroAdamW:
    stage, replica = plan.locate(ctx.rank)
    return ZeroAdamW(
        ctx.layers,
        layer_ids=list(plan.stages[stage].layers),
        dp_group=comm[dp_group_name(stage)],
        replica=replica,
        cfg=ctx.cfg.optim,
        state=state,
        committed_step=committed_step,
    )


def initial_trainer(ctx: WorkerContext) -> Trainer:
    """The trainer at the start of the run, or at a checkpoint when resuming."""
    plan = ctx.cfg.plan()
    links = DynamicCommunicator(
        ctx.store, ctx.rank, ctx.backend, timeout=ctx.timeout, abort=ctx.abort
    )
    links.build(plan.group_specs() + _snapshot_specs(ctx, plan))
    comm = links.comm
    t = ctx.cfg.train
    if t.resume_dir is None or t.resume_step is None:
        optimizer = _optimizer(ctx, plan, comm)
        keepers = _attach_snapshots(ctx, plan, comm, optimizer, step=-1, initial=None)
        return Trainer(plan, links, optimizer, _runner(ctx, plan, comm, optimizer), keepers)
    stage, replica = plan.locate(ctx.rank)
    loaded = load_layers(step_dir(Path(t.resume_dir), t.resume_step), plan.stages[stage].layers)
    with torch.no_grad():
        for layer in ctx.layers:
            master, offset = loaded[layer.index][0], 0
            for param in layer.parameters():
                param.copy_(master[offset : offset + param.numel()].view_as(param))
                offset += param.numel()
    optimizer = _optimizer(ctx, plan, comm, committed_step=t.resume_step)
    cut = partial(shard_of_layers, optimizer.layout, layers=loaded)
    optimizer.state = cut(replica)
    optimizer.state.decay_mask = optimizer.decay_mask_of(replica)
    initial = {}
    for owner in snapshot_placements(plan, t.ranks_per_node)[stage].holds(ctx.rank):
        owner_replica = plan.stages[stage].ranks.index(owner)
        initial[owner] = cut(owner_replica)
        initial[owner].decay_mask = optimizer.decay_mask_of(owner_replica)
    keepers = _attach_snapshots(ctx, plan, comm, optimizer, step=t.resume_step, initial=initial)
    return Trainer(plan, links, optimizer, _runner(ctx, plan, comm, optimizer), keepers)


def _attach_snapshots(
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
    if not ctx.cfg.train.snapshots:
        return []
    stage, _ = plan.locate(ctx.rank)
    placement = snapshot_placements(plan, ctx.cfg.train.ranks_per_node)[stage]
    holder = placement.holder.get(ctx.rank)
    if holder is not None:
        optimizer.snapshot = SnapshotSender(
            comm[snapshot_link_name(ctx.rank, holder)], holder, generation=plan.generation
        )
    keepers = []
    for owner in placement.holds(ctx.rank):
        replica = plan.stages[stage].ranks.index(owner)
        state = optimizer.initial_state_of(replica) if initial is None else initial[owner]
        keeper = SnapshotKeeper(
            owner=owner,
            link=comm[snapshot_link_name(owner, ctx.rank)],
            cfg=ctx.cfg.optim,
            initial=state,
            generation=plan.generation,
            initial_step=step,
            record_digests=ctx.cfg.train.verify_snapshots,
        )
        keeper.start()
        keepers.append(keeper)
    return keepers


def _exchange_snapshot_states(
    ctx: WorkerContext,
    plan: Plan,
    comm: Communicator,
    optimizer: ZeroAdamW,
    step: int,
) -> dict[int, ShardState]:
    """Owners send their full committed shard to their (new) holders."""
    stage, _ = plan.locate(ctx.rank)
    placement = snapshot_placements(plan, ctx.cfg.train.ranks_per_node)[stage]
    tag = p2p_tag(plan.generation, step, TagSpace.SNAPSHOT_STATE)
    pending = None
    holder = placement.holder.get(ctx.rank)
    if holder is not None:
        s = optimizer.state
        payload = torch.stack([s.master, s.exp_avg, s.exp_avg_sq]).contiguous()
        group = comm[snapshot_link_name(ctx.rank, holder)]
        pending = (group, group.isend(payload, holder, tag), payload)
    received = {}
    for owner in placement.holds(ctx.rank):
        buf = torch.empty(3, optimizer.layout.shard_numel)
        comm[snapshot_link_name(owner, ctx.rank)].recv(buf, owner, tag)
        replica = plan.stages[stage].ranks.index(owner)
        received[owner] = ShardState(
            buf[0].clone(), buf[1].clone(), buf[2].clone(), optimizer.decay_mask_of(replica)
        )
    if pending is not None:
        pending[0].wait_send(pending[1])
    return received


def recover(
    ctx: WorkerContext,
    old: Trainer,
    new_plan: Plan,
    failed: set[int],
    committed_step: int,
    *,
    rebuild: set[str],
) -> tuple[Trainer, dict[str, float]]:
    """Apply a fail-stop plan on this survivor; returns the new trainer and phase times."""
    c = committed_step
    stage, _ = old.plan.locate(ctx.rank)
    old_stage = old.plan.stages[stage]
    affected = bool(failed & set(old_stage.ranks))
    # Host snapshots this rank holds for failed owners, at the committed step.
    host_states = {
        k.owner: k.wait(c, ctx.cfg.train.comm_timeout_s) for k in old.keepers if k.owner in failed
    }
    old.close_snapshots()
    old.optimizer.rollback(c)

    t0 = time.perf_counter()
    layer_numels = [(s.layer, s.numel) for s in old.optimizer.layout.layers]
    placement = snapshot_placements(old.plan, ctx.cfg.train.ranks_per_node)[stage]
    new_stage = new_plan.stages[stage]
    remap = None
    specs = new_plan.group_specs() + _snapshot_specs(ctx, new_plan)
    if affected:
        remap = plan_remap(
            layer_numels=layer_numels,
            old_ranks=old_stage.ranks,
            new_ranks=new_stage.ranks,
            failed=failed,
            placement=placement,
        )
        pairs = {tuple(sorted((t.src, t.dst))) for t in remap.transfers if t.src != t.dst}
        specs += [GroupSpec(remap_link_name(a, b), (a, b)) for a, b in sorted(pairs)]
    # Each stage's remap links are created by that stage's survivors only.
    change = old.links.apply(
        specs,
        removed=failed,
        strategy=RebuildStrategy.EDIT,
        generation=new_plan.generation,
        rebuild=lambda spec: spec.name in rebuild,
    )
    comm = old.links.comm
    t1 = time.perf_counter()

    if remap is not None:
        new_layout = InterleavedLayout.build(layer_numels, new_stage.dp)
        state = execute_remap(
            remap,
            rank=ctx.rank,
            old_layout=old.optimizer.layout,
            new_layout=new_layout,
            device_state=old.optimizer.state,
            host_states=host_states,
            link=lambda a, b: comm[remap_link_name(a, b)],
            generation=new_plan.generation,
            step=c,
        )
    else:
        state = old.optimizer.state
    optimizer = _optimizer(ctx, new_plan, comm, state=state, committed_step=c)
    optimizer.all_gather_params()  # every replica's parameters back to the committed step
    t2 = time.perf_counter()

    initial = _exchange_snapshot_states(ctx, new_plan, comm, optimizer, c)
    keepers = _attach_snapshots(ctx, new_plan, comm, optimizer, step=c, initial=initial)
    trainer = Trainer(
        new_plan, old.links, optimizer, _runner(ctx, new_plan, comm, optimizer), keepers
    )
    t3 = time.perf_counter()
    log.info(
        "recovery.applied",
        generation=new_plan.generation,
        committed_step=c,
        reused_groups=change.groups_reused,
        created_groups=change.groups_created,
        created_links=change.links_created,
        affected=affected,
    )
    return trainer, {"comm": t1 - t0, "remap": t2 - t1, "resume": t3 - t2}
