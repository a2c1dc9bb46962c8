"""ZeRO-1 AdamW over the interleaved layout.

Each DP rank keeps fp32 master weights and Adam moments for its shard only. A step is
reduce-scatter of the stage's gradient bucket (rank j receives the sum of shard j of
every layer), a local AdamW update of the shard, and an all-gather of the updated shards
into every replica's full parameters, with :func:`~elaswave.fabric.adamw.adamw_update`,
which a snapshot holder applies to its host copy too.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from elaswave.comm.group import CollectiveGroup, CollectiveWork
from elaswave.comm.idle import IDLE, IdleTask
from elaswave.fabric.adamw import (
    GradReduceDtype,
    OptimizerConfig,
    ShardState,
    adamw_update,
    recyclable,
)
from elaswave.fabric.clip import GradClip
from elaswave.fabric.layout import InterleavedLayout
from elaswave.fabric.tied import TiedGrad


class SnapshotSink(Protocol):
    cpu_s: float

    def send(self, grad_shard: torch.Tensor, step: int) -> None: ...

    def wait_delivered(self, timeout_s: float) -> None:
        """Return once the holder has every gradient sent (before the all-gather)."""
        ...

    def flush(self, timeout_s: float) -> None: ...

    def close(self) -> None: ...


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.zeros(0)


class _GradBuffer:
    """The stage's gradients in one flat buffer, layer after layer, each layer's padded
    to D shards (``[D, shard]``, row j for replica j), the parameters' ``.grad`` views
    into it: backward accumulates in place, and each layer's rows are ready for a
    reduce-scatter with no copy."""

    def __init__(
        self,
        params: list[list[nn.Parameter]],
        layout: InterleavedLayout,
        like: torch.Tensor,
        sums: torch.dtype | None = None,
    ) -> None:
        dp = layout.dp
        self.flat = torch.zeros(dp * layout.shard_numel, dtype=like.dtype, device=like.device)
        self.layers: list[torch.Tensor] = []
        self.views: list[list[torch.Tensor | None]] = []
        self.sums = None if sums is None else torch.zeros_like(self.flat, dtype=sums)
        """The gradients folded so far, in ``sums``'s wider type (see :meth:`fold`)."""
        self.sum_layers: list[torch.Tensor] = []
        for ps, (_, lo, hi) in zip(params, layout.shard_slices(), strict=True):
            layer = self.flat[dp * lo : dp * hi]
            self.layers.append(layer)
            if self.sums is not None:
                self.sum_layers.append(self.sums[dp * lo : dp * hi])
            views: list[torch.Tensor | None] = []
            offset = 0
            for p in ps:
                n = p.numel()
                ok = p.dtype == like.dtype and p.device == like.device
                views.append(layer[offset : offset + n].view_as(p) if ok else None)
                offset += n
            self.views.append(views)
        self._offsets = [
            list(itertools.accumulate((p.numel() for p in ps), initial=0)) for ps in params
        ]

    def zero(self) -> None:
        self.flat.zero_()
        if self.sums is not None:
            self.sums.zero_()

    def fold(self, params: list[list[nn.Parameter]]) -> None:
        """Add the gradients accumulated since the last fold to :attr:`sums` and zero
        them. Folded after every backward action, the sums take one micro-batch's
        gradient at a time; in float64 those sums of float32 gradients are exact (short
        of a 29-bit spread of magnitudes), so their order does not change a bit."""
        assert self.sums is not None
        for index, ps in enumerate(params):
            self.collect(index, ps)
        self.sums.add_(self.flat)
        self.flat.zero_()
        self.install(params)

    def sum_view(self, layer: int, param: int, like: torch.Tensor) -> torch.Tensor:
        """Parameter ``param`` of layer ``layer`` in :attr:`sums`."""
        lo = self._offsets[layer][param]
        return self.sum_layers[layer][lo : lo + like.numel()].view_as(like)

    def install(self, params: list[list[nn.Parameter]]) -> None:
        for ps, views in zip(params, self.views, strict=True):
            for p, view in zip(ps, views, strict=True):
                p.grad = view

    def collect(self, index: int, params: list[nn.Parameter]) -> None:
        """Bring layer ``index``'s gradients into the buffer where they are not there
        already (a ``.grad`` replaced or reset since :meth:`install`)."""
        offset = 0
        layer = self.layers[index]
        for p, view in zip(params, self.views[index], strict=True):
            n = p.numel()
            grad = p.grad
            if grad is None:
                layer[offset : offset + n].zero_()
            elif grad is not view:
                layer[offset : offset + n].copy_(grad.detach().reshape(-1))
            offset += n


@dataclass
class _Reduction:
    """The reduce-scatter of one step's gradients, layer by layer (see
    :meth:`ZeroAdamW.overlap_reduction`)."""

    out: torch.Tensor
    """This replica's shard of the summed gradients."""
    left: list[int]
    """Per layer, gradients the last backward has yet to accumulate."""
    ready: list[bool]
    next: int
    """The next layer to start (they start from the last layer down)."""
    works: list[CollectiveWork] = field(default_factory=list)
    error: BaseException | None = None
    held: frozenset[int] = frozenset()
    """Layers not started while backward runs (a tied weight's, summed with its other
    copies first)."""
    deferred: list[int] = field(default_factory=list)
    """The held layers passed over: started at the step."""


class ZeroAdamW:
    """The optimizer of one stage replica: owns shard ``replica`` of the stage's layers.

    Gradients accumulate in a flat buffer laid out for the reduce-scatter
    (:class:`_GradBuffer`, installed by :meth:`zero_grad`). A step reduce-scatters it
    layer by layer (started during the last backward when the runner calls
    :meth:`overlap_reduction`), sends the shard to the snapshot holder, updates a copy
    of the shard (the committed one stays for a roll-back) and all-gathers the updated
    shards into the parameters. Buffers that a collective writes are reused only once it
    has completed; an abandoned step's are dropped.
    """

    def __init__(
        self,
        layers: Iterable[nn.Module],
        *,
        layer_ids: Sequence[int],
        dp_group: CollectiveGroup,
        replica: int,
        cfg: OptimizerConfig,
        state: ShardState | None = None,
        committed_step: int = -1,
    ) -> None:
        self.cfg = cfg
        self.dp_group = dp_group
        self.replica = replica
        layers = list(layers)
        self.params = [list(layer.parameters()) for layer in layers]
        self._names = [[name for name, _ in layer.named_parameters()] for layer in layers]
        self.layout = InterleavedLayout.build(
            [
                (lid, sum(p.numel() for p in ps))
                for lid, ps in zip(layer_ids, self.params, strict=True)
            ],
            dp_group.size,
        )
        with torch.no_grad():
            flats = [_flat([p.detach().float() for p in ps]) for ps in self.params]
            master = self.layout.shard_of(flats, replica)
            masks = [
                _flat([torch.full_like(p, 1.0 if p.dim() >= 2 else 0.0) for p in ps])
                for ps in self.params
            ]
            decay = self.layout.shard_of(masks, replica)
        if state is None:
            state = ShardState(master, torch.zeros_like(master), torch.zeros_like(master), decay)
        elif state.master.shape != master.shape:
            raise ValueError(
                f"shard of {state.master.numel()} elements given, layout needs {master.numel()}"
            )
        else:
            state.decay_mask = decay
        self.state = state
        """The shard after step ``committed_step``."""
        self.committed_step = committed_step
        self.previous: ShardState | None = None
        """The shard after step ``committed_step - 1``, kept for a one-step rollback."""
        self.pending: ShardState | None = None
        self.params_step: int | None = committed_step
        """The step whose update the full parameters hold; None while unknown (a layer
        still streaming in). A recovery may skip re-gathering parameters only when every
        rank's equal the committed step."""
        self._masks = masks
        self.snapshot: SnapshotSink | None = None
        """Where each step's reduced gradient shard is also sent (the snapshot holder)."""
        self._like = master  # dtype and device of the gradient buffers
        self._sums = torch.float64 if cfg.grad_reduce_dtype is GradReduceDtype.FLOAT64 else None
        """The wider type the step's gradients are summed in (None: their own)."""
        self._grads: _GradBuffer | None = None
        self._reduction: _Reduction | None = None
        self._hooks: list[RemovableHandle] = []
        self._layer_of = {id(p): li for li, ps in enumerate(self.params) for p in ps}
        """The layer index of each parameter (by identity)."""
        self._gather: torch.Tensor | None = None
        """The all-gather's output, kept from step to step once a gather completed."""
        self._spare: ShardState | None = None
        """The shard dropped by the last commit: the next update's buffers if nothing
        else holds it."""
        self._prepared: tuple[ShardState, IdleTask[ShardState]] | None = None
        """The committed shard and its copy being made for the next update."""
        self._copy_plan = self._param_pieces()
        self.tied: TiedGrad | None = None
        """Sums a tied weight's gradient with its other copies' (:mod:`elaswave.fabric.tied`)."""
        self.clip: GradClip | None = None
        """Clips each step's gradient by its global norm (``cfg.max_grad_norm``)."""
        self.grad_norms: dict[int, float] = {}
        """The global gradient norm of each step this optimizer stepped, before clipping."""

    def shard_mask(self, counts: Callable[[str], bool]) -> torch.Tensor:
        """0/1 per element of this replica's shard: 1 where the parameter, by name,
        ``counts``."""
        masks = [
            _flat(
                [torch.full_like(p, 1.0 if counts(n) else 0.0) for n, p in zip(ns, ps, strict=True)]
            )
            for ns, ps in zip(self._names, self.params, strict=True)
        ]
        return self.layout.shard_of(masks, self.replica).to(self._like.device)

    def decay_mask_of(self, replica: int) -> torch.Tensor:
        return self.layout.shard_of(self._masks, replica)

    def _param_pieces(self) -> list[tuple[int, int, int, int, int]]:
        """(layer, parameter, start, stop, offset): elements [start, stop) of a
        parameter's flat view sit at ``offset`` of the rank-major all-gather bucket."""
        pieces = []
        dp, width = self.layout.dp, self.layout.shard_numel
        for li, (ps, shards, (_, lo, _)) in enumerate(
            zip(self.params, self.layout.layers, self.layout.shard_slices(), strict=True)
        ):
            offset = 0
            for pi, p in enumerate(ps):
                start, stop = offset, offset + p.numel()
                while start < stop:
                    row, col = divmod(start, shards.shard)
                    end = min(stop, (row + 1) * shards.shard)
                    assert row < dp
                    pieces.append((li, pi, start - offset, end - offset, row * width + lo + col))
                    start = end
                offset = stop
        return pieces

    # ------------------------------------------------------------------ gradients

    def zero_grad(self) -> None:
        """Zero the gradient buffer and point every parameter's ``.grad`` into it."""
        self._disarm()
        self._reduction = None
        if self._grads is None:
            self._grads = self._new_buffer()
        else:
            self._grads.zero()
        self._grads.install(self.params)

    def _new_buffer(self) -> _GradBuffer:
        return _GradBuffer(self.params, self.layout, self._like, self._sums)

    @property
    def grad_reduce_bytes(self) -> int:
        """Bytes a replica's gradient reduction carries."""
        dtype = self._like.dtype if self._sums is None else self._sums
        return self.layout.dp * self.layout.shard_numel * dtype.itemsize

    def fold(self) -> None:
        """A backward action has added one micro-batch's gradients: with a wider
        ``grad_reduce_dtype``, add them to the step's exact sums (otherwise nothing)."""
        if self._sums is not None and self._grads is not None:
            self._grads.fold(self.params)

    def overlap_reduction(self) -> None:
        """The next backward is this replica's last of the step: start each layer's
        reduce-scatter as soon as that backward has accumulated the layer's gradients,
        so that the reduction overlaps the rest of the backward. Layers start from the
        last one down, whatever order their gradients complete in, so every replica
        starts the same collectives in the same order. :meth:`step` waits for them; a
        gradient changed after its layer started is not reduced (call this only when
        nothing changes gradients after the backward)."""
        if self.layout.dp == 1 or self._sums is not None:
            return  # nothing to overlap: the shard is the buffer (or the sums, at the step)
        self._begin_reduction()
        for li, ps in enumerate(self.params):
            for p in ps:
                if p.requires_grad:
                    hook = functools.partial(self._accumulated, li)
                    self._hooks.append(p.register_post_accumulate_grad_hook(hook))

    def accumulated(self, param: torch.Tensor) -> None:
        """``param``'s gradient of the step is complete, accumulated outside autograd's
        own accumulation (the weight-gradient half of a split backward): what its post-
        accumulate hook does, once the overlap is armed."""
        if self._reduction is None or not self._hooks:
            return
        index = self._layer_of.get(id(param))
        if index is not None:
            self._accumulated(index, param)

    def _begin_reduction(self) -> _Reduction:
        self._disarm()
        if self._grads is None:
            self._grads = self._new_buffer()
        n = len(self.params)
        self._reduction = _Reduction(
            out=torch.empty(
                self.layout.shard_numel,
                dtype=self._like.dtype if self._sums is None else self._sums,
                device=self._like.device,
            ),
            left=[sum(p.requires_grad for p in ps) for ps in self.params],
            ready=[False] * n,
            next=n - 1,
            held=frozenset(layer for layer, _ in self.tied.slots) if self.tied else frozenset(),
        )
        return self._reduction

    def _disarm(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def _accumulated(self, index: int, _param: torch.Tensor) -> None:
        r = self._reduction
        if r is None:
            return
        r.left[index] -= 1
        if r.left[index] == 0:
            r.ready[index] = True
            self._start_ready(r)

    def _start_ready(self, r: _Reduction, *, all_: bool = False) -> None:
        """Start the next layers whose gradients are complete (``all_``: every layer
        left), in order. A failure to start is kept for :meth:`reduce_scatter_grads`."""
        if r.error is not None:
            return
        while r.next >= 0 and (all_ or r.ready[r.next] or r.next in r.held):
            index = r.next
            r.next -= 1
            if index in r.held:  # its gradient is summed with the other copies' first
                r.deferred.append(index)
                continue
            try:
                self._start_layer(r, index)
            except BaseException as exc:
                r.error = exc
                return

    def _start_layer(self, r: _Reduction, index: int) -> None:
        assert self._grads is not None
        _, lo, hi = self.layout.shard_slices()[index]
        if hi == lo:
            return
        grads = self._grads
        if grads.sums is None:
            grads.collect(index, self.params[index])
        layers = grads.layers if grads.sums is None else grads.sum_layers
        r.works.append(self.dp_group.reduce_scatter_async(r.out[lo:hi], layers[index]))

    def reduce_scatter_grads(self) -> torch.Tensor:
        """Sum every replica's gradients; return this replica's shard of the sum."""
        if self._grads is None:
            self._grads = self._new_buffer()
        if self._sums is not None:
            return self._reduce_sums(self._grads)
        self._sum_tied(self._grads)
        if self.layout.dp == 1:
            grads = self._grads
            for index, ps in enumerate(self.params):
                grads.collect(index, ps)
            self._grads = None  # the shard is this buffer: the next step takes a new one
            return grads.flat
        r = self._reduction
        return self._finish(r if r is not None else self._begin_reduction())

    def _finish(self, r: _Reduction) -> torch.Tensor:
        """Start the layers not started yet (the held ones last) and wait for all."""
        try:
            self._disarm()
            self._start_ready(r, all_=True)
            for index in r.deferred:
                self._start_layer(r, index)
            if r.error is not None:
                raise r.error
            for work in r.works:
                work.wait()
        finally:
            self._reduction = None
        return r.out

    def _reduce_sums(self, grads: _GradBuffer) -> torch.Tensor:
        """:meth:`reduce_scatter_grads` of the wider sums: the gradients left folded in,
        the tied weight's copies summed, every layer reduce-scattered (in the sums'
        type, exact again), and this replica's shard cast back to the parameters' type."""
        grads.fold(self.params)
        self._sum_tied(grads)
        if self.layout.dp == 1:
            assert grads.sums is not None
            return grads.sums.to(self._like.dtype)
        return self._finish(self._begin_reduction()).to(self._like.dtype)

    def _sum_tied(self, grads: _GradBuffer) -> None:
        """The tied weight's copies here get the sum over every copy (every rank that
        holds one calls this once a step, before its stage's reduce-scatter)."""
        if self.tied is None:
            return
        views = []
        for layer, param in self.tied.slots:
            if grads.sums is not None:  # folded: the sums hold every gradient
                views.append(grads.sum_view(layer, param, self.params[layer][param]))
                continue
            grads.collect(layer, self.params[layer])
            view = grads.views[layer][param]
            if view is None:
                raise RuntimeError("a tied weight's gradient is not in the gradient buffer")
            views.append(view)
        self.tied.sum(views)

    # ------------------------------------------------------------------ parameters

    def all_gather_params(self, shard: torch.Tensor | None = None) -> None:
        """Gather every replica's master shard (default: committed) into the parameters."""
        committed = shard is None
        shard = self.state.master if shard is None else shard
        if self.layout.dp == 1:
            bucket = shard
        else:
            kept = self._gather
            self._gather = None  # taken: a gather given up on may still write it
            if kept is not None and kept.dtype == shard.dtype and kept.device == shard.device:
                bucket = kept
            else:
                bucket = torch.empty(
                    self.layout.dp * shard.numel(), dtype=shard.dtype, device=shard.device
                )
            self.dp_group.all_gather(bucket, shard)
        with torch.no_grad():
            flats = [[p.view(-1) if p.is_contiguous() else None for p in ps] for ps in self.params]
            for li, pi, start, stop, offset in self._copy_plan:
                flat = flats[li][pi]
                if flat is not None:
                    flat[start:stop].copy_(bucket[offset : offset + stop - start])
            if any(f is None for fs in flats for f in fs):  # the general path for the rest
                for li, (ps, flat) in enumerate(
                    zip(self.params, self.layout.from_rank_major(bucket.view(-1)), strict=True)
                ):
                    offset = 0
                    for pi, p in enumerate(ps):
                        if flats[li][pi] is None:
                            p.copy_(flat[offset : offset + p.numel()].view_as(p))
                        offset += p.numel()
        if self.layout.dp > 1:
            self._gather = bucket
        if committed:
            self.params_step = self.committed_step

    # ------------------------------------------------------------------ steps

    def step(self, step: int, hook: Callable[[str], None] | None = None) -> None:
        """Reduce-scatter, snapshot send, out-of-place update, the snapshot's delivery,
        all-gather; then commit()."""
        grad = self.reduce_scatter_grads()
        if self.clip is not None:  # before the holder gets it: both apply the clipped one
            self.grad_norms[step] = self.clip.apply(grad)
        if self.snapshot is not None:
            self.snapshot.send(grad, step)
        if hook is not None:
            hook("snapshot")
        pending = self._take_prepared()
        if pending is None:
            pending = self.state.updated_copy(into=self._take_spare())
        adamw_update(pending, grad, step=step, cfg=self.cfg)
        if hook is not None:
            hook("optimizer")
        if self.snapshot is not None:  # a step commits only with its snapshot held
            self.snapshot.wait_delivered(self.dp_group.timeout.total_seconds())
        self.all_gather_params(pending.master)
        self.params_step = step
        self.pending = pending

    def _take_spare(self) -> ShardState | None:
        """The spare shard if nothing but this optimizer refers to it or its tensors."""
        spare, self._spare = self._spare, None
        return spare if recyclable(spare, self.state) else None

    def _prepare(self) -> None:
        """Queue the copy of the committed shard into the next update's buffers as idle
        work (:mod:`elaswave.comm.idle`): the copy needs no gradient, so the next step's
        waits for communication can do it. Host shards only."""
        self._drop_prepared()
        if self.state.master.device.type != "cpu":
            return
        source = self.state
        pieces = source.copy_pieces(self._take_spare())
        self._prepared = (source, IDLE.submit(pieces, f"copy of shard {self.replica}"))

    def _take_prepared(self) -> ShardState | None:
        """The prepared copy, if it is of the committed shard (a roll-back since leaves
        it unused), its pieces not done yet done here. Buffers of a copy not taken are
        dropped, not reused."""
        prepared, self._prepared = self._prepared, None
        if prepared is None:
            return None
        source, task = prepared
        if source is not self.state:
            IDLE.drop(task)
            return None
        return IDLE.finish(task)

    def _drop_prepared(self) -> None:
        if self._prepared is not None:
            IDLE.drop(self._prepared[1])
            self._prepared = None

    def commit(self, step: int) -> None:
        """Make ``step``'s update the committed state (every phase of the step is done)."""
        if self.pending is None or step != self.committed_step + 1:
            raise RuntimeError(f"commit of step {step} after committed step {self.committed_step}")
        dropped = self.previous
        self.previous, self.state, self.pending = self.state, self.pending, None
        self.committed_step = step
        self._spare = dropped
        self._prepare()

    def abandon(self) -> None:
        """Drop any uncommitted update and the work of the abandoned step (reduction
        hooks, the copy prepared for the next update, the kept gather buffer)."""
        self.pending = None
        self._drop_prepared()
        self._disarm()
        self._reduction = None
        self._gather = None  # an abandoned gather may still write it

    def rollback(self, to_step: int) -> None:
        """Drop any uncommitted update and, if needed, the last committed step."""
        self.abandon()
        if to_step == self.committed_step:
            return
        if to_step == self.committed_step - 1 and self.previous is not None:
            self.state, self.previous = self.previous, None
            self.committed_step = to_step
            return
        raise RuntimeError(f"cannot roll back from step {self.committed_step} to {to_step}")
