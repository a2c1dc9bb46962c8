"""ZeRO-1 AdamW over the interleaved layout.

Each DP rank keeps fp32 master weights and Adam moments for its shard only. A step is
reduce-scatter of the stage's gradient bucket (rank j receives the sum of shard j of
every layer), a local AdamW update of the shard, and an all-gather of the updated shards
into every replica's full parameters. :func:`adamw_update` is pure arithmetic on flat
tensors so that a snapshot holder can apply the very same update to a host copy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from elaswave.comm.group import CollectiveGroup
from elaswave.fabric.layout import InterleavedLayout


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW hyper-parameters."""

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

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"optim.lr = {self.lr!r}: must be positive")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"optim.{name} = {getattr(self, name)!r}: must be in [0, 1)")
        if self.weight_decay < 0 or self.eps <= 0:
            raise ValueError("optim.weight_decay must be >= 0 and optim.eps > 0")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps = {self.warmup_steps}: must be >= 0")

    def lr_at(self, step: int) -> float:
        if self.warmup_steps == 0:
            return self.lr
        return self.lr * min(1.0, (step + 1) / self.warmup_steps)


@dataclass
class ShardState:
    """One rank's optimizer shard: master weights and moments, all fp32 and flat."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    decay_mask: torch.Tensor

    def numel(self) -> int:
        return self.master.numel()

    def updated_copy(self) -> ShardState:
        """A copy to update out of place (the decay mask is constant and shared)."""
        return ShardState(
            self.master.clone(), self.exp_avg.clone(), self.exp_avg_sq.clone(), self.decay_mask
        )

    def clone_to(self, device: torch.device | str) -> ShardState:
        return ShardState(
            *(
                t.detach().to(device, copy=True)
                for t in (self.master, self.exp_avg, self.exp_avg_sq, self.decay_mask)
            )
        )


def adamw_update(state: ShardState, grad: torch.Tensor, *, step: int, cfg: OptimizerConfig) -> None:
    """One AdamW step on a shard, in place. ``step`` is 0-based."""
    t = step + 1
    lr = cfg.lr_at(step)
    state.exp_avg.mul_(cfg.beta1).add_(grad, alpha=1 - cfg.beta1)
    state.exp_avg_sq.mul_(cfg.beta2).addcmul_(grad, grad, value=1 - cfg.beta2)
    denom = (state.exp_avg_sq / (1 - cfg.beta2**t)).sqrt_().add_(cfg.eps)
    if cfg.weight_decay:
        state.master.mul_(1 - lr * cfg.weight_decay * state.decay_mask)
    state.master.addcdiv_(state.exp_avg, denom, value=-lr / (1 - cfg.beta1**t))


class SnapshotSink(Protocol):
    cpu_s: float

    def send(self, grad_shard: torch.Tensor, step: int) -> None: ...

    def flush(self, timeout_s: float) -> None: ...

    def close(self) -> None: ...


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.zeros(0)


class ZeroAdamW:
    """The optimizer of one stage replica: owns shard ``replica`` of the stage's layers."""

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
        self.params = [list(layer.parameters()) for layer in layers]
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

    def decay_mask_of(self, replica: int) -> torch.Tensor:
        return self.layout.shard_of(self._masks, replica)

    def zero_grad(self) -> None:
        for ps in self.params:
            for p in ps:
                p.grad = None

    def _grad_flats(self) -> list[torch.Tensor]:
        return [
            _flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in ps])
            for ps in self.params
        ]

    def reduce_scatter_grads(self) -> torch.Tensor:
        """Sum every replica's gradients; return this replica's shard of the sum."""
        bucket = self.layout.to_rank_major(self._grad_flats())
        shard = torch.empty(self.layout.shard_numel, dtype=bucket.dtype, device=bucket.device)
        self.dp_group.reduce_scatter(shard, bucket)
        return shard

    def all_gather_params(self, shard: torch.Tensor | None = None) -> None:
        """Gather every replica's master shard (default: committed) into the parameters."""
        shard = self.state.master if shard is None else shard
        bucket = torch.empty(self.layout.dp * shard.numel(), dtype=shard.dtype, device=shard.device)
        self.dp_group.all_gather(bucket, shard)
        with torch.no_grad():
            for ps, flat in zip(self.params, self.layout.from_rank_major(bucket), strict=True):
                offset = 0
                for p in ps:
                    n = p.numel()
                    p.copy_(flat[offset : offset + n].view_as(p))
                    offset += n
        if shard is None:
            self.params_step = self.committed_step

    def step(self, step: int, hook: Callable[[str], None] | None = None) -> None:
        """Reduce-scatter, snapshot send, out-of-place update, all-gather; then commit()."""
        grad = self.reduce_scatter_grads()
        if self.snapshot is not None:
            self.snapshot.send(grad, step)
        if hook is not None:
            hook("snapshot")
        pending = self.state.updated_copy()
        adamw_update(pending, grad, step=step, cfg=self.cfg)
        if hook is not None:
            hook("optimizer")
        self.all_gather_params(pending.master)
        self.params_step = step
        self.pending = pending

    def commit(self, step: int) -> None:
        """Make ``step``'s update the committed state (every phase of the step is done)."""
        if self.pending is None or step != self.committed_step + 1:
            raise RuntimeError(f"commit of step {step} after committed step {self.committed_step}")
        self.previous, self.state, self.pending = self.state, self.pending, None
        self.committed_step = step

    def rollback(self, to_step: int) -> None:
        """Drop any uncommitted update and, if needed, the last committed step."""
        self.pending = None
        if to_step == self.committed_step:
            return
        if to_step == self.committed_step - 1 and self.previous is not None:
            self.state, self.previous = self.previous, None
            self.committed_step = to_step
            return
        raise RuntimeError(f"cannot roll back from step {self.committed_step} to {to_step}")
