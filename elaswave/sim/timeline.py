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
    elaswave_start,
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


@dataclass
class _Run:
    """One simulation: what it runs (set once) and where it stands (advanced by its
    steps, like :class:`_State`)."""

    job: SimJob
    policy: SimPolicy
    full: Plan
    """The job's fault-free plan."""
    costs: RecoveryCosts
    events: list[TraceEvent]
    """The trace as the policy sees it (:func:`_as_seen`)."""
    until: float
    st: _State
    out: Timeline
    t: float = 0.0
    step: int = 0
    next_event: int = 0
    """Index in ``events`` of the first event not yet applied."""
    pending: list[ChangeRecord] = field(default_factory=list)
    """Removals waiting for their redone step."""
    redo_until: int = 0
    """Checkpoint-restart: MTTR ends when the lost steps are redone."""
    cache: dict[tuple, float] = field(default_factory=dict)
    """Step time per (plan, re-routed ranks, slowdowns)."""

    def peek(self) -> TraceEvent | None:
        return self.events[self.next_event] if self.next_event < len(self.events) else None

    def step_time(self) -> float:
        st, job = self.st, self.job
        slow = frozenset((r, f) for r, f in st.slow.items() if r in st.plan.ranks)
        key = (st.plan, st.rerouted, slow)
        if key not in self.cache:
            self.cache[key] = (
                recycle_time(job, st.plan, st.rerouted, dict(slow))
                if self.policy is SimPolicy.RECYCLE
                else plan_step_time(st.plan, job.layers, job.device, slowdowns=dict(slow)).step_s
            )
        return self.cache[key]

    def rollback(self) -> None:
        """Back to the last checkpoint: the steps since are lost, to be redone."""
        done, _ = self.st.checkpoint
        del self.out.steps[done:]
        self.step = done


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
    costs = costs or RecoveryCosts()
    full = job.plan()
    if policy.is_elaswave:  # its planner chooses the schedule too
        full = elaswave_start(job)
    run = _Run(
        job=job,
        policy=policy,
        full=full,
        costs=costs,
        events=_as_seen(policy, trace, costs),
        until=until_s if until_s is not None else math.inf,
        st=_State(full, alive=set(full.ranks)),
        out=Timeline(policy, span_s=until_s),
    )
    while run.step < steps and run.t < run.until:
        if run.st.waiting is not None:  # nothing trains until nodes return
            if not _wait_for_nodes(run):
                break
            continue
        dt = run.step_time()
        event = run.peek()
        if event is not None and event.time_ms / 1000 < run.t + dt:
            run.next_event += 1
            _event_in_step(run, event, dt)
            continue
        run.t = _finish_step(run.out, run.st, run.step, run.t, dt, costs)
        run.step += 1
        if run.step >= run.redo_until:
            for rec in run.pending:
                run.out.changes.append(replace(rec, mttr_s=run.t - rec.time_s))
            run.pending.clear()
    run.out.changes.extend(run.pending)
    run.out.changes.sort(key=lambda c: c.time_s)
    return run.out


def _wait_for_nodes(run: _Run) -> bool:
    """Apply the next event to a job that waits for nodes (resuming it if it can);
    False when the trace or the simulated span ends first."""
    st, out = run.st, run.out
    assert st.waiting is not None
    event = run.peek()
    if event is None or event.time_ms / 1000 >= run.until:
        out.waited_s += run.until - run.t
        run.t = run.until
        return False
    run.next_event += 1
    at = max(run.t, event.time_ms / 1000)
    out.waited_s += at - run.t
    run.t = at
    ranks = tuple(run.job.ranks_of_node(event.node))
    if event.kind is EventKind.SLOW:
        _slow(st, event, ranks)
        return True
    if event.kind is EventKind.REMOVE:
        st.alive -= set(ranks)
        st.waiting |= set(ranks) & set(st.plan.ranks)
        return True
    st.alive |= set(ranks)
    resumed = _resume(run.job, run.policy, st, run.costs)
    if resumed is None:
        return True
    rollback, record = resumed
    if rollback:
        run.rollback()
        run.redo_until = run.step + 1
    out.changes.append(replace(record, time_s=run.t, node=event.node, ranks=ranks))
    run.t += record.overhead_s
    return True


def _event_in_step(run: _Run, event: TraceEvent, dt: float) -> None:
    """An event before the end of the step that takes ``dt``: a removal interrupts it;
    a slowdown or an addition waits for the step boundary."""
    at = max(run.t, event.time_ms / 1000)
    ranks = tuple(run.job.ranks_of_node(event.node))
    if event.kind is EventKind.REMOVE:
        _removal(run, event, at, ranks)
        return
    run.t = _finish_step(run.out, run.st, run.step, run.t, dt, run.costs)
    run.step += 1
    run.t = _boundary_change(run, event, ranks)


def _removal(run: _Run, event: TraceEvent, at: float, ranks: tuple[int, ...]) -> None:
    """Node ``event.node`` leaves at ``at``, mid-step: the policy answers with a new
    plan after its overhead, or the job waits for nodes."""
    st, policy, job = run.st, run.policy, run.job
    st.alive -= set(ranks)
    gone = [r for r in ranks if r in st.plan.ranks and r not in st.rerouted]
    if not gone:
        return  # the node held nothing this policy still used
    old, lost = st.plan, at - run.t
    try:
        new = answer(policy, job, old, gone, rerouted=st.rerouted, alive=st.alive, shorten=False)
    except (Unrecoverable, OutOfMemory) as exc:
        st.waiting = set(gone) | (set(st.rerouted) - st.alive)
        why = f"waits for nodes: {exc}"
        run.pending.append(ChangeRecord(at, "remove", event.node, ranks, lost, 0.0, None, why))
        run.t = at
        return
    st.plan, st.rerouted = new.plan, new.rerouted
    if policy is SimPolicy.RESTART:
        lost = at - st.checkpoint[1]
        run.redo_until = run.step + 1  # the interrupted step, once the lost ones are redone
        run.rollback()
    cost = _removal_cost(job, policy, old, st, set(gone), run.costs, run.step_time(), new)
    run.pending.append(
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
    run.t = at + cost.seconds


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
            power_budget=job.power_budget, schedules=job.schedules,
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


def _boundary_change(run: _Run, event: TraceEvent, ranks: tuple[int, ...]) -> float:
    """Apply a slowdown or an addition at a step boundary; returns the time after it."""
    st = run.st
    if event.kind is EventKind.SLOW:
        _slow(st, event, ranks)
    else:
        st.alive |= set(ranks)
    old = st.plan
    cost: Overhead | None
    if run.policy.is_elaswave:
        reason, cost = _elaswave_replan(run, event, ranks)
    elif event.kind is EventKind.SLOW:
        reason, cost = "no fail-slow mitigation", None
    elif run.policy is SimPolicy.RESTART:
        reason, cost = _restart_for_addition(run, old)
    else:  # TorchFT and ReCycle: whole replicas come back, re-routed ranks return
        reason, cost = _replicas_return(run, old)
    seconds = cost.seconds if cost else 0.0
    run.out.changes.append(
        ChangeRecord(
            run.t,
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
    return run.t + seconds


def _elaswave_replan(
    run: _Run, event: TraceEvent, ranks: tuple[int, ...]
) -> tuple[str, Overhead | None]:
    """ElasWave at a boundary: joiners take places (restoring stages and micro-batches a
    shrunk pipeline lost), slowdowns rebalance; the overhead if the plan changed."""
    job, st = run.job, run.st
    old = st.plan
    joined = [r for r in ranks if r not in old.ranks] if event.kind is EventKind.ADD else []
    rebalancing = Rebalancing(
        policy=REBALANCE[run.policy],
        slowdowns={r: f for r, f in st.slow.items() if r in old.ranks},
        layers=job.layers,
        device=job.device,
        power_budget=job.power_budget,
        schedules=job.schedules,
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
    if st.plan is old:
        return reason, None
    redo = plan_step_time(st.plan, job.layers, job.device).step_s
    return reason, mttr.elaswave_replan(
        old, st.plan, joined, job.layers, job.device, run.costs, redo_step_s=redo
    )


def _restart_for_addition(run: _Run, old: Plan) -> tuple[str, Overhead | None]:
    """Checkpoint-restart after an addition: a restart if a whole replica is back."""
    job = run.job
    new, reason = restart_plan(job, run.st.alive)
    if new.stages == old.stages:
        return "no whole replica to add: keeps running", None
    run.st.plan = new
    return reason, mttr.restart(
        new,
        job.layers,
        job.device,
        run.costs,
        devices_per_node=job.devices_per_node,
        detect=False,
    )


def _replicas_return(run: _Run, old: Plan) -> tuple[str, Overhead | None]:
    """TorchFT and ReCycle at a boundary: whole replicas come back, re-routed ranks
    take their micro-batches back."""
    st = run.st
    back = st.rerouted & st.alive
    st.rerouted -= back
    st.plan = _restore_replicas(old, run.full, st.alive)
    reason = "replicas rejoin" if st.plan is not old else ""
    if back:
        reason = f"{reason}; ranks {sorted(back)} take their micro-batches back".lstrip("; ")
    if st.plan is not old or back:
        return reason, mttr.rejoin(st.plan, run.job.layers, run.job.device, run.costs)
    return "no whole replica to add", None
