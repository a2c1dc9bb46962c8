"""One pipeline stage replica running a training step under 1F1B.

Activations travel forward and gradients backward along the plan's routes, by sample
offset inside each global micro-batch, so a replica may receive from several ranks
(fan-in) or send to several (fan-out) when adjacent stages have different DP widths.
Sends are non-blocking and waited at the end of the step; receives block with a bounded
timeout. The loss of a micro-batch is the sum of its samples' mean token losses divided
by the global batch, so gradients do not depend on how samples are split among ranks.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from elaswave.comm.communicator import Communicator
from elaswave.comm.group import CollectiveGroup, P2PGroup
from elaswave.comm.spec import MAX_MICRO_BATCHES, TagSpace, p2p_tag
from elaswave.data.corpus import SampleLoader
from elaswave.data.sampler import GlobalBatchSampler
from elaswave.engine.plan import Plan, Route, dp_group_name, link_group_name, pipe_group_name
from elaswave.engine.schedule import GRADIENT_OPS, Action, Op, stage_actions
from elaswave.engine.steptime import split_parts
from elaswave.fabric.zero import ZeroAdamW
from elaswave.model.config import ModelConfig
from elaswave.model.llama import StepContext, layer_index
from elaswave.model.protocol import pipeline_model
from elaswave.model.rng import DropoutRng
from elaswave.runtime.job.faults import StepPhase
from elaswave.runtime.worker.emulation import DelayedSend, Pacer, arrival_stamp, stamp_buffer
from elaswave.runtime.worker.evaluation import HeldOutEval, evaluate
from elaswave.runtime.worker.migration import ShadowStep
from elaswave.runtime.worker.split_backward import HeldWeights, backward_input, backward_weight


@dataclass
class StepResult:
    step: int
    loss_sum: float | None
    """Sum of per-sample losses over the whole global batch (last stage only)."""
    seconds: float
    """The step's time, an evaluation's (``--eval-every``) left out."""
    trace: list[tuple[str, int]] = field(default_factory=list)
    migration: ShadowStep | None = None
    """The non-blocking migration this step completed, if any."""
    pipeline_s: float = 0.0
    """From the step's start to the end of its last action and sends: the pipeline's
    part of the step (what ``engine/steptime`` simulates), before the optimizer step."""
    times: list[tuple[float, float]] = field(default_factory=list)
    """(start, end) of each action of ``trace``, in seconds from the step's start."""
    eval_loss: float | None = None
    """The held-out loss of the step's parameters (last stage, steps that evaluate)."""


def _no_fault(phase: StepPhase, step: int) -> None:
    return None


class LossSum:
    """A step's sum of per-sample losses, kept on the device (float64, so that every
    layout sums the same bits), reduced over the stage's DP group there, and read to the
    host once per step, after the reduction."""

    def __init__(self, device: torch.device) -> None:
        self.total = torch.zeros(1, dtype=torch.float64, device=device)

    def add(self, per_sample: torch.Tensor) -> None:
        """Add a micro-batch's per-sample losses (on the device; no host copy)."""
        self.total += per_sample.detach().double().sum()

    def reduce(self, group: CollectiveGroup) -> None:
        """Sum every replica's total (a device-plane all-reduce)."""
        group.all_reduce(self.total)

    def value(self) -> float:
        """The total on the host (the step's one device-to-host read of it)."""
        return float(self.total)


def share_blocks(ids: Sequence[int], block: int | None) -> list[tuple[int, int]]:
    """[lo, hi) pieces of a share of sample ``ids``, computed one at a time: the whole
    share (``block`` None), or its runs of ``block`` samples cut where a sample id is a
    multiple of ``block`` (the blocks of every layout's micro-batches)."""
    if block is None or not ids:
        return [(0, len(ids))]
    cuts = [i for i in range(1, len(ids)) if ids[i] % block == 0]
    return list(itertools.pairwise([0, *cuts, len(ids)]))


@dataclass
class _Saved:
    """What a micro-batch's forward keeps for its backward: per block of its share
    (:func:`share_blocks`), the stage's input (None on the first stage) and the
    output to run backward from (the loss on the last stage)."""

    layer_ids: list[int]
    pieces: list[tuple[int, int]]
    inputs: list[torch.Tensor | None] = field(default_factory=list)
    outs: list[torch.Tensor] = field(default_factory=list)

    def piece_of(self, grad: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor | None:
        if grad is None or len(self.pieces) == 1:
            return grad
        return grad[lo:hi]

    def input_grad(self) -> torch.Tensor:
        grads = [x.grad for x in self.inputs if x is not None and x.grad is not None]
        if len(grads) != len(self.inputs):
            raise RuntimeError("a block of the stage's input has no gradient")
        return grads[0] if len(grads) == 1 else torch.cat(grads)


class StageRunner:
    def __init__(
        self,
        *,
        plan: Plan,
        rank: int,
        layers: nn.ModuleList,
        optimizer: ZeroAdamW,
        comm: Communicator,
        loader: SampleLoader,
        rng: DropoutRng,
        model: ModelConfig,
        device: torch.device,
        fault_hook: Callable[[StepPhase, int], None] = _no_fault,
        pacer: Pacer | None = None,
        shadow: ShadowStep | None = None,
        bf16: bool = False,
        per_route: bool = False,
        receive_ahead: bool = True,
        actions: Sequence[Action] | None = None,
        evaluation: HeldOutEval | None = None,
        block: int | None = None,
    ) -> None:
        """``evaluation``: the held-out windows to evaluate, and at which steps.
        ``block``: compute every share in blocks of this many samples (aligned on
        sample ids), a fold of the gradients after each, so that a share of several
        blocks sums what the same blocks do as micro-batches of another layout (with
        float64 gradient sums: the same bits); None: a share at once.
        ``actions``: the stage's list where the plan's schedule depends on costs
        (:func:`~elaswave.engine.steptime.plan_lists`; default: :func:`stage_actions` of
        the plan's schedule).
        ``shadow``: a non-blocking layer migration that its step runs (once).
        ``bf16``: compute in bfloat16 (torch autocast; parameters, gradients and the
        optimizer stay fp32) and send activations and their gradients in bfloat16."""
        self.bf16 = bf16
        self.evaluation = evaluation
        self.block = block
        self.per_route = per_route
        """Pipeline traffic takes each route's pair link (gloo) rather than its stage
        boundary's group."""
        self.receive_ahead = receive_ahead
        """Post a micro-batch's receives while the one before it computes (gloo). Not
        where a posted receive parks on the device (NCCL): there a receive waiting for
        a peer blocks its kernel, and any device allocation (cudaMalloc synchronises
        the device) then waits for it, so the forward that would produce what the peer
        waits for never runs: receives are posted when they are needed."""
        self.act_dtype = torch.bfloat16 if bf16 else torch.float32
        self.fault_hook = fault_hook
        self.shadow = shadow
        self.pacer = pacer
        self.plan = plan
        self.rank = rank
        self.stage, self.replica = plan.locate(rank)
        self.layers = layers
        self.optimizer = optimizer
        self.comm = comm
        self.loader = loader
        self.rng = rng
        self.model = model
        user_model = pipeline_model(model)
        self.per_sample_loss = user_model.per_sample_loss  # once, not per micro-batch
        self.backward_autocast = bf16 and user_model.backward_autocast
        """The backward runs under the forward's autocast (see the model protocol)."""
        self.device = device
        self.sampler = GlobalBatchSampler(plan.global_batch, plan.num_micro_batches)
        self.is_first = self.stage == 0
        self.is_last = self.stage == plan.pp - 1
        # Shares and routes repeat with the stages' rotation period: one entry per phase
        # (at most one per micro-batch of the step: a period can exceed it by far).
        here = plan.stages[self.stage]
        before = here.period if self.is_first else plan.stages[self.stage - 1].period
        after = here.period if self.is_last else plan.stages[self.stage + 1].period
        self.period = min(math.lcm(before, here.period, after), plan.num_micro_batches)
        self._share = [here.offsets(mb)[self.replica] for mb in range(self.period)]
        self._inbound: list[list[Route]] = [
            [] if self.is_first else [r for r in plan.routes(self.stage - 1, mb) if r.dst == rank]
            for mb in range(self.period)
        ]
        self._outbound: list[list[Route]] = [
            [] if self.is_last else [r for r in plan.routes(self.stage, mb) if r.src == rank]
            for mb in range(self.period)
        ]
        self.layer_ids = [layer_index(layer) for layer in layers]
        if plan.num_micro_batches > MAX_MICRO_BATCHES:
            raise ValueError(
                f"{plan.num_micro_batches} micro-batches: at most {MAX_MICRO_BATCHES} per step"
            )
        self.schedule = (
            list(actions)
            if actions is not None
            else stage_actions(
                plan.schedule,
                num_stages=plan.pp,
                stage=self.stage,
                num_micro_batches=plan.num_micro_batches,
            )
        )
        self.receives: list[tuple[bool, int]] = [
            (op is not Op.FORWARD, mb)
            for op, mb in self.schedule
            if (op is Op.FORWARD and not self.is_first)
            or (op in (Op.BACKWARD, Op.INPUT) and not self.is_last)
        ]
        """(backward, micro-batch) of the step's receives, in the order they are needed."""
        self.last_backward = max(i for i, (op, _) in enumerate(self.schedule) if op in GRADIENT_OPS)
        """Index in the schedule of the step's last action that adds to the weight
        gradients (``B`` or ``W``), during which the gradient reduction starts
        (:meth:`ZeroAdamW.overlap_reduction`)."""
        self.parts = split_parts(first=self.is_first)
        """The shares of a backward the ``I`` and ``W`` halves compute on this stage."""

    def share(self, mb: int) -> tuple[int, int]:
        """[lo, hi) offsets of this replica's samples in global micro-batch ``mb``."""
        return self._share[mb % self.period]

    def inbound(self, mb: int) -> list[Route]:
        return self._inbound[mb % self.period]

    def outbound(self, mb: int) -> list[Route]:
        return self._outbound[mb % self.period]

    @property
    def idle(self) -> bool:
        """Whether this replica takes no sample of any micro-batch."""
        return all(lo == hi for lo, hi in self._share)

    def sample_ids(self, step: int, mb: int) -> tuple[int, ...]:
        base = step * self.plan.global_batch + mb * self.sampler.micro_batch_samples
        lo, hi = self.share(mb)
        return tuple(range(base + lo, base + hi))

    def _activation(self, rows: int) -> torch.Tensor:
        return torch.empty(
            rows, self.model.seq_len, self.model.hidden_size, dtype=self.act_dtype,
            device=self.device,
        )  # fmt: skip

    def _route_group(self, route: Route, boundary: int, backward: bool) -> P2PGroup:
        """The group ``route`` (between stages ``boundary`` and ``boundary + 1``) takes:
        the boundary's forward or backward group on a device plane of its own; under
        gloo the pooled link of its pair
        (:func:`elaswave.runtime.worker.trainer.own_device_plane`)."""
        if self.per_route:
            return self.comm.p2p(link_group_name(route.src, route.dst))
        return self.comm.group(pipe_group_name(boundary, backward))

    @property
    def stamped(self) -> bool:
        """Whether pipeline messages carry their modelled arrival (a queued emulated
        device: :func:`~elaswave.runtime.worker.emulation.arrival_stamp`). Only there:
        the emulated device trains on gloo, and a stamp is a host tensor, which NCCL's
        rules (device tensors only) would not take."""
        return self.pacer is not None and self.pacer.queued

    def _batches(
        self,
        routes: list[Route],
        tensors: list[list[torch.Tensor]],
        backward: bool,
        receiving: bool,
    ) -> list[tuple[P2PGroup, list[tuple[torch.Tensor, int]]]]:
        """``tensors`` (a list per route: its messages in order) with their peers, by
        group, in route order."""
        upstream = backward != receiving  # the peer is in the stage before this one
        peer_of, boundary = (_src, self.stage - 1) if upstream else (_dst, self.stage)
        by_group: dict[int, tuple[P2PGroup, list[tuple[torch.Tensor, int]]]] = {}
        for route, messages in zip(routes, tensors, strict=True):
            group = self._route_group(route, boundary, backward)
            ops = by_group.setdefault(id(group), (group, []))[1]
            ops.extend((tensor, peer_of(route)) for tensor in messages)
        return list(by_group.values())

    def post_recv(self, step: int, backward: bool, mb: int, tag: int | None = None) -> tuple:
        """Post the receives of micro-batch ``mb``'s activations (``backward``: their
        gradients), one per route in sample order (each with its arrival stamp where
        :attr:`stamped`), as one batch per group, with ``tag`` (default: the step's for
        ``mb``); :meth:`_Receives.take` waits. Returns the batches, the buffers and the
        stamps' buffers."""
        routes = sorted(self.outbound(mb) if backward else self.inbound(mb), key=lambda r: r.lo)
        bufs = [self._activation(route.hi - route.lo) for route in routes]
        stamps = [stamp_buffer() for _ in routes] if self.stamped else []
        tag = self.tag(step, mb, backward) if tag is None else tag
        messages = (
            [[b, s] for b, s in zip(bufs, stamps, strict=True)] if stamps else [[b] for b in bufs]
        )
        batches = self._batches(routes, messages, backward, receiving=True)
        return [(group, group.batch([], ops, tag)) for group, ops in batches], bufs, stamps

    def send(
        self,
        tensor: torch.Tensor,
        routes: list[Route],
        lo: int,
        backward: bool,
        tag: int,
        pending: list,
    ) -> None:
        """Send the rows of ``tensor`` (samples from offset ``lo``) along ``routes``, as
        one batch per group (an emulated device paces each route's send by itself)."""
        chunks = [[tensor[r.lo - lo : r.hi - lo].contiguous()] for r in routes]
        for group, sends in self._batches(routes, chunks, backward, receiving=False):
            if self.pacer is None or not self.pacer.emulated:
                pending.append((group, group.batch(sends, [], tag), sends))
                continue
            for chunk, peer in sends:
                delay = self.pacer.send_delay(chunk.numel() * chunk.element_size())
                ops = [(chunk, peer)]
                if self.stamped:
                    ops.append((arrival_stamp(time.perf_counter() + delay), peer))
                post = lambda g=group, o=ops: g.batch(o, [], tag)  # noqa: E731
                pending.append((group, DelayedSend(post, delay), ops))

    def run_step(self, step: int) -> StepResult:
        started = time.perf_counter()
        trace: list[tuple[str, int]] = []
        pending: list[tuple] = []
        saved: dict[int, _Saved] = {}
        held: dict[int, tuple[list[HeldWeights], list[int]]] = {}
        loss_sum = LossSum(self.device)
        if self.pacer is not None:
            self.pacer.begin_step()
        self.optimizer.zero_grad()
        shadow = self.shadow if self.shadow is not None and self.shadow.step == step else None
        times: list[tuple[float, float]] = []
        if not self.idle:
            inbox = _Receives(self, step)
            for index, (op, mb) in enumerate(self.schedule):
                trace.append((op.value, mb))
                begun = time.perf_counter()
                if op is Op.FORWARD:
                    saved[mb] = self._forward(step, mb, pending, loss_sum, shadow, inbox)
                else:
                    if index == self.last_backward and shadow is None:
                        # (a migration's paybacks change gradients after the backward)
                        self.optimizer.overlap_reduction()
                    self._run_backward(step, op, mb, saved, held, pending, inbox, shadow)
                times.append(self._timed(begun, started))
        if shadow is not None:
            shadow.finish()  # paybacks merged before the gradients are reduced
            self.shadow = None
        if self.pacer is not None:
            self.pacer.drain()
        for group, work, _ in pending:
            if isinstance(work, DelayedSend):
                work = work.work(self.optimizer.dp_group.timeout.total_seconds())
            group.wait_send(work)
        pipeline_s = time.perf_counter() - started
        self.fault_hook(StepPhase.GRAD_SYNC, step)
        synced = time.perf_counter()
        self.optimizer.step(step, hook=lambda phase: self.fault_hook(StepPhase(phase), step))
        if self.pacer is not None:
            grads = self.optimizer
            self.pacer.collectives(grads.grad_reduce_bytes, grads.layout.dp, synced)
        total = None
        if self.is_last:
            loss_sum.reduce(self.comm.collective(dp_group_name(self.stage)))
            total = loss_sum.value()
        heldout = self.evaluation
        evaluated = (
            evaluate(self, heldout, step) if heldout is not None and heldout.due(step) else None
        )
        self.optimizer.commit(step)
        return StepResult(
            step, total, time.perf_counter() - started - (evaluated.seconds if evaluated else 0),
            trace, shadow, pipeline_s, times,
            eval_loss=evaluated.loss if evaluated else None,
        )  # fmt: skip

    def _timed(self, begun: float, started: float) -> tuple[float, float]:
        """An action's interval in the step begun at ``started``: the host's, from
        ``begun``; on a queued emulated device, when the device ran it."""
        pacer = self.pacer
        lo, hi = (
            pacer.take_span()
            if pacer is not None and pacer.queued
            else (begun, time.perf_counter())
        )
        return lo - started, hi - started

    def _run_backward(
        self, step: int, op: Op, mb: int, saved: dict, held: dict, pending: list,
        inbox: _Receives, shadow: ShadowStep | None,
    ) -> None:  # fmt: skip
        """One backward action of micro-batch ``mb``: ``B``, or the ``I`` or ``W`` half."""
        if op is Op.INPUT:
            held[mb] = self._input(step, mb, saved.pop(mb), pending, inbox)
            return
        if op is Op.WEIGHT:
            self._weight(step, mb, *held.pop(mb))
        else:
            self._backward(step, mb, saved.pop(mb), pending, inbox)
        if shadow is not None:
            shadow.after_backward(mb)

    def tag(self, step: int, mb: int, backward: bool) -> int:
        return p2p_tag(self.plan.generation, step, TagSpace.PIPELINE + 2 * mb + int(backward))

    def _forward(
        self,
        step: int,
        mb: int,
        pending: list,
        loss_sum: LossSum,
        shadow: ShadowStep | None,
        inbox: _Receives,
    ) -> _Saved:
        ids = self.sample_ids(step, mb)
        if self.is_first:
            inputs, _ = self.loader.batch(ids)
            x_in = None
            x = inputs.to(self.device)
        else:
            x_in = inbox.take(False, mb)
            x_in.requires_grad_()
            x = x_in
        layers, layer_ids = (
            (self.layers, self.layer_ids) if shadow is None else shadow.layers_for(mb)
        )
        started = time.perf_counter()
        pieces = share_blocks(ids, self.block)
        saved = _Saved(layer_ids, pieces)
        outs = []
        for lo, hi in pieces:
            xb = x if len(pieces) == 1 else x[lo:hi]
            if x_in is not None and len(pieces) > 1:
                xb = xb.detach().requires_grad_()  # a leaf a block: its own backward
            saved.inputs.append(xb if x_in is not None else None)
            ctx = StepContext(step=step, sample_ids=ids[lo:hi], rng=self.rng)
            y = self._layers(layers, xb, ctx)
            if self.is_last:
                _, targets = self.loader.batch(ids[lo:hi])
                per_sample = self.per_sample_loss(y, targets.to(self.device))
                loss_sum.add(per_sample)
                saved.outs.append(per_sample.sum() / self.plan.global_batch)
            else:
                saved.outs.append(y)
            outs.append(y)
        if mb == 0:
            self.fault_hook(StepPhase.FORWARD, step)
        if self.pacer is not None:
            self.pacer.compute(layer_ids, len(ids), started, backward=False)
        if not self.is_last:
            x = outs[0] if len(outs) == 1 else torch.cat(outs)
            self.send(
                x.detach(), self.outbound(mb), self.share(mb)[0], False,
                self.tag(step, mb, False), pending,
            )  # fmt: skip
        return saved

    def _layers(
        self, layers: Iterable[nn.Module], x: torch.Tensor, ctx: StepContext
    ) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            for layer in layers:
                x = layer(x, ctx)
        if not self.is_last:
            x = x.to(self.act_dtype)  # what the next stage receives, and its gradient
        return x

    def _backward(self, step: int, mb: int, saved: _Saved, pending: list, inbox: _Receives) -> None:
        grad = None if self.is_last else inbox.take(True, mb)
        started = time.perf_counter()
        with self._backward_context():
            for out, (lo, hi) in zip(saved.outs, saved.pieces, strict=True):
                torch.autograd.backward(out, saved.piece_of(grad, lo, hi))
                self.optimizer.fold()
        if self.pacer is not None:
            lo, hi = self.share(mb)
            self.pacer.compute(saved.layer_ids, hi - lo, started, backward=True)
        if mb == 0:
            self.fault_hook(StepPhase.BACKWARD, step)
        self._send_input_grad(step, mb, saved, pending)

    def _send_input_grad(self, step: int, mb: int, saved: _Saved, pending: list) -> None:
        if saved.inputs[0] is not None:
            self.send(
                saved.input_grad(), self.inbound(mb), self.share(mb)[0], True,
                self.tag(step, mb, True), pending,
            )  # fmt: skip

    def _input(
        self, step: int, mb: int, saved: _Saved, pending: list, inbox: _Receives
    ) -> tuple[list[HeldWeights], list[int]]:
        """``I``: the input gradient of micro-batch ``mb``, sent to the previous stage at
        once; what ``W`` needs is kept."""
        grad = None if self.is_last else inbox.take(True, mb)
        started = time.perf_counter()
        held = []
        with self._backward_context():
            for out, x_in, (lo, hi) in zip(saved.outs, saved.inputs, saved.pieces, strict=True):
                grad_b = saved.piece_of(grad, lo, hi)
                held.append(backward_input(out, grad_b, x_in, self.optimizer.accumulated))
                self.optimizer.fold()
        self._paced(mb, saved.layer_ids, started, self.parts[0])
        if mb == 0:
            self.fault_hook(StepPhase.BACKWARD, step)
        self._send_input_grad(step, mb, saved, pending)
        return held, saved.layer_ids

    def _weight(self, step: int, mb: int, held: list[HeldWeights], layer_ids: list[int]) -> None:
        """``W``: the weight gradients of micro-batch ``mb``."""
        started = time.perf_counter()
        with self._backward_context():
            for piece in held:
                backward_weight(piece, self.optimizer.accumulated)
                self.optimizer.fold()
        self._paced(mb, layer_ids, started, self.parts[1])
        if mb == 0:
            self.fault_hook(StepPhase.WEIGHT, step)

    def _backward_context(self) -> contextlib.AbstractContextManager:
        if not self.backward_autocast:  # every model but megatron's: nothing to enter
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def _paced(self, mb: int, layer_ids: list[int], started: float, part: float) -> None:
        if self.pacer is not None and part > 0:
            lo, hi = self.share(mb)
            self.pacer.compute(layer_ids, hi - lo, started, backward=True, part=part)


def _src(route: Route) -> int:
    return route.src


def _dst(route: Route) -> int:
    return route.dst


class _Receives:
    """A step's receives, each micro-batch's posted as one batch while the one before it
    is waited for, so that a micro-batch's activations (or gradients) arrive while the
    previous micro-batch computes instead of after the receiver asks for them. At most
    two are posted at a time (one, posted when taken, without ``receive_ahead``). A step
    that is abandoned leaves its posted receives unmatched: under gloo their tags carry
    the step and the plan generation (and their groups hold them:
    :mod:`elaswave.comm.posted`); under NCCL their groups are aborted and rebuilt
    (:mod:`elaswave.comm.release`)."""

    def __init__(self, runner: StageRunner, step: int) -> None:
        self.runner = runner
        self.step = step
        self.posted: dict[tuple[bool, int], tuple] = {}
        self.next = 0
        """Index in ``runner.receives`` of the next receive to post."""
        if runner.receive_ahead:
            self._post_next()

    def _post_next(self) -> None:
        order = self.runner.receives
        if self.next < len(order):
            key = order[self.next]
            self.next += 1
            self.posted[key] = self.runner.post_recv(self.step, *key)

    def take(self, backward: bool, mb: int) -> torch.Tensor:
        """Wait for micro-batch ``mb``'s activations (``backward``: their gradients),
        after posting the next receive."""
        key = (backward, mb)
        while key not in self.posted and self.next < len(self.runner.receives):
            self._post_next()
        if self.runner.receive_ahead:
            self._post_next()
        works, parts, stamps = self.posted.pop(key)
        began = time.perf_counter()
        for group, work in works:
            group.wait_recv(work)
        if self.runner.pacer is not None:
            self.runner.pacer.received(began, stamps)
        return torch.cat(parts) if len(parts) > 1 else parts[0]
