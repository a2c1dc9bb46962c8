"""A job's steps under a trace of elastic events, for one policy.

Training advances step by step at the simulated step time of the current plan (cached
per plan and slowdowns). A node removed mid-step loses the step's work so far; the
policy pays its recovery overhead, answers with a new plan, and the step is redone.
Slowdowns and additions take effect at the next step boundary. MTTR of a removal runs
from the event to the end of the redone step, as the runtime measures it.

The recovery overheads are modelling assumptions (:class:`Overheads`), reported with
every result; the plans and step times are the runtime's planners and cost model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from elaswave.engine.plan import Plan
from elaswave.engine.recovery import Rebalancing, next_plan
from elaswave.fabric.errors import Unrecoverable
from elaswave.sim.pipeline import plan_step_time
from elaswave.sim.policies import REBALANCE, SimJob, SimPolicy, answer, keep_replicas
from elaswave.sim.trace import EventKind, TraceEvent


@dataclass(frozen=True)
class Overheads:
    """Seconds of stopped training per change (assumptions, not measurements)."""

    elaswave_s: float = 1.0
    """Detect, plan, communicator edit and live remap of one change."""
    torchft_s: float = 5.0
    """Quorum and process-group reconfiguration after a replica leaves."""
    torchft_rejoin_s: float = 120.0
    """A replica rejoining: process restart and live state transfer."""

    def of(self, policy: SimPolicy, kind: EventKind) -> float:
        if policy is SimPolicy.TORCHFT:
            return self.torchft_rejoin_s if kind is EventKind.ADD else self.torchft_s
        return self.elaswave_s


@dataclass(frozen=True)
class StepRecord:
    step: int
    end_s: float
    step_s: float
    samples: int


@dataclass(frozen=True)
class ChangeRecord:
    time_s: float
    kind: str
    node: int
    ranks: tuple[int, ...]
    lost_s: float
    """Work of the interrupted step thrown away."""
    overhead_s: float
    mttr_s: float | None
    """Event to the end of the first step on the new plan (None if the job stopped)."""
    reason: str


@dataclass
class Timeline:
    policy: SimPolicy
    steps: list[StepRecord] = field(default_factory=list)
    changes: list[ChangeRecord] = field(default_factory=list)
    stopped: str | None = None
    """Why the job could not go on, if it stopped."""

    @property
    def samples_per_s(self) -> float:
        """Time-averaged throughput over the simulated span."""
        if not self.steps:
            return 0.0
        return sum(s.samples for s in self.steps) / self.steps[-1].end_s


def _restore_replicas(plan: Plan, full: Plan, alive: set[int]) -> Plan:
    """TorchFT after an addition: every replica of ``full`` whose ranks all live again
    takes part, with its original micro-batch share."""
    keep = [i for i in range(full.stages[0].dp) if all(s.ranks[i] in alive for s in full.stages)]
    if not keep:
        return plan
    restored = keep_replicas(full, keep, generation=plan.generation + 1)
    return plan if restored.stages == plan.stages else restored


def simulate(
    job: SimJob,
    policy: SimPolicy,
    trace: Sequence[TraceEvent],
    *,
    steps: int,
    overheads: Overheads | None = None,
) -> Timeline:
    """Run ``steps`` training steps of ``job`` under ``trace`` with ``policy``."""
    over = overheads or Overheads()
    full = job.plan()
    plan = full
    slow: dict[int, float] = {}
    alive = set(full.ranks)
    cache: dict[tuple[Plan, frozenset], float] = {}

    def step_time(p: Plan) -> float:
        key = (p, frozenset((r, f) for r, f in slow.items() if r in p.ranks))
        if key not in cache:
            cache[key] = plan_step_time(p, job.layers, job.device, slowdowns=dict(key[1])).step_s
        return cache[key]

    out = Timeline(policy)
    events = sorted(trace, key=lambda e: e.time_ms)
    t, step, i = 0.0, 0, 0
    pending: list[ChangeRecord] = []  # removals waiting for their redone step
    while step < steps:
        st = step_time(plan)
        event = events[i] if i < len(events) else None
        if event is not None and event.time_ms / 1000 < t + st:
            i += 1
            at = max(t, event.time_ms / 1000)
            ranks = tuple(r for r in job.ranks_of_node(event.node))
            if event.kind is EventKind.REMOVE:
                gone = [r for r in ranks if r in plan.ranks]
                alive -= set(ranks)
                if not gone:
                    continue  # the node held nothing this policy still used
                try:
                    new = answer(policy, job, plan, gone)
                except Unrecoverable as exc:
                    out.stopped = f"node{event.node} removed at {at:.1f} s: {exc}"
                    break
                cost = over.of(policy, event.kind)
                pending.append(
                    ChangeRecord(at, "remove", event.node, ranks, at - t, cost, None, new.reason)
                )
                plan, t = new.plan, at + cost
                continue
            # Slowdowns and additions wait for the step boundary.
            t += st
            out.steps.append(StepRecord(step, t, st, plan.global_batch))
            step += 1
            t, plan = _boundary_change(job, policy, plan, full, event, ranks, slow, alive, t,
                                       over, out)  # fmt: skip
            continue
        t += st
        out.steps.append(StepRecord(step, t, st, plan.global_batch))
        step += 1
        for rec in pending:
            out.changes.append(ChangeRecord(**{**rec.__dict__, "mttr_s": t - rec.time_s}))
        pending.clear()
    out.changes.extend(pending)
    out.changes.sort(key=lambda c: c.time_s)
    return out


def _boundary_change(
    job: SimJob,
    policy: SimPolicy,
    plan: Plan,
    full: Plan,
    event: TraceEvent,
    ranks: tuple[int, ...],
    slow: dict[int, float],
    alive: set[int],
    t: float,
    over: Overheads,
    out: Timeline,
) -> tuple[float, Plan]:
    """Apply a slowdown or an addition at a step boundary; returns (time, plan)."""
    if event.kind is EventKind.SLOW:
        for r in ranks:
            if event.factor == 1.0:
                slow.pop(r, None)
            else:
                slow[r] = event.factor
    else:
        alive |= set(ranks)
    if policy is SimPolicy.TORCHFT:
        new = plan if event.kind is EventKind.SLOW else _restore_replicas(plan, full, alive)
        reason = "no mitigation" if new is plan else "replicas rejoin"
    else:
        joined = [r for r in ranks if r not in plan.ranks] if event.kind is EventKind.ADD else []
        rebalancing = Rebalancing(
            policy=REBALANCE[policy],
            slowdowns={r: f for r, f in slow.items() if r in plan.ranks},
            layers=job.layers,
            device=job.device,
        )
        new, reason = next_plan(plan, [], rebalancing, joined=joined)
    cost = 0.0 if new is plan else over.of(policy, event.kind)
    out.changes.append(
        ChangeRecord(t, event.kind.value, event.node, ranks, 0.0, cost, cost, reason)
    )
    return t + cost, new
