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

A policy that cannot go on after a removal (a stage of ReCycle's job or of a TorchFT
replica set lost for good, fewer ranks than a restart needs, no rank left) does not
stop: the job **waits** for nodes. ElasWave waits with its state in memory while any
rank of its plan lives, and resumes when the returning ranks let
:func:`~elaswave.engine.reshape.reshape` form a pipeline (ranks change stage, stages may
merge); every other resumption is a checkpoint-restart on the ranks alive (every policy
checkpoints every ``checkpoint_every`` steps, so steps since then are redone).
``until_s`` ends the simulation at a time rather than a step count, so that every policy
is measured over the same stretch of the trace.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from elaswave.engine.plan import Plan
from elaswave.engine.recovery import Rebalancing, next_plan
from elaswave.engine.reshape import reshape
from elaswave.engine.steptime import plan_step_time
from elaswave.fabric.errors import Unrecoverable
from elaswave.sim import mttr
from elaswave.sim.mttr import Overhead, RecoveryCosts
from elaswave.sim.policies import (
    REBALANCE,
    PolicyPlan,
    SimJob,
    SimPolicy,
    answer,
    keep_replicas,
    recycle_time,
    restart_plan,
)
from elaswave.sim.recycle import OutOfMemory
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
    """Why the job could not go on, if it stopped (it waits for nodes instead, so only
    a trace that ends while it waits leaves it unfinished: see ``waited_s``)."""
    waited_s: float = 0.0
    """Time spent waiting for nodes, training nothing."""
    span_s: float | None = None
    """The simulated stretch (``until_s``); None: up to the last step."""

    @property
    def samples_per_s(self) -> float:
        """Time-averaged throughput over the simulated span."""
        end = (
            self.span_s if self.span_s is not None else (self.steps[-1].end_s if self.steps else 0)
        )
        if not self.steps or end <= 0:
            return 0.0
        return sum(s.samples for s in self.steps if s.end_s <= end) / end


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
    """(steps done, time) at the last checkpoint."""
    waiting: set[int] | None = None
    """While the job waits for nodes: the ranks of ``plan`` that are gone."""


def simulate(
    job: SimJob,
    policy: SimPolicy,
    trace: Sequence[TraceEvent],
    *,
    steps: int | None = None,
    until_s: float | None = None,
    costs: RecoveryCosts | None = None,
) -> Timeline:
    """Run ``job`` under ``trace`` with ``policy`` for ``steps`` training steps or until
    ``until_s`` seconds, whichever comes first (at least one must be given)."""
    if steps is None and until_s is None:
        raise ValueError("give steps, until_s or both")
    steps = steps if steps is not None else 2**62
    until = until_s if until_s is not None else math.inf
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

    out = Timeline(policy, span_s=until_s)
    events = _as_seen(policy, trace, costs)
    t, step, i = 0.0, 0, 0
    pending: list[ChangeRecord] = []  # removals waiting for their redone step
    redo_until = 0  # checkpoint-restart: MTTR ends when the lost steps are redone
    while step < steps and t < until:
        if st.waiting is not None:  # nothing trains until nodes return
            event = events[i] if i < len(events) else None
            if event is None or event.time_ms / 1000 >= until:
                out.waited_s += until - t
                t = until
                break
            i += 1
            at = max(t, event.time_ms / 1000)
            out.waited_s += at - t
            t = at
            ranks = tuple(job.ranks_of_node(event.node))
            if event.kind is EventKind.SLOW:
                _slow(st, event, ranks)
                continue
            if event.kind is EventKind.REMOVE:
                st.alive -= set(ranks)
                st.waiting |= set(ranks) & set(st.plan.ranks)
                continue
            st.alive |= set(ranks)
            resumed = _resume(job, policy, st, costs)
            if resumed is None:
                continue
            rollback, record = resumed
            if rollback:
                done, _ = st.checkpoint
                del out.steps[done:]
                step = done
                redo_until = step + 1
            out.changes.append(replace(record, time_s=t, node=event.node, ranks=ranks))
            t += record.overhead_s
            continue
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
                    new = answer(
                        policy, job, old, gone, rerouted=st.rerouted, alive=st.alive, shorten=False
                    )
                except (Unrecoverable, OutOfMemory) as exc:
                    st.waiting = set(gone) | (set(st.rerouted) - st.alive)
                    why = f"waits for nodes: {exc}"
                    pending.append(
                        ChangeRecord(at, "remove", event.node, ranks, lost, 0.0, None, why)
                    )
                    t = at
                    continue
                st.plan, st.rerouted = new.plan, new.rerouted
                if policy is SimPolicy.RESTART:
                    done, when = st.checkpoint
                    lost = at - when
                    redo_until = step + 1
                    del out.steps[done:]
                    step = done
                cost = _removal_cost(job, policy, old, st, set(gone), costs, step_time(), new)
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
            t = _finish_step(out, st, step, t, dt, costs)
            step += 1
            t = _boundary_change(job, policy, full, st, event, ranks, t, costs, out)
            continue
        t = _finish_step(out, st, step, t, dt, costs)
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
    removals: dict[int, list[tuple[float, int]]] = {}  # node -> (time, index), in order
    for k, e in enumerate(events):
        if e.kind is EventKind.REMOVE:
            removals.setdefault(e.node, []).append((e.time_ms, k))
    out = []
    for k, e in enumerate(events):
        if e.kind is EventKind.ADD:
            ready = e.time_ms + delay_ms
            later = removals.get(e.node, [])
            j = bisect.bisect_right(later, (e.time_ms, k))  # its node's next removal
            if j < len(later) and later[j][0] < ready:
                continue
            e = replace(e, time_ms=ready)
        out.append(e)
    return sorted(out, key=lambda e: e.time_ms)


def _finish_step(
    out: Timeline, st: _State, step: int, t: float, dt: float, costs: RecoveryCosts
) -> float:
    t += dt
    out.steps.append(StepRecord(step, t, dt, st.plan.global_batch))
    if (step + 1) % costs.checkpoint_every == 0:
        st.checkpoint = (step + 1, t)
    return t


def _slow(st: _State, event: TraceEvent, ranks: Sequence[int]) -> None:
    for r in ranks:
        if event.factor == 1.0:
            st.slow.pop(r, None)
        else:
            st.slow[r] = event.factor


def _resume(
    job: SimJob, policy: SimPolicy, st: _State, costs: RecoveryCosts
) -> tuple[bool, ChangeRecord] | None:
    """The plan a waiting job resumes on now, if any: (whether it rolls back to its last
    checkpoint, the change). ElasWave resumes from memory while a rank of its plan
    lives; otherwise the job restarts from its checkpoint on the ranks alive."""
    assert st.waiting is not None
    gone = st.waiting
    if policy.is_elaswave and set(st.plan.ranks) - gone:
        joined = sorted(st.alive - set(st.plan.ranks))
        rebalancing = Rebalancing(
            policy=REBALANCE[policy], layers=job.layers, device=job.device,
            power_budget=job.power_budget,
        )  # fmt: skip
        try:
            shaped = reshape(
                st.plan, gone, joined, rebalancing=rebalancing, max_stages=job.pp,
                samples=job.samples,
            )  # fmt: skip
        except Unrecoverable:
            return None
        old, st.plan, st.waiting = st.plan, shaped.plan, None
        cost = mttr.elaswave_reshape(
            old, st.plan, gone, shaped.move_bytes, job.layers, job.device, costs
        )
        why = f"resumes from memory: {shaped.reason}"
        return False, ChangeRecord(0.0, "resume", -1, (), 0.0, cost.seconds, cost.seconds, why,
                                   cost.parts, cost.moved_bytes)  # fmt: skip
    try:
        new, reason = restart_plan(job, st.alive)
    except Unrecoverable:
        return None
    st.plan, st.rerouted, st.waiting = new, frozenset(), None
    cost = mttr.restart(
        new, job.layers, job.device, costs, devices_per_node=job.devices_per_node, detect=False
    )
    why = f"resumes from its last checkpoint: {reason}"
    return True, ChangeRecord(0.0, "resume", -1, (), 0.0, cost.seconds, cost.seconds, why,
                              cost.parts, cost.moved_bytes)  # fmt: skip


def _removal_cost(
    job: SimJob,
    policy: SimPolicy,
    old: Plan,
    st: _State,
    gone: set[int],
    costs: RecoveryCosts,
    redo_s: float,
    outcome: PolicyPlan,
) -> Overhead:
    if policy.is_elaswave and outcome.stage_moves:
        return mttr.elaswave_reshape(
            old, st.plan, gone, outcome.move_bytes, job.layers, job.device, costs
        )
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
        _slow(st, event, ranks)
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
        shrunk = old.pp < job.pp or old.global_batch // old.num_micro_batches < job.samples
        if joined and shrunk:  # joiners may restore the stages and micro-batches it lost
            shaped = reshape(
                old, [], joined, rebalancing=rebalancing, max_stages=job.pp,
                samples=job.samples,
            )  # fmt: skip
            st.plan, reason = shaped.plan, f"ranks join: {shaped.reason}"
        else:
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
