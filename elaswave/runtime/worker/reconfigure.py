"""How a new plan turns one trainer into the next: :func:`reconfigure`, the recovery
executor for every kind of change (a failure, a join, a rebalance), in named phases:
roll back to the committed step, plan the state moves, edit the communicator (only the
groups and links the change touched), start a non-blocking migration's shadow step,
move optimizer shards (live remap of failed ranks' shards, migrating layers), gather
parameters, then re-place snapshots, set the stage clock and rebuild the runner
(:func:`resume`). When state was lost, :func:`restore` applies the plan from the disk
checkpoint instead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

import structlog
import torch
import torch.distributed as dist
from torch import nn

from elaswave.comm.communicator import Communicator
from elaswave.comm.dynamic import ChangeStats, DynamicCommunicator
from elaswave.comm.links import pair
from elaswave.comm.spec import GroupSpec, TagSpace, p2p_tag
from elaswave.comm.store import fresh_client
from elaswave.engine.change import Applied
from elaswave.engine.migration import BLOCKING, NONBLOCKING, Transition, plan_transition
from elaswave.engine.plan import (
    Plan,
    StagePlan,
)
from elaswave.engine.state_moves import changed_stages, plan_state_moves
from elaswave.fabric.adamw import ShardState
from elaswave.fabric.checkpoint import piece_dir
from elaswave.fabric.hostplane import as_host, host_empty
from elaswave.fabric.layout import InterleavedLayout
from elaswave.fabric.placement import snapshot_link_name
from elaswave.fabric.remap import (
    FP32_BYTES,
    STATE_TENSORS,
    RemapPlan,
)
from elaswave.fabric.remap_exec import execute_remap, remap_link_name
from elaswave.fabric.zero import ZeroAdamW
from elaswave.model.llama import layer_index
from elaswave.model.protocol import pipeline_model
from elaswave.runtime.worker.holders import owner_decay_mask, owner_layout, placement_of
from elaswave.runtime.worker.memento import Memento
from elaswave.runtime.worker.migration import ShadowStep, migration_pairs
from elaswave.runtime.worker.trainer import (
    Trainer,
    WorkerContext,
    attach_snapshots,
    build_optimizer,
    build_runner,
    device_plane,
    device_specs,
    host_specs,
    load_checkpoint,
    own_device_plane,
)

log = structlog.get_logger(__name__)


def _exchange_snapshot_states(
    ctx: WorkerContext,
    plan: Plan,
    comm: Communicator,
    optimizer: ZeroAdamW,
    step: int,
) -> dict[int, ShardState]:
    """Owners send their full committed shard to their (new) holders (host-plane
    traffic: the holders' snapshots are host memory)."""
    placement = placement_of(ctx.cfg, plan)
    tag = p2p_tag(plan.generation, step, TagSpace.SNAPSHOT_STATE)
    pending = []
    holders = placement.holders_of(ctx.rank)
    if holders:
        s = optimizer.state
        payload = as_host(torch.stack([s.master, s.exp_avg, s.exp_avg_sq]))
        for holder in holders:
            group = comm.p2p(snapshot_link_name(ctx.rank, holder))
            pending.append((group, group.isend(payload, holder, tag)))
    received = {}
    for owner in placement.holds(ctx.rank):
        layout, _ = owner_layout(ctx.cfg, plan, owner)
        buf = host_empty((3, layout.shard_numel))
        comm.p2p(snapshot_link_name(owner, ctx.rank)).recv(buf, owner, tag)
        received[owner] = ShardState(
            buf[0].clone(), buf[1].clone(), buf[2].clone(), owner_decay_mask(ctx.cfg, plan, owner)
        )
    for group, work in pending:
        group.wait_send(work)
    return received


def resume(
    ctx: WorkerContext,
    plan: Plan,
    links: DynamicCommunicator,
    device: Communicator,
    layers: nn.ModuleList,
    optimizer: ZeroAdamW,
    committed_step: int,
    shadow: ShadowStep | None = None,
) -> Trainer:
    """The last phase of every change: snapshots re-placed from the owners' committed
    shards, the stage's clock set (DVFS), and a runner for the plan (which runs the
    transition step of a non-blocking migration, if any)."""
    comm = links.comm
    initial = _exchange_snapshot_states(ctx, plan, comm, optimizer, committed_step)
    keepers = attach_snapshots(ctx, plan, comm, optimizer, step=committed_step, initial=initial)
    if ctx.pacer.frequency is not None:  # DVFS: the stage's planned clock
        stage, _ = plan.locate(ctx.rank)
        ctx.pacer.frequency.set_mhz(0, plan.stages[stage].mhz or ctx.cfg.cost_device.base_mhz)
    runner = build_runner(ctx, plan, device, layers, optimizer, shadow)
    return Trainer(plan, links, device, optimizer, runner, layers, keepers)


def _bytes_received(moves: RemapPlan, rank: int) -> int:
    """Optimizer-state bytes ``rank`` receives from other ranks under ``moves``."""
    numel = sum(t.numel for t in moves.transfers if t.dst == rank and t.src != rank)
    return numel * STATE_TENSORS * FP32_BYTES


def _stage_layers(ctx: WorkerContext, held: nn.ModuleList, layer_ids: range) -> nn.ModuleList:
    """This rank's layer modules for ``layer_ids``: kept ones as they are, new ones built
    (their parameters arrive through the optimizer's all-gather)."""
    have = {layer_index(layer): layer for layer in held}
    return nn.ModuleList(
        have[i]
        if i in have
        else pipeline_model(ctx.cfg.model)
        .build_layer(i, seed=ctx.cfg.schedule.seed, tp=ctx.tp_shard)
        .to(ctx.device)
        for i in layer_ids
    )


def reconfigure(
    ctx: WorkerContext,
    old: Trainer | None,
    kept: Memento | None,
    base: Plan,
    new_plan: Plan,
    failed: set[int],
    committed_step: int,
    *,
    rebuild: set[str],
    migration: str,
    store: dist.Store | None = None,
) -> tuple[Trainer, Applied]:
    """The recovery executor: apply ``new_plan`` on this rank, which trains under ``base``
    (``old``, rolled back to ``committed_step`` and kept as ``kept``: :func:`~elaswave.
    runtime.worker.memento.keep`), or joins the job (``old`` and ``kept`` None: an empty
    trainer, no groups, no layers, no optimizer state; ``store``: where it builds its
    groups, default ``ctx.comm_store``).

    One pass for any change of plan: ranks that failed (their shards rebuilt from host
    snapshots), ranks that join (their shards sent by the owners), micro-batch resizing,
    layers migrating between stages (their optimizer state moves as D disjoint shard
    sends under the interleaved layout) and stage clocks (DVFS). Edit the communicator
    (a joiner builds its groups), move optimizer state, gather parameters, re-place
    snapshots, set the clock, and rebuild the runner. Returns the new trainer and the
    phase times (and bytes moved), as the rank reports them in its RecoveryDone.

    Migrating layers' parameters move *blocking* (gathered from the moved optimizer
    state before resuming) or *non-blocking* (streamed during the transition step while
    the source computes a shadow for the early micro-batches, see
    :mod:`elaswave.engine.migration`): ``migration``, the mode the Core decided and
    announced (:func:`elaswave.runtime.job.inputs.decide_migration`).
    """
    a = _Change(ctx=ctx, kept=kept, base=base, new=new_plan, failed=frozenset(failed),
                committed_step=committed_step)  # fmt: skip
    t0 = time.perf_counter()
    moves, transition = _plan_moves(a, migration)
    links, change = _edit_communicator(a, old, moves, transition, rebuild, store)
    device, device_reused = _edit_device_plane(a, old, links, rebuild, store)
    t1 = time.perf_counter()
    held = kept.layers if kept is not None else nn.ModuleList()
    layers = _stage_layers(ctx, held, a.stage.layers)
    shadow = _start_shadow(a, transition, held, layers, links.comm)
    optimizer, bytes_sent = _move_optimizer_state(
        a, moves, _host_states(a), layers, (links.comm, device), t1
    )
    t_params = time.perf_counter()
    _gather_params(a, optimizer, shadow, held, t_params)
    t2 = time.perf_counter()
    trainer = resume(ctx, new_plan, links, device, layers, optimizer, committed_step, shadow)
    t3 = time.perf_counter()
    log.info(
        "recovery.applied",
        generation=new_plan.generation,
        committed_step=committed_step,
        joined=old is None,
        reused_groups=change.groups_reused,
        created_groups=change.groups_created,
        created_links=change.links_created,
        device_groups=len(device),
        device_reused=device_reused,
        bytes_sent=bytes_sent,
        migration=migration,
    )
    applied = Applied(comm_s=t1 - t0, remap_s=t2 - t1, resume_s=t3 - t2,
                      bytes_sent=bytes_sent, params_s=t2 - t_params)  # fmt: skip
    return trainer, applied


def roll_back(
    ctx: WorkerContext,
    current: Trainer | None,
    kept: Memento,
    base: Plan,
    new_plan: Plan,
    failed: set[int],
    committed_step: int,
) -> tuple[Trainer, Applied]:
    """Apply ``new_plan`` from what this rank kept before a torn apply (``kept``, under
    ``base``: the layout taken back): the Core rolled the torn plan back, and plans
    from the layout before it with every rank it lost. ``current``: this rank's trainer
    under the torn plan, if its own apply finished (dropped: its device groups are
    aborted). Both planes are built afresh on a new store connection (an apply torn
    mid-way left groups in no known state, and may hold the old connection in a
    creation's wait); layers move blocking. Then as :func:`reconfigure`."""
    if kept.step != committed_step or kept.state is None:
        raise RuntimeError(
            f"the plan of generation {new_plan.generation} rolls back to step "
            f"{committed_step}, and rank {ctx.rank} kept "
            + ("no state" if kept.state is None else f"step {kept.step}")
            + ": planners disagree"
        )
    drop(current)
    trainer, applied = reconfigure(
        ctx, None, kept, base, new_plan, failed, committed_step,
        rebuild=set(), migration=BLOCKING, store=fresh_client(ctx.comm_store),
    )  # fmt: skip
    log.warning("recovery.rolled_back", generation=new_plan.generation, step=committed_step)
    return trainer, applied


def drop(trainer: Trainer | None) -> None:
    """Stop ``trainer``'s work and abort its device groups (where work parks, every one)."""
    if trainer is not None:
        trainer.close_snapshots()
        trainer.optimizer.abandon()
        trainer.device.release(trainer.plan.ranks)


@dataclass(frozen=True, kw_only=True)
class _Change:
    """One plan change on this rank: what every phase of :func:`reconfigure` reads."""

    ctx: WorkerContext
    kept: Memento | None
    """What this rank committed under ``base``; None: this rank joins."""
    base: Plan
    new: Plan
    failed: frozenset[int]
    committed_step: int

    @property
    def stage_index(self) -> int:
        return self.new.locate(self.ctx.rank)[0]

    @property
    def stage(self) -> StagePlan:
        """This rank's stage under the new plan."""
        return self.new.stages[self.stage_index]


def _host_states(a: _Change) -> dict[int, ShardState]:
    """The host snapshots this rank holds of failed owners, at the committed step."""
    if a.kept is None:
        return {}
    timeout = a.ctx.cfg.liveness.comm_timeout_s
    return {o: a.kept.snapshot(o, timeout) for o in sorted(a.failed & a.kept.holds())}


def _plan_moves(a: _Change, migration: str) -> tuple[RemapPlan, Transition | None]:
    """Which optimizer shards move, and the transition step of a non-blocking migration."""
    cfg = a.ctx.cfg
    moves = plan_state_moves(
        a.base,
        a.new,
        a.failed,
        numels=a.ctx.numels,
        ranks_per_node=cfg.layout.units_per_node,
        snapshots=cfg.state.snapshots,
        copies=cfg.state.snapshot_copies,
    )
    if migration != NONBLOCKING:
        return moves, None
    transition = plan_transition(
        a.base, a.new, layers=cfg.layer_costs, device=cfg.cost_device,
        early=cfg.elastic.migration_early,
    )  # fmt: skip
    if transition is None or a.kept is None:
        raise RuntimeError(
            f"the plan of generation {a.new.generation} migrates layers non-blocking, "
            "but this rank finds no transition (or joins): planners disagree"
        )
    return moves, transition


def _edit_communicator(
    a: _Change,
    old: Trainer | None,
    moves: RemapPlan,
    transition: Transition | None,
    rebuild: set[str],
    store: dist.Store | None,
) -> tuple[DynamicCommunicator, ChangeStats]:
    """The new plan's groups and the links the moves need: edited in place (only what the
    change touched), or built afresh on ``store`` (a joiner; a roll-back)."""
    ctx = a.ctx
    pairs = {pair(t.src, t.dst) for t in moves.transfers if t.src != t.dst}
    if transition is not None:
        pairs |= migration_pairs(transition)
    specs = host_specs(ctx, a.new)
    specs += [GroupSpec(remap_link_name(x, y), (x, y)) for x, y in sorted(pairs)]
    if old is None:
        links = DynamicCommunicator(
            store or ctx.comm_store, ctx.rank, ctx.host_backend, timeout=ctx.timeout,
            generation=a.new.generation, abort=ctx.abort,
        )  # fmt: skip
        return links, links.build(specs)
    links = old.links
    change = links.apply(
        specs,
        removed=a.failed,
        generation=a.new.generation,
        rebuild=lambda spec: spec.name in rebuild,
    )
    return links, change


def _edit_device_plane(
    a: _Change,
    old: Trainer | None,
    links: DynamicCommunicator,
    rebuild: set[str],
    store: dist.Store | None,
) -> tuple[Communicator, int]:
    """The new plan's device groups: unchanged ones reused unless some member reported
    them tainted (work in flight under NCCL, an unfinished collective), the others
    created under the new generation (a joiner builds them all); under gloo the dynamic
    communicator's, edited already. Returns the plane and the groups reused."""
    if old is None or not own_device_plane(a.ctx):
        return device_plane(a.ctx, a.new, links, store), 0
    return old.device.edit(
        device_specs(a.ctx, a.new),
        generation=a.new.generation,
        rebuild=lambda spec: spec.name in rebuild,
    )


def _start_shadow(
    a: _Change,
    transition: Transition | None,
    held: nn.ModuleList,
    layers: nn.ModuleList,
    comm: Communicator,
) -> ShadowStep | None:
    """A non-blocking migration's transition step: outgoing layers keep computing as
    shadows while their parameters stream to the targets (started now, so the streams
    overlap the rest of the recovery and the step)."""
    if transition is None or a.kept is None:
        return None
    have = {layer_index(layer): layer for layer in held}
    outgoing = [i for i in a.base.stages[a.stage_index].layers if i not in a.stage.layers]
    shadow = ShadowStep(
        transition=transition,
        rank=a.ctx.rank,
        step=a.committed_step + 1,
        old_plan=a.base,
        new_plan=a.new,
        modules={layer_index(layer): layer for layer in layers},
        shadows={i: have[i] for i in outgoing},
        comm=comm,
        pacer=a.ctx.pacer,
        timeout_s=a.ctx.cfg.liveness.comm_timeout_s,
    )
    shadow.start()
    return shadow


def _move_optimizer_state(
    a: _Change,
    moves: RemapPlan,
    host_states: dict[int, ShardState],
    layers: nn.ModuleList,
    planes: tuple[Communicator, Communicator],
    started: float,
) -> tuple[ZeroAdamW, int]:
    """Live remap: the optimizer shards this rank's stage needs under the new plan, from
    their owners or from host snapshots of failed owners; returns the new optimizer and
    the bytes this rank sent. Every survivor runs it: a rank whose stage does not change
    may still be a source. ``planes``: the host plane (the remap's links) and the device
    plane (the optimizer's DP group)."""
    ctx, kept = a.ctx, a.kept
    comm, device = planes
    old_layout = InterleavedLayout(dp=1, layers=())  # a joiner owned nothing
    if kept is not None and kept.layout is not None:
        old_layout = kept.layout
    moved_in = a.stage_index in changed_stages(a.base, a.new)
    new_layout = (
        InterleavedLayout.build([(i, ctx.numels[i]) for i in a.stage.layers], a.stage.dp)
        if moved_in
        else old_layout
    )
    result = execute_remap(
        moves,
        rank=ctx.rank,
        old_layout=old_layout,
        new_layout=new_layout,
        device_state=kept.state if kept is not None else None,
        host_states=host_states,
        host_layouts={o: owner_layout(ctx.cfg, a.base, o)[0] for o in host_states},
        link=lambda x, y: comm.p2p(remap_link_name(x, y)),
        generation=a.new.generation,
        step=a.committed_step,
        device=ctx.device,
    )
    if moved_in:
        state = result.state
    else:
        assert kept is not None  # a joiner's stage gains it
        assert kept.state is not None  # a change that restores builds every shard anew
        state = kept.state
    optimizer = build_optimizer(
        ctx, a.new, device, layers, state=state, committed_step=a.committed_step
    )
    # Modelled time of this rank's optimizer-state moves (the emulated device only).
    ctx.pacer.transfer(max(result.bytes_sent, _bytes_received(moves, ctx.rank)), started)
    return optimizer, result.bytes_sent


def _gather_params(
    a: _Change,
    optimizer: ZeroAdamW,
    shadow: ShadowStep | None,
    held: nn.ModuleList,
    started: float,
) -> None:
    """Every replica's parameters at the committed step: all-gathered from the moved
    optimizer state, or, under a non-blocking migration, kept for the layers that stay
    and streamed in for the incoming ones (the step waits for them)."""
    c = a.committed_step
    if shadow is not None:
        optimizer.params_step = None if shadow.waiting else c
        shadow.on_ready = partial(setattr, optimizer, "params_step", c)
        return
    optimizer.all_gather_params()
    kept = {layer_index(layer) for layer in held}
    incoming = [i for i in a.stage.layers if i not in kept]
    a.ctx.pacer.transfer(sum(a.ctx.numels[i] * FP32_BYTES for i in incoming), started)


def restore(
    ctx: WorkerContext,
    old: Trainer | None,
    base: Plan,
    new_plan: Plan,
    failed: set[int],
    step: int,
) -> tuple[Trainer, Applied]:
    """Apply ``new_plan`` from the disk checkpoint of ``step`` (state was lost, so the
    job restores it inside the running processes): the rank's optimizer state and
    snapshots are dropped, the communicator edited as for any change, and the stage's
    layers, optimizer shard and held snapshots loaded from the checkpoint, which is
    layout-independent (:mod:`elaswave.fabric.checkpoint`). The steps after ``step``
    are trained again.

    Every participant builds both planes afresh (``old``'s device groups aborted): a
    participant whose apply of the last plan was torn holds groups in no known state,
    so none is reused; restores are rare, and this keeps them simple."""
    stage = new_plan.stages[new_plan.locate(ctx.rank)[0]]
    drop(old)
    t0 = time.perf_counter()
    # A new connection to the store: a group creation a torn apply abandoned (its peer
    # dead) may still hold the worker's own in a wait until the store's timeout.
    store = fresh_client(ctx.comm_store)
    links = DynamicCommunicator(
        store, ctx.rank, ctx.host_backend, timeout=ctx.timeout,
        generation=new_plan.generation, abort=ctx.abort,
    )  # fmt: skip
    links.build(host_specs(ctx, new_plan))
    device = device_plane(ctx, new_plan, links, store)
    t1 = time.perf_counter()
    held = old.layers if old is not None else nn.ModuleList()
    layers = _stage_layers(ctx, held, stage.layers)
    ckpt = piece_dir(ctx.run_dir, step, ctx.member, ctx.cfg.layout.tp)
    optimizer, initial = load_checkpoint(ctx, new_plan, device, layers, ckpt, step)
    t2 = time.perf_counter()
    keepers = attach_snapshots(ctx, new_plan, links.comm, optimizer, step=step, initial=initial)
    if ctx.pacer.frequency is not None:  # DVFS: the stage's planned clock
        ctx.pacer.frequency.set_mhz(0, stage.mhz or ctx.cfg.cost_device.base_mhz)
    runner = build_runner(ctx, new_plan, device, layers, optimizer)
    t3 = time.perf_counter()
    log.warning("recovery.restored", generation=new_plan.generation, step=step, joined=old is None)
    applied = Applied(comm_s=t1 - t0, remap_s=t2 - t1, resume_s=t3 - t2, params_s=t2 - t1)
    return Trainer(new_plan, links, device, optimizer, runner, layers, keepers), applied
