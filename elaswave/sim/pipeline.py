"""One training step of a pipeline plan, simulated event by event.

Each stage runs the runtime's own 1F1B action list (:func:`elaswave.runtime.schedule.
one_f_one_b`); a forward waits for the previous stage's forward of the same micro-batch
plus the activation transfer, a backward for the next stage's backward plus the gradient
transfer. Sends do not block the sender (the runtime posts them and waits at the end of
the step). After its last backward each stage runs its DP reduce-scatter and all-gather.
The step ends when the last stage's collectives do.

Per-stage times come from the engine's cost model (:mod:`elaswave.engine.cost`) for a
:class:`~elaswave.engine.plan.Plan`: the busiest replica's compute at the stage's clock
and slowdown, the engine's stage-to-stage transfer time with fan-in and fan-out, and the
ring collective time of the stage's parameters. The same functions pace the emulated
device, so a simulated step and an emulated run of a small plan agree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from elaswave.engine.cost import (
    DeviceSpec,
    LayerCost,
    compute_time,
    ring_allreduce_time,
    stage_p2p_time,
)
from elaswave.engine.plan import Plan
from elaswave.runtime.schedule import Op, one_f_one_b


@dataclass(frozen=True)
class StageTimes:
    """Seconds one stage spends per micro-batch, and once per step."""

    fwd_s: float
    bwd_s: float
    send_fwd_s: float
    """Activations of one micro-batch to the next stage (0 on the last stage)."""
    send_bwd_s: float
    """Input gradients of one micro-batch to the previous stage (0 on the first)."""
    sync_s: float
    """DP gradient reduce-scatter plus parameter all-gather after the last backward."""


@dataclass(frozen=True)
class StepSim:
    step_s: float
    compute_end_s: tuple[float, ...]
    """When each stage's last backward ends."""
    busy_s: tuple[float, ...]
    """Compute seconds of each stage's busiest replica in the step."""

    @property
    def bubble(self) -> float:
        """Idle fraction of the pipeline's compute (0 for a perfectly packed step)."""
        return 1.0 - sum(self.busy_s) / (len(self.busy_s) * self.step_s)


def simulate_step(stages: Sequence[StageTimes], num_micro_batches: int) -> StepSim:
    """The step time of a 1F1B pipeline with these per-stage times."""
    p, m = len(stages), num_micro_batches
    if p < 1 or m < 1:
        raise ValueError(f"{p} stages, {m} micro-batches: need at least 1 of each")
    actions = [one_f_one_b(num_stages=p, stage=s, num_micro_batches=m) for s in range(p)]
    end: dict[tuple[Op, int, int], float] = {}
    free = [0.0] * p
    nxt = [0] * p
    remaining = p * 2 * m
    while remaining:
        progressed = False
        for s in range(p):
            while nxt[s] < len(actions[s]):
                op, mb = actions[s][nxt[s]]
                if op is Op.FORWARD:
                    dep = None if s == 0 else (Op.FORWARD, s - 1, mb)
                    delay = 0.0 if s == 0 else stages[s - 1].send_fwd_s
                    dur = stages[s].fwd_s
                else:
                    dep = (Op.FORWARD, s, mb) if s == p - 1 else (Op.BACKWARD, s + 1, mb)
                    delay = 0.0 if s == p - 1 else stages[s + 1].send_bwd_s
                    dur = stages[s].bwd_s
                if dep is not None and dep not in end:
                    break
                ready = 0.0 if dep is None else end[dep] + delay
                start = max(free[s], ready)
                free[s] = end[(op, s, mb)] = start + dur
                nxt[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # the 1F1B lists are deadlock-free; this guards the model
            raise RuntimeError("pipeline simulation made no progress")
    finish = tuple(free)
    step = max(f + st.sync_s for f, st in zip(finish, stages, strict=True))
    busy = tuple(m * (st.fwd_s + st.bwd_s) for st in stages)
    return StepSim(step, finish, busy)


def stage_times(
    plan: Plan,
    layers: Sequence[LayerCost],
    device: DeviceSpec,
    *,
    slowdowns: Mapping[int, float] | None = None,
) -> list[StageTimes]:
    """Per-stage times of ``plan`` under the cost model (``slowdowns``: rank -> factor)."""
    slow = dict(slowdowns or {})
    cost = {c.index: c for c in layers}
    out = []
    for s in plan.stages:
        mhz = s.mhz or device.base_mhz
        if s.rotate:  # each replica runs every share in turn: the mean, at its speed
            load = s.load * max(slow.get(r, 1.0) for r in s.ranks)
        else:
            load = max(size * slow.get(r, 1.0) for r, size in zip(s.ranks, s.sizes, strict=True))
        fwd = compute_time(load * sum(cost[i].fwd_flops_per_sample for i in s.layers), device, mhz)
        bwd = compute_time(load * sum(cost[i].bwd_flops_per_sample for i in s.layers), device, mhz)
        params = sum(cost[i].params for i in s.layers)
        sync = ring_allreduce_time(params * 4, device, dp=s.dp) if s.dp > 1 else 0.0
        out.append(StageTimes(fwd, bwd, 0.0, 0.0, sync))
    for a, b in zip(plan.stages, plan.stages[1:], strict=False):
        kw = {
            "sender_dp": a.dp,
            "sender_micro_batch": a.load,
            "receiver_dp": b.dp,
            "receiver_micro_batch": b.load,
        }
        fwd_bytes = cost[a.layer_stop - 1].output_bytes_per_sample
        out[a.stage] = dataclasses.replace(
            out[a.stage], send_fwd_s=stage_p2p_time(fwd_bytes, device, **kw)
        )
        back = {
            "sender_dp": b.dp,
            "sender_micro_batch": b.load,
            "receiver_dp": a.dp,
            "receiver_micro_batch": a.load,
        }
        out[b.stage] = dataclasses.replace(
            out[b.stage], send_bwd_s=stage_p2p_time(fwd_bytes, device, **back)
        )
    return out


def plan_step_time(
    plan: Plan,
    layers: Sequence[LayerCost],
    device: DeviceSpec,
    *,
    slowdowns: Mapping[int, float] | None = None,
) -> StepSim:
    """Simulate one step of ``plan``."""
    return simulate_step(
        stage_times(plan, layers, device, slowdowns=slowdowns), plan.num_micro_batches
    )
