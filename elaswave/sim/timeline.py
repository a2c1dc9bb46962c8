"""A job's steps under a trace of elastic events, for one policy.

Training advances step by step at the simulated step time of the current plan (cached
per plan, re-routed ranks and slowdowns). A node removed mid-step loses the step's work
so far; the policy pays its recovery overhead (:mod:`elaswave.sim.mttr`), answers with
a new plan, and the step is redone. Checkpoint-restart also loses, and redoes, every
step since its last checkpoint. Slowdowns and additions take effect at the next step
boundary; a returning node's processes start in the background first (the restart
time of :class:`~elaswave.sim.mttr.RecoveryCosts`), except under checkpoint-restart,
which restarts the whole job for it. MTTR of a removal runs from the event to the end
of the redone step, as the runtime measures it; for checkpoint-restart, to the end of
the step the failure hit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from elaswave.engine.plan import Plan
from elaswave.engine.recovery import Rebalancing, next_plan
from elaswave.engine.steptime import plan_step_time
from elaswave.fabric.errors import Unrecoverable
from elaswave.sim import mttr
from elaswave.sim.mttr import Overhead, RecoveryCosts
from elaswave.sim.policies import (
    REBALANCE,
    SimJob,
    SimPolicy,
    answer,
    keep_replicas,
    recycle_time,
    restart_plan,
)
from elaswave.sim.trace import EventKind, TraceEvent


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
    """Work thrown away: the interrupted step, and for checkpoint-restart every step
    since the last checkpoint."""
    overhead_s: float
    mttr_s: float | None
    """Event to the end of the first step on the new plan (None if the job stopped)."""
    reason: str
    parts: dict[str, float] = field(default_factory=dict)
    """What the overhead is made of, seconds."""
    moved_bytes: float = 0.0
    """Most bytes one device received for the change."""


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


@dataclass
class _State:
    """What a policy runs now."""

    plan: Plan
    rerouted: frozenset[int] = frozenset()
    slow: dict[int, float] = field(default_factory=dict)
    alive: set[int] = field(default_factory=set)
    checkpoint: tuple[int, float] = (0, 0.0)
    """Checkpoint-restart: (steps done, time) at the last checkpoint."""


def simulate(
    job: SimJob,
    policy: SimPolicy,
    trace: Sequence[TraceEvent],
    *,
    steps: int,
    costs: RecoveryCosts | None = None,
) -> Timeline:
    """Run ``steps`` training steps of ``job`` under ``trace`` with ``policy``."""
    costs = costs or RecoveryCosts()
    full = job.plan()
    st = _State(full, alive=set(full.ranks))
    cache: dict[tuple, float] = {}

    def step_time() -> float:
        slow = frozenset((r, f) for r, f in st.slow.items() if r in st.plan.ranks)
        key = (st.plan, st.rerouted, slow)
        if key not in cache:
            cache[key] = (
                recycle_time(job, st.plan, st.rerouted, dict(slow))
                if policy is SimPolicy.RECYCLE
                else plan_step_time(st.plan, job.layers, job.device, slowdowns=dict(slow)).step_s
            )
        return cache[key]

    out = Timeline(policy)
    events = _as_seen(policy, trace, costs)
    t, step, i = 0.0, 0, 0
    pending: list[ChangeRecord] = []  # removals waiting for their redone step
    redo_until = 0  # checkpoint-restart: MTTR ends when the lost steps are redone
    while step < steps:
        dt = step_time()
        event = events[i] if i < len(events) else None
        if event is not None and event.time_ms / 1000 < t + dt:
            i += 1
            at = max(t, event.time_ms / 1000)
            ranks = tuple(job.ranks_of_node(event.node))
            if event.kind is EventKind.REMOVE:
                st.alive -= set(ranks)
                gone = [r for r in ranks if r in st.plan.ranks and r not in st.rerouted]
                if not gone:
                    continue  # the node held nothing this policy still used
                old, lost = st.plan, at - t
                try:
                    new = answer(policy, job, old, gone, rerouted=st.rerouted, alive=st.alive)
                except Unrecoverable as exc:
                    out.stopped = f"node{event.node} removed at {at:.1f} s: {exc}"
                    break
                st.plan, st.rerouted = new.plan, new.rerouted
                if policy is SimPolicy.RESTART:
                    done, when = st.checkpoint
                    lost = at - when
                    redo_until = step + 1
                    del out.steps[done:]
                    step = done
                cost = _removal_cost(job, policy, old, st, set(gone), costs, step_time())
                pending.append(
                    ChangeRecord(
                        at,
                        "remove",
                        event.node,
                        ranks,
                        lost,
                        cost.seconds,
                        None,
                        new.reason,
                        cost.parts,
                        cost.moved_bytes,
                    )
                )
                t = at + cost.seconds
                continue
            # Slowdowns and additions wait for the step boundary.
            t = _finish_step(out, st, step, t, dt, costs, policy)
            step += 1
            t = _boundary_change(job, policy, full, st, event, ranks, t, costs, out)
            continue
        t = _finish_step(out, st, step, t, dt, costs, policy)
        step += 1
        if step >= redo_until:
            for rec in pending:
                out.changes.append(replace(rec, mttr_s=t - rec.time_s))
            pending.clear()
    out.changes.extend(pending)
    out.changes.sort(key=lambda c: c.time_s)
    return out


def _as_seen(
    policy: SimPolicy, trace: Sequence[TraceEvent], costs: RecoveryCosts
) -> list[TraceEvent]:
    """The trace as ``policy`` sees it: a returning node's processes start while the job
    trains (every policy but checkpoint-restart, which restarts everything anyway), so
    its ranks can join ``process_restart_s`` after the node is back; a node removed
    again before then never joins."""
    events = sorted(trace, key=lambda e: e.time_ms)
    if policy is SimPolicy.RESTART:
        return events
    delay_ms = costs.process_restart_s * 1000
    out = []
    for k, e in enumerate(events):
        if e.kind is EventKind.ADD:
            ready = e.time_ms + delay_ms
            if any(
                later.kind is EventKind.REMOVE and later.node == e.node and later.time_ms < ready
                for later in events[k + 1 :]
            ):
                continue
            e = replace(e, time_ms=ready)
        out.append(e)
    return sorted(out, key=lambda e: e.time_ms)


def _finish_step(
    out: Timeline,
    st: _State,
    step: int,
    t: float,
    dt: float,
    costs: RecoveryCosts,
    policy: SimPolicy,
) -> float:
    t += dt
    out.steps.append(StepRecord(step, t, dt, st.plan.global_batch))
    if policy is SimPolicy.RESTART and (step + 1) % costs.checkpoint_every == 0:
        st.checkpoint = (step + 1, t)
    return t


def _removal_cost(
    job: SimJob,
    policy: SimPolicy,
    old: Plan,
    st: _State,
    gone: set[int],
    costs: RecoveryCosts,
    redo_s: float,
) -> Overhead:
    if policy.is_elaswave:
        return mttr.elaswave_removal(
            old, st.plan, gone, job.layers, job.device, costs, redo_step_s=redo_s
        )
    if policy is SimPolicy.RECYCLE:
        return mttr.recycle_removal(costs)
    if policy is SimPolicy.TORCHFT:
        return mttr.torchft_removal(costs)
    return mttr.restart(
        st.plan,
        job.layers,
        job.device,
        costs,
        devices_per_node=job.devices_per_node,
        detect=True,
    )


def _boundary_change(
    job: SimJob,
    policy: SimPolicy,
    full: Plan,
    st: _State,
    event: TraceEvent,
    ranks: tuple[int, ...],
    t: float,
    costs: RecoveryCosts,
    out: Timeline,
) -> float:
    """Apply a slowdown or an addition at a step boundary; returns the time after it."""
    if event.kind is EventKind.SLOW:
        for r in ranks:
            if event.factor == 1.0:
                st.slow.pop(r, None)
            else:
                st.slow[r] = event.factor
    else:
        st.alive |= set(ranks)
    old = st.plan
    cost: Overhead | None = None
    if policy.is_elaswave:
        joined = [r for r in ranks if r not in old.ranks] if event.kind is EventKind.ADD else []
        rebalancing = Rebalancing(
            policy=REBALANCE[policy],
            slowdowns={r: f for r, f in st.slow.items() if r in old.ranks},
            layers=job.layers,
            device=job.device,
            power_budget=job.power_budget,
        )
        st.plan, reason = next_plan(old, [], rebalancing, joined=joined)
        if st.plan is not old:
            redo = plan_step_time(st.plan, job.layers, job.device).step_s
            cost = mttr.elaswave_replan(
                old, st.plan, joined, job.layers, job.device, costs, redo_step_s=redo
            )
    elif event.kind is EventKind.SLOW:
        reason = "no fail-slow mitigation"
    elif policy is SimPolicy.RESTART:
        new, reason = restart_plan(job, st.alive)
        if new.stages != old.stages:
            st.plan = new
            cost = mttr.restart(
                new,
                job.layers,
                job.device,
                costs,
                devices_per_node=job.devices_per_node,
                detect=False,
            )
        else:
            reason = "no whole replica to add: keeps running"
    else:  # TorchFT and ReCycle: whole replicas come back, re-routed ranks return
        back = st.rerouted & st.alive
        st.rerouted -= back
        st.plan = _restore_replicas(old, full, st.alive)
        reason = "replicas rejoin" if st.plan is not old else ""
        if back:
            reason = f"{reason}; ranks {sorted(back)} take their micro-batches back".lstrip("; ")
        if st.plan is not old or back:
            cost = mttr.rejoin(st.plan, job.layers, job.device, costs)
        else:
            reason = "no whole replica to add"
    seconds = cost.seconds if cost else 0.0
    out.changes.append(
        ChangeRecord(
            t,
            event.kind.value,
            event.node,
            ranks,
            0.0,
            seconds,
            seconds,
            reason,
            cost.parts if cost else {},
            cost.moved_bytes if cost else 0.0,
        )
    )
    return t + seconds
