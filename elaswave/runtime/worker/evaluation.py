"""The held-out loss of a step's parameters (``--eval-every K``), inside the step.

After the step's all-gather and before its commit, every stage replica runs the held-out
windows forward through the step's pipeline, without gradients or dropout: the windows
``i`` of round ``r`` and global micro-batch ``mb`` are split among the replicas as the
step's samples are (the plan's shares and routes), the last stage sums each window's mean
token loss in float64 and its replicas add their sums. Every layout reads the same
windows and adds the same per-window losses, so the figure is the same on any layout.

Being part of the step, an evaluation that a failure interrupts is redone with the step
(``--fault kill:R@S:eval`` kills a rank during one); its time is not the step's
(:attr:`~elaswave.runtime.worker.pipeline.StepResult.seconds`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from elaswave.comm.spec import MAX_MICRO_BATCHES
from elaswave.data.corpus import HeldOut
from elaswave.engine.plan import dp_group_name
from elaswave.model.llama import StepContext
from elaswave.runtime.job.faults import StepPhase
from elaswave.runtime.worker.emulation import DelayedSend

if TYPE_CHECKING:
    from elaswave.runtime.worker.pipeline import StageRunner


@dataclass(frozen=True)
class HeldOutEval:
    """What a worker evaluates, and when."""

    data: HeldOut
    batches: int
    """Rounds of one global batch of windows each."""
    due: Callable[[int], bool]
    """Whether a step ends with an evaluation
    (:meth:`~elaswave.runtime.job.sections.ScheduleConfig.evaluates`)."""


@dataclass(frozen=True)
class EvalResult:
    loss: float | None
    """Mean loss per window over the held-out windows (last stage only)."""
    seconds: float


def evaluate(runner: StageRunner, held: HeldOutEval, step: int) -> EvalResult:
    """Run ``held``'s windows forward through ``runner``'s stage (this replica's share)."""
    from elaswave.runtime.worker.pipeline import LossSum

    started = time.perf_counter()
    total = LossSum(runner.device)
    pending: list = []
    nmb = runner.plan.num_micro_batches
    if not runner.idle:
        with torch.no_grad():
            for r in range(held.batches):
                for mb in range(nmb):
                    _window(runner, held, step, r, mb, total, pending)
    for group, work, _ in pending:
        if isinstance(work, DelayedSend):
            work = work.work(runner.optimizer.dp_group.timeout.total_seconds())
        group.wait_send(work)
    loss = None
    if runner.is_last:
        total.reduce(runner.comm.collective(dp_group_name(runner.stage)))
        loss = total.value() / (held.batches * runner.plan.global_batch)
    return EvalResult(loss, time.perf_counter() - started)


def _window(
    runner: StageRunner, held: HeldOutEval, step: int, r: int, mb: int, total, pending: list
) -> None:
    """Micro-batch ``mb`` of round ``r``: receive, forward, send on (or add its losses)."""
    lo, hi = runner.share(mb)
    base = r * runner.plan.global_batch + mb * runner.sampler.micro_batch_samples
    ids = tuple(range(base + lo, base + hi))
    tag = runner.tag(step, (r * runner.plan.num_micro_batches + mb) % MAX_MICRO_BATCHES, False)
    if runner.is_first:
        x = held.data.batch(ids)[0].to(runner.device)
    else:
        works, parts, _ = runner.post_recv(step, False, mb, tag=tag)
        for group, work in works:
            group.wait_recv(work)
        x = torch.cat(parts) if len(parts) > 1 else parts[0]
    ctx = StepContext(step=step, sample_ids=ids, rng=runner.rng, training=False)
    with torch.autocast(runner.device.type, dtype=torch.bfloat16, enabled=runner.bf16):
        for layer in runner.layers:
            x = layer(x, ctx)
    if r == 0 and mb == 0:
        runner.fault_hook(StepPhase.EVAL, step)
    if runner.is_last:
        total.add(runner.per_sample_loss(x, held.data.batch(ids)[1].to(runner.device)))
    else:
        runner.send(x.to(runner.act_dtype), runner.outbound(mb), lo, False, tag, pending)
