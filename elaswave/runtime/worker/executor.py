"""The Recovery Executor's protocol on a worker: stop at a step boundary, report, agree
on the Core's plan (check its digest, acknowledge, wait for the commit, follow a
superseding announcement), take its generation, apply it and report it done.

A recovery (:func:`recover`) and a join (:func:`join`) are the same change: a joiner
applies the plan to an empty trainer (:func:`elaswave.runtime.worker.reconfigure.reconfigure`).
The Core's announcements reach the training thread through a :class:`Mailbox` (plans,
commits, failures) and a :class:`PauseBox` (the pending pause request).
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

from elaswave.bus.schema import (
    CheckpointRequest,
    CheckpointWritten,
    Event,
    FailureDetected,
    PauseRequest,
    PlanAck,
    PlanCommit,
    RecoveryDone,
    RecoveryPlan,
    RecoveryReady,
    WaitingForNodes,
    sender_name,
)
from elaswave.bus.session import Session
from elaswave.comm.abort import StepAborted
from elaswave.comm.release import ABORT_DEADLINE_S, device_healthy
from elaswave.comm.spec import CommError
from elaswave.comm.store import fresh_client
from elaswave.engine.change import Applied
from elaswave.engine.plan import Plan, plan_from_dict, plan_key, taken_back
from elaswave.engine.plan_inputs import PlanInputs, decode
from elaswave.engine.recovery import plan_digest
from elaswave.engine.replan import advanced, replan
from elaswave.runtime.job.faults import StepPhase
from elaswave.runtime.job.inputs import announced_rebalancing
from elaswave.runtime.worker.held_checkpoint import write_part
from elaswave.runtime.worker.memento import Memento, Settled, keep, nothing_kept
from elaswave.runtime.worker.reconfigure import drop, reconfigure, restore, roll_back
from elaswave.runtime.worker.tpgroup import TP_GROUP, unit_barrier, unit_report
from elaswave.runtime.worker.trainer import Trainer, WorkerContext

log = structlog.get_logger(__name__)

STOP_DUMP_S = 10.0
"""A rank that has not stopped this long after hearing a failure writes every thread's
stack to its log (:func:`dump_unless_stopped`): one held where no abort reaches (a
launch on a communicator, a device allocation) then shows where. A stop takes well
under a second; on an H200, a stage's ranks once took 29 s, and nothing said where."""


def dump_unless_stopped() -> None:
    """Called on the thread that hears a failure (before the training thread can read
    it): unless :func:`recover` has it within :data:`STOP_DUMP_S` (the training thread
    stopped), every thread's stack goes to this worker's log."""
    faulthandler.dump_traceback_later(STOP_DUMP_S, exit=False)


class Mailbox:
    """The Core's announcements, put by the bus thread, taken by the training loop.

    An event is kept until taken: the bus may deliver a plan before the failure it
    answers (a reordered or repaired message), and whichever the loop waits for first
    must not discard the other. Events of generations the worker has left are pruned.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._events: list[Event] = []
        self.settled = Settled()
        """The changes the Core announced finished (RecoveryFinished)."""

    def put(self, event: Event) -> None:
        with self._cond:
            self._events.append(event)
            self._cond.notify_all()

    def take(self, want: Callable[[Event], bool], timeout_s: float, what: str) -> Event:
        """The first kept event ``want`` accepts; TimeoutError naming ``what``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for i, event in enumerate(self._events):
                    if want(event):
                        return self._events.pop(i)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no {what} from the Core within {timeout_s:g} s")
                self._cond.wait(left)

    def prune(self, generation: int) -> None:
        """Forget events of generations below ``generation``."""
        with self._cond:
            self._events = [e for e in self._events if e.generation >= generation]


def _await_event(
    inbox: Mailbox,
    want: Callable[[Event], bool],
    timeout_s: float,
    what: str,
    *,
    waits: int | None = None,
    on_checkpoint: Callable[[CheckpointRequest], None] | None = None,
) -> Event:
    """The first event ``want`` accepts within ``timeout_s``. ``waits``: the generation
    whose WaitingForNodes extends the wait (the Core waits up to ``wait_s`` for joiners
    before it plans, or writes a checkpoint and stops the job), and whose
    CheckpointRequest ``on_checkpoint`` answers."""

    def wanted(e: Event) -> bool:
        return want(e) or (
            isinstance(e, WaitingForNodes | CheckpointRequest) and e.generation == waits
        )

    limit = timeout_s
    while True:
        event = inbox.take(wanted, limit, what)
        if want(event):
            return event
        if isinstance(event, CheckpointRequest):
            log.warning("recovery.checkpoint_requested", step=event.step)
            if on_checkpoint is not None:
                on_checkpoint(event)
            limit = timeout_s  # the Core stops the job once every part is written
            continue
        assert isinstance(event, WaitingForNodes)
        log.warning(
            "recovery.waiting_for_nodes", needed=event.needed, wait_s=event.wait_s,
            reason=event.reason,
        )  # fmt: skip
        limit = event.wait_s + timeout_s


def _answers(generation: int, attempt: int) -> Callable[[Event], bool]:
    """Whether an event answers the acknowledgment of announcement ``attempt`` of
    ``generation``: the Core's commit of it, or a later announcement superseding it."""

    def want(e: Event) -> bool:
        return e.generation == generation and (
            (isinstance(e, PlanCommit) and e.attempt == attempt)
            or (isinstance(e, RecoveryPlan) and e.attempt > attempt)
        )

    return want


def _agree(
    ctx: WorkerContext,
    session: Session,
    inbox: Mailbox,
    decision: RecoveryPlan,
    base: Plan,
    timeout_s: float,
    on_checkpoint: Callable[[CheckpointRequest], None] | None = None,
) -> tuple[RecoveryPlan, PlanInputs, Plan]:
    """Check the announced plan, acknowledge it, and wait for the Core's commit.

    A later announcement of the same generation (a participant failed or did not
    acknowledge in time) supersedes the one acknowledged: check and acknowledge that.
    Returns the committed announcement, the planner inputs it carries, and its plan.
    """
    gen = decision.generation
    while True:
        inputs = decode(decision)
        new_plan, _ = replan(
            base, inputs.failed, announced_rebalancing(ctx.cfg, inputs), joined=inputs.joined
        )
        new_plan = advanced(base, new_plan)
        if plan_digest(new_plan) != decision.plan_digest:
            raise RuntimeError(
                f"plan digest {plan_digest(new_plan)} differs from the Core's "
                f"{decision.plan_digest}: planners disagree"
            )
        ctx.faults.at(StepPhase.PLAN, decision.committed_step + 1)
        if ctx.tp is not None:  # the leader acknowledges for every member, once each has
            unit_barrier(
                ctx.store, f"ack/g{gen}/a{decision.attempt}", ctx.rank, ctx.member,
                ctx.tp.size, timeout_s=timeout_s, what="check the plan",
            )  # fmt: skip
        if ctx.leader:  # for its TP group, whose members check the same plan
            session.publish(
                PlanAck(
                    sender=sender_name(ctx.rank),
                    generation=gen,
                    rank=ctx.rank,
                    plan_digest=decision.plan_digest,
                    attempt=decision.attempt,
                )
            )
        attempt = decision.attempt
        answer = _await_event(
            inbox,
            _answers(gen, attempt),
            timeout_s,
            f"commit of the plan of generation {gen} (attempt {attempt})",
            waits=gen,
            on_checkpoint=on_checkpoint,
        )
        if isinstance(answer, PlanCommit):
            if answer.plan_digest != decision.plan_digest:
                raise RuntimeError(
                    f"the Core committed plan {answer.plan_digest} of generation {gen}, "
                    f"this rank acknowledged {decision.plan_digest}"
                )
            ctx.faults.at(StepPhase.APPLY, decision.committed_step + 1)
            return decision, inputs, new_plan
        assert isinstance(answer, RecoveryPlan)
        log.warning("recovery.plan_superseded", generation=gen, attempt=answer.attempt)
        decision = answer


class PauseBox:
    """The Core's pending PauseRequest, set from the bus thread, read by the training loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pause: PauseRequest | None = None

    def put(self, pause: PauseRequest) -> None:
        with self._lock:
            self._pause = pause

    def pending(self, generation: int) -> PauseRequest | None:
        with self._lock:
            pause = self._pause
        return pause if pause is not None and pause.generation == generation else None


def recover(
    ctx: WorkerContext,
    trainer: Trainer,
    session: Session,
    inbox: Mailbox,
    cause: BaseException | None,
    pauses: PauseBox,
) -> Trainer:
    """Stop at the step boundary, report, and apply the Core's plan.

    ``cause`` is what stopped the step (a failed wait, or the abort signal), None when
    the loop stopped at a boundary for a pause the Core requested. A failure announced
    ``rollback`` takes back the plan ``trainer`` trains under (a participant failed
    while it was applied): this rank reports and goes on from what it kept before it.
    """
    gen, timeout = trainer.plan.generation, ctx.cfg.liveness.comm_timeout_s
    announced: Event | None = pauses.pending(gen)
    if announced is None:
        try:
            announced = _await_event(
                inbox,
                lambda e: isinstance(e, FailureDetected) and e.generation == gen,
                timeout,
                f"failure announcement after {type(cause).__name__}: {cause}",
            )
        except TimeoutError:
            if cause is None:
                raise
            raise cause from None  # a communication error nobody explains: not a recovery
    faulthandler.cancel_dump_traceback_later()  # stopped, and heard: dump_unless_stopped
    log.info(
        "recovery.stopped",
        announced=str(announced.KIND),
        committed_step=trainer.committed_step,
        cause=str(cause),
    )
    _release(ctx, trainer, announced)
    if _joined_by_torn_plan(trainer, announced):
        return _rejoin(ctx, session, inbox, trainer, gen)
    kept = _kept_for(ctx, trainer, announced)
    report: dict[str, Any] = {
        "committed_step": trainer.committed_step,
        "tainted": trainer.tainted(),
        "params_step": -2 if (ps := trainer.optimizer.params_step) is None else ps,
    }
    if kept is not None:
        report = _kept_report(kept)
    base = trainer.plan if kept is None else taken_back(kept.plan, gen)
    on_checkpoint = _report(ctx, session, gen, report, trainer, kept)
    decision = _next_plan(inbox, gen, timeout, on_checkpoint)
    return _apply(ctx, session, inbox, decision, base, trainer, kept, timeout, on_checkpoint)


def _joined_by_torn_plan(trainer: Trainer, announced: Event) -> bool:
    """Whether ``announced`` rolls back the plan that added this rank, whose own apply
    of it finished (it trains under it, and kept nothing from before)."""
    rollback = isinstance(announced, FailureDetected) and announced.rollback
    return rollback and trainer.joined


def _rejoin(
    ctx: WorkerContext, session: Session, inbox: Mailbox, trainer: Trainer, gen: int
) -> Trainer:
    """The plan of generation ``gen`` that added this rank is taken back: as a joiner
    whose apply was torn (:func:`_after_torn_apply`), drop what it built under it and
    wait for a plan that adds it again."""
    log.warning("recovery.join_taken_back", generation=gen)
    drop(trainer)
    return _join_again(ctx, session, inbox, gen)


def _join_again(ctx: WorkerContext, session: Session, inbox: Mailbox, gen: int) -> Trainer:
    """Wait for a plan after generation ``gen`` that adds this rank, and take it, on new
    store connections (:func:`_fresh_stores`)."""
    return join(_fresh_stores(ctx), session, inbox, after=gen)


def _fresh_stores(ctx: WorkerContext) -> WorkerContext:
    """``ctx`` on new store connections: a group creation that a torn apply abandoned
    (its peer dead) holds the old ones in its wait until the store's timeout, and a TP
    group's stop report or barrier behind it waited as long (30 s, the comm timeout, of
    a change's MTTR: chaos seed 40883, case 4)."""
    plane = ctx.plane_store and fresh_client(ctx.plane_store)
    return dataclasses.replace(ctx, store=fresh_client(ctx.store), plane_store=plane)


def _kept_for(ctx: WorkerContext, trainer: Trainer, announced: Event) -> Memento | None:
    """What this rank goes on from when ``announced`` rolls the current plan back (None:
    it does not)."""
    if not (isinstance(announced, FailureDetected) and announced.rollback):
        return None
    if trainer.memento is None:
        raise RuntimeError(
            f"the Core rolls back the plan of generation {trainer.plan.generation}, and "
            f"rank {ctx.rank} kept nothing from before it"
        )
    return trainer.memento


def _kept_report(kept: Memento) -> dict[str, Any]:
    """A rolling-back rank's report: the step it kept; both planes are built afresh
    (nothing tainted), its parameters gathered again (step unknown)."""
    return {"committed_step": kept.step, "tainted": [], "params_step": -2}


def _report(
    ctx: WorkerContext,
    session: Session,
    gen: int,
    report: dict[str, Any],
    trainer: Trainer | None,
    kept: Memento | None,
    **flags: Any,
) -> Callable[[CheckpointRequest], None]:
    """Report this rank stopped for the change leaving ``gen`` (its TP group as one);
    returns what answers a CheckpointRequest while it waits for the plan (written from
    ``kept`` when the change rolls back, else from ``trainer``)."""
    timeout = ctx.cfg.liveness.comm_timeout_s
    sender = sender_name(ctx.rank, ctx.member)
    if ctx.tp is not None:  # the TP group reports as one (its earliest step, every taint)
        tainted = [TP_GROUP] if ctx.tp.tainted else []
        report = {**report, "tainted": report["tainted"] + tainted}
        report = unit_report(
            ctx.store, unit=ctx.rank, member=ctx.member, size=ctx.tp.size, generation=gen,
            report=report, timeout_s=timeout,
        )  # fmt: skip
        if TP_GROUP in report["tainted"]:
            ctx.tp.rebuild(ctx.tp.generation + 1)
    if ctx.leader:
        session.publish(
            RecoveryReady(sender=sender, generation=gen, rank=ctx.rank, **report, **flags)
        )

    def on_checkpoint(request: CheckpointRequest) -> None:
        if ctx.rank not in request.writers:
            return
        owners = write_part(ctx, trainer, request, timeout, kept)
        if ctx.tp is not None:  # the leader reports the part once every member wrote its
            # slices of it (a Core asking again finds the barrier passed)
            unit_barrier(
                ctx.store, f"checkpoint/g{request.generation}/s{request.step}", ctx.rank,
                ctx.member, ctx.tp.size, timeout_s=timeout, what="write its checkpoint part",
            )  # fmt: skip
        if not ctx.leader:
            return
        session.publish(
            CheckpointWritten(
                sender=sender,
                generation=request.generation,
                rank=ctx.rank,
                step=request.step,
                owners=owners,
            )
        )

    return on_checkpoint


def _next_plan(
    inbox: Mailbox,
    gen: int,
    timeout: float,
    on_checkpoint: Callable[[CheckpointRequest], None] | None = None,
) -> RecoveryPlan:
    """The Core's plan of generation ``gen + 1`` (its wait extended while it waits for
    nodes; a checkpoint it asks for meanwhile written by ``on_checkpoint``)."""
    decision = _await_event(
        inbox,
        lambda e: isinstance(e, RecoveryPlan) and e.generation == gen + 1,
        timeout,
        f"recovery plan for generation {gen + 1}",
        waits=gen + 1,
        on_checkpoint=on_checkpoint,
    )
    assert isinstance(decision, RecoveryPlan)
    return decision


def _after_torn_apply(
    ctx: WorkerContext,
    session: Session,
    inbox: Mailbox,
    decision: RecoveryPlan,
    trainer: Trainer | None,
    kept: Memento | None,
    cause: Exception,
    timeout: float,
) -> Trainer:
    """A participant failed while this rank applied ``decision``'s plan: the Core takes
    the plan back (:func:`elaswave.engine.phases.applying.roll_back`). This rank reports
    the step it kept and takes the next change's plan from the layout before the torn
    one; a joiner (which kept nothing) waits for a plan that adds it again.
    ``trainer``: the one the apply started from (its device groups are aborted)."""
    gen = decision.generation
    log.warning("recovery.torn", generation=gen, cause=f"{type(cause).__name__}: {cause}")
    if kept is None:  # a joiner
        return _join_again(ctx, session, inbox, gen)
    announced = _await_event(
        inbox,
        lambda e: isinstance(e, FailureDetected) and e.generation == gen,
        timeout,
        f"failure announcement after a torn apply ({type(cause).__name__}: {cause})",
    )
    assert isinstance(announced, FailureDetected)
    if not announced.rollback:
        raise RuntimeError(
            f"rank {ctx.rank}'s apply of generation {gen} was torn ({cause}), and the Core "
            "does not roll the plan back"
        )
    ctx = _fresh_stores(ctx)
    on_checkpoint = _report(ctx, session, gen, _kept_report(kept), None, kept, torn=True)
    answer = _next_plan(inbox, gen, timeout, on_checkpoint)
    base = taken_back(kept.plan, gen)
    return _apply(ctx, session, inbox, answer, base, trainer, kept, timeout, on_checkpoint)


def _release(ctx: WorkerContext, trainer: Trainer, announced: Event) -> None:
    """Free the device plane of the abandoned step's work: abort the groups that hold a
    failed rank and, where work in flight parks (NCCL), those that have any; they are
    reported tainted and rebuilt under the next plan (:mod:`elaswave.comm.release`)."""
    failed = announced.ranks if isinstance(announced, FailureDetected) else []
    released = trainer.device.release(failed)
    if ctx.tp is not None:
        ctx.tp.release()
    if released.late or not device_healthy(ctx.device):
        raise RuntimeError(
            f"the device did not recover from aborting its communicators {list(released.aborted)} "
            f"(still running after {ABORT_DEADLINE_S:g} s: {list(released.late)}): "
            "this rank leaves the job"
        )


def join(ctx: WorkerContext, session: Session, inbox: Mailbox, *, after: int = -1) -> Trainer:
    """Wait for the Core's plan that gives this new rank a place (of a generation after
    ``after``: a plan it was added by and that was torn is gone), and take it: a join
    is a change applied to an empty trainer."""
    timeout = max(60.0, ctx.cfg.liveness.comm_timeout_s)
    decision = _await_event(
        inbox,
        lambda e: isinstance(e, RecoveryPlan) and ctx.rank in e.joined and e.generation > after,
        timeout,
        "plan that lets this worker join",
    )
    assert isinstance(decision, RecoveryPlan)
    current = plan_from_dict(json.loads(ctx.store.get(plan_key(decision.generation - 1))))
    return _apply(ctx, session, inbox, decision, current, None, None, timeout)


def _apply(
    ctx: WorkerContext,
    session: Session,
    inbox: Mailbox,
    decision: RecoveryPlan,
    base: Plan,
    trainer: Trainer | None,
    kept: Memento | None,
    timeout: float,
    on_checkpoint: Callable[[CheckpointRequest], None] | None = None,
) -> Trainer:
    """Agree on the Core's plan (check, acknowledge, wait for the commit), take its
    generation, keep what this rank committed (the change rolls back to ``kept``, what
    it kept before a torn apply, when ``decision`` says so), apply the plan to
    ``trainer`` (None: this rank joins) and report it done."""
    decision, inputs, new_plan = _agree(ctx, session, inbox, decision, base, timeout, on_checkpoint)
    if kept is None and trainer is None and ctx.rank not in decision.joined:
        raise RuntimeError(
            f"the plan of generation {decision.generation} no longer adds rank {ctx.rank}"
        )
    joiner = trainer is None and kept is None  # holds nothing: nothing to roll back
    if decision.rollback != (kept is not None) and not joiner:  # ``kept``: to roll back to
        raise RuntimeError(
            f"the plan of generation {decision.generation} "
            + ("rolls back, and this rank kept nothing" if decision.rollback else "does not")
            + " roll back, and the failure announced before it "
            + ("did not" if decision.rollback else "did")
        )
    ctx.abort.generation = decision.generation
    session.floor_generation = decision.generation  # older generations' messages are stale
    inbox.prune(decision.generation)
    ctx.abort.clear()  # failures announced before are answered by this plan
    if trainer is not None and not decision.rollback:  # before anything changes
        c = decision.committed_step
        kept = (
            nothing_kept(trainer, c)
            if decision.restore
            else keep(trainer, c, frozenset(decision.failed), timeout)
        )
    # A recovery that stalls must be diagnosable: halfway to the Core's deadline, every
    # thread's stack goes to this worker's log.
    faulthandler.dump_traceback_later(max(1.0, timeout / 2), exit=False)
    result: tuple[Trainer, Applied] | Exception
    try:
        result = _change(ctx, decision, inputs, base, new_plan, trainer, kept)
    except (CommError, StepAborted) as exc:  # a participant failed meanwhile
        result = exc
    finally:
        faulthandler.cancel_dump_traceback_later()
    if isinstance(result, Exception):
        return _after_torn_apply(ctx, session, inbox, decision, trainer, kept, result, timeout)
    trainer, applied = result
    _keep_until_settled(trainer, kept, base, decision)
    if ctx.tp is not None:  # the plan is applied when every member has applied it: a
        # member lost before then is a failure in the apply window, as a rank is; one
        # whose apply a failure tore rolls back with this one
        try:
            unit_barrier(
                ctx.store, f"applied/g{decision.generation}", ctx.rank, ctx.member,
                ctx.tp.size, timeout_s=timeout, what="apply the plan", abort=ctx.abort,
            )  # fmt: skip
        except StepAborted as exc:
            return _after_torn_apply(ctx, session, inbox, decision, trainer, kept, exc, timeout)
    ctx.faults.at(StepPhase.APPLIED, decision.committed_step + 1)
    if not ctx.leader:
        return trainer
    session.publish(
        RecoveryDone(
            sender=sender_name(ctx.rank),
            generation=decision.generation,
            rank=ctx.rank,
            comm_s=applied.comm_s,
            remap_s=applied.remap_s,
            resume_s=applied.resume_s,
            params_s=applied.params_s,
            bytes_sent=applied.bytes_sent,
            communicators=trainer.communicators() + (1 if ctx.tp is not None else 0),
        )
    )
    return trainer


def _change(
    ctx: WorkerContext,
    decision: RecoveryPlan,
    inputs: PlanInputs,
    base: Plan,
    new_plan: Plan,
    trainer: Trainer | None,
    kept: Memento | None,
) -> tuple[Trainer, Applied]:
    """Apply ``new_plan``: from the disk checkpoint (state was lost), from what this rank
    kept before a torn apply (a roll-back), or as any change (:func:`reconfigure`)."""
    failed, step = set(decision.failed), decision.committed_step
    if decision.restore:
        return restore(ctx, trainer, base, new_plan, failed, step)
    if decision.rollback:
        assert kept is not None  # checked against the announcement
        return roll_back(ctx, trainer, kept, base, new_plan, failed, step)
    return reconfigure(
        ctx, trainer, kept, base, new_plan, failed, step,
        rebuild=set(decision.rebuild), migration=inputs.migration,
    )  # fmt: skip


def _keep_until_settled(
    trainer: Trainer, kept: Memento | None, base: Plan, decision: RecoveryPlan
) -> None:
    """``trainer`` keeps what its rank committed before the change until the Core
    announces the change finished; after a restore, the checkpoint's step, to restore
    again."""
    if kept is None:
        trainer.joined = True  # a joiner: a roll-back adds it again
        return
    if decision.restore:
        step = decision.committed_step
        kept = Memento(plan=base, step=step, layers=kept.layers, layout=None, state=None)
    trainer.memento = kept
