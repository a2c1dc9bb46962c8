"""The arithmetic of one optimizer shard: AdamW's hyper-parameters, a shard's state, the
update itself, and when a shard's buffers may be reused.

:func:`adamw_update` is pure arithmetic on flat tensors, so that an owner
(:class:`~elaswave.fabric.zero.ZeroAdamW`) and its snapshot holder
(:class:`~elaswave.fabric.snapshot.SnapshotKeeper`) apply the very same update.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import math
import sys
import weakref
from collections.abc import Generator
from dataclasses import dataclass

import torch


class LrSchedule(enum.StrEnum):
    """How the learning rate falls after the warm-up (``[optim] lr_schedule``)."""

    CONSTANT = "constant"
    LINEAR = "linear"
    COSINE = "cosine"


class GradReduceDtype(enum.StrEnum):
    """The type gradients are summed in, over micro-batches and replicas
    (``[optim] grad_reduce_dtype``)."""

    FLOAT32 = "float32"
    FLOAT64 = "float64"
    """Exact sums of float32 gradients: every DP and PP layout and every recovery of the
    same TP width gives the same bits (twice the gradient memory and reduction bytes)."""


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW hyper-parameters, the learning-rate schedule and gradient clipping."""

    lr: float = 3e-3
    """Peak learning rate."""
    beta1: float = 0.9
    """First-moment decay."""
    beta2: float = 0.95
    """Second-moment decay."""
    eps: float = 1e-8
    """Denominator epsilon."""
    weight_decay: float = 0.01
    """Decoupled weight decay, applied to matrices (not to norm gains)."""
    warmup_steps: int = 5
    """Linear learning-rate warm-up steps."""
    lr_schedule: LrSchedule = LrSchedule.CONSTANT
    """After the warm-up: constant, or a linear or cosine decay from ``lr`` to
    ``min_lr`` over ``decay_steps`` steps (then ``min_lr``)."""
    min_lr: float = 0.0
    """Where a decaying schedule ends."""
    decay_steps: int | None = None
    """Steps a decaying schedule takes after the warm-up; None: the rest of the job
    (:meth:`for_steps`)."""
    max_grad_norm: float | None = None
    """Clip the step's gradient to this global norm (over every shard of every stage,
    replica and TP member), as ``torch.nn.utils.clip_grad_norm_``; None: no clipping."""
    grad_reduce_dtype: GradReduceDtype = GradReduceDtype.FLOAT32
    """The type a step's gradients are summed in: float32 (the parameters' own), or
    float64, whose sums do not depend on the order the layout adds in."""

    def __post_init__(self) -> None:
        if not 0 < self.lr < math.inf:
            raise ValueError(f"optim.lr = {self.lr!r}: must be a positive finite number")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"optim.{name} = {getattr(self, name)!r}: must be in [0, 1)")
        if not 0 <= self.weight_decay < math.inf:
            raise ValueError(
                f"optim.weight_decay = {self.weight_decay!r}: must be a finite number >= 0"
            )
        if not 0 < self.eps < math.inf:
            raise ValueError(f"optim.eps = {self.eps!r}: must be a positive finite number")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps = {self.warmup_steps}: must be >= 0")
        self._to_enum("lr_schedule", LrSchedule)
        self._to_enum("grad_reduce_dtype", GradReduceDtype)
        if not 0.0 <= self.min_lr <= self.lr:
            raise ValueError(f"optim.min_lr = {self.min_lr!r}: must be in [0, lr = {self.lr!r}]")
        if self.decay_steps is not None and self.decay_steps < 1:
            raise ValueError(f"optim.decay_steps = {self.decay_steps!r}: must be at least 1")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"optim.max_grad_norm = {self.max_grad_norm!r}: must be positive")

    def _to_enum(self, name: str, kind: type[enum.StrEnum]) -> None:
        value = getattr(self, name)
        try:
            object.__setattr__(self, name, kind(value))
        except ValueError:
            valid = ", ".join(repr(x.value) for x in kind)
            raise ValueError(f"optim.{name} = {value!r}: valid values are {valid}") from None

    def for_steps(self, steps: int) -> OptimizerConfig:
        """This config for a job of ``steps`` steps: a decaying schedule without
        ``decay_steps`` decays over the steps after the warm-up."""
        if self.decay_steps is not None or self.lr_schedule is LrSchedule.CONSTANT:
            return self
        return dataclasses.replace(self, decay_steps=max(1, steps - self.warmup_steps))

    def lr_at(self, step: int) -> float:
        """The learning rate of 0-based ``step``: ``lr * (step + 1) / warmup_steps``
        during the warm-up (``lr`` at its last step), then the schedule."""
        if step + 1 < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.lr_schedule is LrSchedule.CONSTANT:
            return self.lr
        span = self.decay_steps if self.decay_steps is not None else 1
        progress = min(1.0, (step + 1 - max(self.warmup_steps, 1)) / span)
        if progress in (0.0, 1.0):  # the ends exactly
            return self.lr if progress == 0.0 else self.min_lr
        if self.lr_schedule is LrSchedule.LINEAR:
            left = 1.0 - progress
        else:
            left = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr + (self.lr - self.min_lr) * left


@dataclass
class ShardState:
    """One rank's optimizer shard: master weights and moments, all fp32 and flat."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    decay_mask: torch.Tensor

    def numel(self) -> int:
        return self.master.numel()

    def updated_copy(self, into: ShardState | None = None) -> ShardState:
        """A copy to update out of place (the decay mask is constant and shared): new
        tensors, or ``into``'s (same shapes), overwritten."""
        pieces = self.copy_pieces(into)
        while True:
            try:
                next(pieces)
            except StopIteration as end:
                return end.value

    def copy_pieces(self, into: ShardState | None = None) -> Generator[None, None, ShardState]:
        """:meth:`updated_copy` in spans of :data:`PIECE` elements, yielding between
        spans; returns the copy."""
        if into is None:
            into = ShardState(
                torch.empty_like(self.master),
                torch.empty_like(self.exp_avg),
                torch.empty_like(self.exp_avg_sq),
                self.decay_mask,
            )
        n = self.master.numel()
        for lo in range(0, n, PIECE):
            hi = min(n, lo + PIECE)
            into.master[lo:hi].copy_(self.master[lo:hi])
            into.exp_avg[lo:hi].copy_(self.exp_avg[lo:hi])
            into.exp_avg_sq[lo:hi].copy_(self.exp_avg_sq[lo:hi])
            if hi < n:
                yield
        into.decay_mask = self.decay_mask
        return into

    def clone_to(self, device: torch.device | str) -> ShardState:
        return ShardState(
            *(
                t.detach().to(device, copy=True)
                for t in (self.master, self.exp_avg, self.exp_avg_sq, self.decay_mask)
            )
        )


_FUSED_DEVICES = ("cpu", "cuda")
"""Devices whose torch has the one-pass AdamW kernel (``torch._fused_adamw_``)."""

GRID = 1 << 16
""":func:`adamw_update` cuts its runs at every multiple of ``GRID`` elements, so that
its spans (:func:`adamw_pieces`) are pieces of the whole update's runs. (The fused
kernel rounds a tensor's last elements past a whole number of vectors apart from the
rest; on CPU those are computed in vector code too, see :data:`LANES`; on CUDA every
element runs the same code.)"""

PIECE = 4 * GRID
"""Elements a piece of :func:`adamw_pieces` (and of :meth:`ShardState.copy_pieces`)
updates: 0.1 to 0.2 ms of one core, what a piece may add to a wait."""


def adamw_update(
    state: ShardState,
    grad: torch.Tensor,
    *,
    step: int,
    cfg: OptimizerConfig,
    span: tuple[int, int] | None = None,
) -> None:
    """One AdamW step on a shard, in place; only on elements ``span`` = [lo, hi) if given
    (lo and hi multiples of :data:`GRID`, or hi the shard's size). ``step`` is 0-based.

    The decoupled weight decay of the elements the decay mask marks, then the Adam
    update: on CPU and CUDA, torch's fused AdamW kernel, one pass over the shard (two
    calls: the runs of elements that decay, with the decay folded in, and the runs that
    do not, each cut on the grid); the same arithmetic in tensor operations elsewhere.
    An owner and its snapshot holder run this same function on the same fp32 inputs,
    whole or in spans, so their shards stay bit-identical.
    """
    t = step + 1
    lr = cfg.lr_at(step)
    n = state.master.numel()
    lo, hi = (0, n) if span is None else span
    if lo % GRID or (hi % GRID and hi != n) or not 0 <= lo <= hi <= n:
        raise ValueError(f"span {span} of a {n}-element shard is not on the {GRID} grid")
    master, exp_avg, exp_avg_sq = state.master, state.exp_avg, state.exp_avg_sq
    if master.device.type in _FUSED_DEVICES and hasattr(torch, "_fused_adamw_"):
        decay, plain = decay_runs(state.decay_mask) if cfg.weight_decay else ([], [(0, n)])
        count = torch.tensor(float(t), device=master.device)
        for runs, weight_decay in ((decay, cfg.weight_decay), (plain, 0.0)):
            cut = _on_grid(runs, lo, hi)
            if not cut:
                continue
            tensors = (master, grad, exp_avg, exp_avg_sq)
            whole, tails = _lane_runs(cut) if master.device.type == "cpu" else (cut, ())
            lists = [[x[a:b] for a, b in whole] for x in tensors]
            if tails:  # the rests side by side, each in LANES slots of one padded copy
                src, dst = _rest_index(tails)
                padded = [torch.zeros(len(tails) * LANES, dtype=x.dtype) for x in tensors]
                for x, pad in zip(tensors, padded, strict=True):
                    pad[dst] = x[src]
                lists = [[*xs, pad] for xs, pad in zip(lists, padded, strict=True)]
            ps, gs, avgs, sqs = lists
            if ps:
                torch._fused_adamw_(
                    ps, gs, avgs, sqs, [], [count] * len(ps), lr=lr, beta1=cfg.beta1,
                    beta2=cfg.beta2, weight_decay=weight_decay, eps=cfg.eps,
                    amsgrad=False, maximize=False,
                )  # fmt: skip
            if tails:  # back from the copy (the gradient is only read)
                for x, pad in ((master, padded[0]), (exp_avg, padded[2]), (exp_avg_sq, padded[3])):
                    x[src] = pad[dst]
        return
    master, exp_avg, exp_avg_sq, grad = (
        x[lo:hi] for x in (master, exp_avg, exp_avg_sq, grad)
    )  # elementwise: any span gives the same results
    if cfg.weight_decay:
        master.addcmul_(master, state.decay_mask[lo:hi], value=-lr * cfg.weight_decay)
    exp_avg.mul_(cfg.beta1).add_(grad, alpha=1 - cfg.beta1)
    exp_avg_sq.mul_(cfg.beta2).addcmul_(grad, grad, value=1 - cfg.beta2)
    denom = (exp_avg_sq.sqrt() / math.sqrt(1 - cfg.beta2**t)).add_(cfg.eps)
    master.addcdiv_(exp_avg, denom, value=-lr / (1 - cfg.beta1**t))


def adamw_pieces(
    state: ShardState, grad: torch.Tensor, *, step: int, cfg: OptimizerConfig
) -> Generator[None, None, None]:
    """:func:`adamw_update` in spans of :data:`PIECE` elements, yielding between spans
    (the same result, bit for bit)."""
    n = state.master.numel()
    for lo in range(0, n, PIECE):
        if lo:
            yield
        adamw_update(state, grad, step=step, cfg=cfg, span=(lo, min(n, lo + PIECE)))


LANES = 64
"""The CPU kernel computes a run's last elements past a whole number of vectors apart
from the rest, in scalar code that rounds differently (fused multiply-adds): an
element's result would depend on where the run it sits in ends, so on how the layout
shards the layer. Every run is cut into whole vectors (a multiple of any vector width
up to 64 floats), and the rests are computed in one zero-padded copy, ``LANES``
elements each: every element goes through the vector code, wherever the cuts fall."""


def _lane_runs(runs: Runs) -> tuple[Runs, tuple[tuple[int, int], ...]]:
    """``runs`` cut into spans of whole :data:`LANES` and the shorter rests."""
    whole, rests = [], []
    for a, b in runs:
        edge = a + (b - a) // LANES * LANES
        if edge > a:
            whole.append((a, edge))
        if b > edge:
            rests.append((edge, b))
    return whole, tuple(rests)


@functools.lru_cache(maxsize=1024)
def _rest_index(rests: tuple[tuple[int, int], ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the ``rests`` are in a shard, and where in their padded copy (rest ``k`` at
    the start of slot ``k`` of :data:`LANES` elements)."""
    src = [i for a, b in rests for i in range(a, b)]
    dst = [k * LANES + j for k, (a, b) in enumerate(rests) for j in range(b - a)]
    return torch.tensor(src), torch.tensor(dst)


def _on_grid(runs: Runs, lo: int, hi: int) -> Runs:
    """``runs`` clipped to [lo, hi) and cut at every multiple of :data:`GRID`."""
    out: Runs = []
    for a, b in runs:
        a, b = max(a, lo), min(b, hi)
        while a < b:
            edge = min(b, (a // GRID + 1) * GRID)
            out.append((a, edge))
            a = edge
    return out


Runs = list[tuple[int, int]]
_RUNS: dict[int, tuple[weakref.ref[torch.Tensor], tuple[Runs, Runs]]] = {}
"""decay_runs' cache, by mask identity (a tensor's ``==`` is elementwise, so tensors
cannot key a WeakKeyDictionary); an entry goes with its mask."""


def decay_runs(mask: torch.Tensor) -> tuple[Runs, Runs]:
    """The [lo, hi) runs of a 0/1 decay mask's ones and of its zeros, in order; computed
    once per mask tensor (a shard's mask is constant and shared by its versions)."""
    key = id(mask)
    entry = _RUNS.get(key)
    if entry is None or entry[0]() is not mask:
        flags = mask.detach().to("cpu") != 0
        n = flags.numel()
        edges = [0, *(torch.nonzero(flags[1:] != flags[:-1]).flatten() + 1).tolist(), n]
        ones: Runs = []
        zeros: Runs = []
        for lo, hi in itertools.pairwise(edges):
            if hi > lo:
                (ones if bool(flags[lo]) else zeros).append((lo, hi))
        entry = (weakref.ref(mask, functools.partial(_forget_runs, key)), (ones, zeros))
        _RUNS[key] = entry
    return entry[1]


def _forget_runs(key: int, ref: weakref.ref[torch.Tensor]) -> None:
    """A mask died: drop its entry (not a later mask's with the same id)."""
    entry = _RUNS.get(key)
    if entry is not None and entry[0] is ref:
        del _RUNS[key]


def _storage_use_count(t: torch.Tensor) -> int | None:
    try:
        return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))
    except (AttributeError, RuntimeError):  # not in this torch: nothing is recycled
        return None


_ALONE = _storage_use_count(torch.empty(1))
"""What :func:`_storage_use_count` says of a tensor whose storage nothing else uses."""


def recyclable(state: ShardState | None, like: ShardState) -> bool:
    """Whether ``state``'s tensors may be overwritten as the next update's (shaped as
    ``like``'s): nothing refers to ``state`` but the caller's one variable, nor to its
    tensors but ``state``, and no view shares their storage."""
    if state is None or _ALONE is None or sys.getrefcount(state) > 3:
        return False  # the caller's variable, the argument and getrefcount's own
    return all(
        _alone(getattr(state, name), like=getattr(like, name))
        for name in ("master", "exp_avg", "exp_avg_sq")
    )


def _alone(t: torch.Tensor, *, like: torch.Tensor) -> bool:
    """Whether ``t``, an attribute of an object nothing else refers to, may be
    overwritten as a tensor like ``like``: no other reference to it (its attribute, the
    argument and getrefcount's own are the three counted), no view of its storage."""
    return (
        sys.getrefcount(t) <= 3
        and t._base is None
        and _storage_use_count(t) == _ALONE
        and t.shape == like.shape
        and t.dtype == like.dtype
        and t.device == like.device
        and t.is_contiguous()
    )
