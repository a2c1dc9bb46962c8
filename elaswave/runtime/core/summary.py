"""Building a finished run's summary (:class:`~elaswave.runtime.job.results.Summary`,
RUN_DIR/summary.json) from its workers' results, its parameters and its event log."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import torch

from elaswave import rundir
from elaswave.bus.eventlog import read_event_log
from elaswave.bus.schema import StepCompleted
from elaswave.engine.cost import DeviceSpec, LayerCost
from elaswave.engine.plan import Plan
from elaswave.engine.record import RecoveryRecord
from elaswave.engine.steptime import plan_step_time
from elaswave.fabric.adamw import OptimizerConfig
from elaswave.runtime.core.compare import load_params
from elaswave.runtime.job.results import (
    BusCounts,
    Layout,
    Summary,
    WorkerResult,
    read_worker_results,
)


def param_digest(params: dict[int, dict[str, torch.Tensor]]) -> str:
    """sha256 of every parameter in canonical layer order, fp32 little-endian."""
    h = hashlib.sha256()
    for layer in sorted(params):
        for _, tensor in params[layer].items():
            data = tensor.detach().to(torch.float32).contiguous().cpu().numpy()
            h.update(data.astype("<f4", copy=False).tobytes())
    return h.hexdigest()


def build_summary(
    *,
    run_dir: Path,
    plan: Plan,
    steps: int,
    num_events: int,
    device: str,
    recoveries: Sequence[RecoveryRecord] = (),
    bus: dict[str, int] | None = None,
    layers: Sequence[LayerCost] | None = None,
    cost_device: DeviceSpec | None = None,
    tp: int = 1,
    optim: OptimizerConfig | None = None,
) -> Summary:
    """``recoveries``: the job's changes (summary.json's ``recoveries``,
    :func:`elaswave.engine.record.record_to_json`). ``bus``: the Core's delivery
    counters; the workers' are added from their results.
    ``layers`` and ``cost_device``: what the planners price (the job's
    :attr:`~elaswave.runtime.job.config.JobConfig.layer_costs` and ``cost_device``), for
    ``predicted_step_s``, the planner's simulated step time of ``plan`` (None without).
    ``tp``: the members of each of the plan's ranks (TP groups). ``optim``: the job's
    optimizer, for each step's learning rate (``lr``; None without)."""
    results = read_worker_results(run_dir)
    logged = _logged_steps(run_dir)
    first, losses = _losses(results, logged)
    step_time = _step_times(results, logged, first, len(losses))
    predicted = None
    if layers is not None and cost_device is not None:
        predicted = plan_step_time(plan, layers, cost_device).step_s
    workers_bus = {
        k: sum(r.bus.get(k, 0) for r in results)
        for k in sorted({k for r in results for k in r.bus})
    }
    eval_steps, eval_loss = _evaluations(results, logged, first, len(losses))
    return Summary(
        layout=Layout(dp=plan.stages[0].dp, pp=plan.pp, tp=tp),
        global_batch=plan.global_batch,
        steps_completed=first + len(losses),
        loss=tuple(losses),
        step_time_s=tuple(step_time),
        samples_per_s=plan.global_batch * len(losses) / sum(step_time),
        param_digest=_digest_here(run_dir, plan),
        events=num_events,
        recoveries=tuple(recoveries),
        device=device,
        timing="emulated" if device == "emulated" else "measured",
        first_step=first,
        predicted_step_s=predicted,
        bus=BusCounts(core=bus or {}, workers=workers_bus),
        snapshot_host_bytes={r.rank: r.snapshot_host_bytes for r in sorted(results, key=_rank)}
        or None,
        lr=None
        if optim is None
        else tuple(optim.lr_at(s) for s in range(first, first + len(losses))),
        grad_norm=_grad_norms(results, logged, first, len(losses)),
        eval_steps=eval_steps,
        eval_loss=eval_loss,
        schedule=plan.schedule,
    )


def _rank(result: WorkerResult) -> int:
    return result.rank


def _losses(
    results: Sequence[WorkerResult], logged: dict[int, StepCompleted]
) -> tuple[int, list[float]]:
    """The run's first step and the loss of every step it trained.

    Last-stage ranks know the loss of each step they ran in the last stage (a rank that
    changed stage, or joined, knows only some steps); the steps no surviving rank ran
    there, and every step where the last stage's results are on another host's disk (a
    multi-host job without a shared run directory), come from the StepCompleted records
    of the event log (the latest for each step, which is the redone one after a
    recovery)."""
    by_step: dict[int, float] = {}
    for r in results:
        if r.loss is not None:
            at = r.loss_steps or range(r.first_step, r.first_step + len(r.loss))
            by_step.update(zip(at, r.loss, strict=True))
    if not by_step and not logged:
        raise ValueError("no rank's result and no event log record has a step's loss")
    first, last = (min(by_step), max(by_step)) if by_step else (max(logged), max(logged))
    while first - 1 in logged:
        first -= 1
    while last + 1 in logged:
        last += 1
    missing = [s for s in range(first, last + 1) if s not in by_step and s not in logged]
    if missing:
        raise ValueError(f"no rank and no event log record has the loss of steps {missing}")
    return first, [by_step[s] if s in by_step else logged[s].loss for s in range(first, last + 1)]


def _grad_norms(
    results: Sequence[WorkerResult], logged: dict[int, StepCompleted], first: int, trained: int
) -> tuple[float, ...] | None:
    """Each step's global gradient norm, from the last stage's ranks or else the event
    log's StepCompleted records (as losses); None where a step has none (no clipping)."""
    by_step: dict[int, float] = {}
    for r in results:
        if r.grad_norm is not None:
            by_step.update(zip(r.loss_steps, r.grad_norm, strict=True))
    norms = []
    for step in range(first, first + trained):
        record = logged.get(step)
        norm = by_step.get(
            step, record.grad_norm if record is not None and record.clipped else None
        )
        if norm is None:
            return None
        norms.append(norm)
    return tuple(norms)


def _evaluations(
    results: Sequence[WorkerResult], logged: dict[int, StepCompleted], first: int, trained: int
) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """``eval_steps`` and ``eval_loss``: the held-out loss after each step that evaluated,
    from the last stage's ranks or else the event log's StepCompleted records."""
    by_step = {s: r.eval_loss for s, r in logged.items() if r.evaluated}
    for r in results:
        by_step.update(zip(r.eval_steps, r.eval_loss, strict=True))
    steps = sorted(s for s in by_step if first <= s < first + trained)
    return tuple(steps), tuple(by_step[s] for s in steps)


def _step_times(
    results: Sequence[WorkerResult], logged: dict[int, StepCompleted], first: int, trained: int
) -> list[float]:
    """Each step's time: its slowest rank's (a worker that joined mid-run records its
    step times from its own first step on); a step no surviving rank trained, the time
    its last stage reported."""
    slowest: dict[int, float] = {}
    for r in results:
        for step, seconds in enumerate(r.step_time_s, start=r.first_step):
            slowest[step] = max(slowest.get(step, 0.0), seconds)
    return [
        slowest[step] if step in slowest else logged[step].step_time_s
        for step in range(first, first + trained)
    ]


def _digest_here(run_dir: Path, plan: Plan) -> str | None:
    """The digest of the final parameters, where this run directory holds every layer's;
    None where it holds some (a multi-host job without a shared run directory: each
    host's has the stages its ranks saved) or none."""
    try:
        params = load_params(run_dir)
    except FileNotFoundError:
        return None
    layers = {layer for stage in plan.stages for layer in stage.layers}
    return param_digest(params) if layers <= params.keys() else None


def _logged_steps(run_dir: Path) -> dict[int, StepCompleted]:
    """step -> the last StepCompleted the event log holds for it."""
    path = run_dir / rundir.EVENT_LOG
    if not path.is_file():
        return {}
    return {
        record.event.step: record.event
        for record in read_event_log(path)
        if isinstance(record.event, StepCompleted)
    }
