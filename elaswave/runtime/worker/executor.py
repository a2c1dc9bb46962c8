"""The Recovery Executor's protocol on a worker: stop at a step boundary, report, agree
on the Core's plan (check its digest, acknowledge, wait for the commit, follow a
superseding announcement), take its generation, apply it and report it done.

A recovery (:func:`recover`) and a join (:func:`join`) are the same change: a joiner
applies the plan to an empty trainer (:func:`elaswave.runtime.worker.reconfigure.reconfigure`).
The Core's announcements reach the training thread through a :class:`Mailbox` (plans,
commits, failures) and a :class:`PauseBox` (the pending pause request).
"""

from __future__ import annotations

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
from elaswave.engine.change import Applied
from elaswave.engine.plan import Plan, plan_from_dict, plan_key
from elaswave.engine.plan_inputs import PlanInputs, decode
from elaswave.engine.recovery import plan_digest
from elaswave.engine.replan import replan
from elaswave.runtime.job.faults import StepPhase
from elaswave.runtime.job.inputs import announced_rebalancing
from elaswave.runtime.worker.held_checkpoint import write_part
from elaswave.runtime.worker.reconfigure import reconfigure, restore
from elaswave.runtime.worker.tpgroup import TP_GROUP, unit_barrier, unit_report
from elaswave.runtime.worker.trainer import Trainer, WorkerContext

log = structlog.get_logger(__name__)


class Mailbox:
    """The Core's announcements, put by the bus thread, taken by the training loop.

    An event is kept until taken: the bus may deliver a plan before the failure it
    answers (a reordered or repaired message), and whichever the loop waits for first
    must not discard the other. Events of generations the worker has left are pruned.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._events: list[Event] = []

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
    the loop stopped at a boundary for a pause the Core requested.
    """
    gen, timeout = trainer.plan.generation, ctx.cfg.liveness.comm_timeout_s
    sender = sender_name(ctx.rank, ctx.member)
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
    log.info(
        "recovery.stopped",
        announced=str(announced.KIND),
        committed_step=trainer.committed_step,
        cause=str(cause),
    )
    _release(ctx, trainer, announced)
    report: dict[str, Any] = {
        "committed_step": trainer.committed_step,
        "tainted": trainer.tainted() + ([TP_GROUP] if ctx.tp and ctx.tp.tainted else []),
        "params_step": -2 if (ps := trainer.optimizer.params_step) is None else ps,
    }
    if ctx.tp is not None:  # the TP group reports as one (its earliest step, every taint)
        report = unit_report(
            ctx.store, unit=ctx.rank, member=ctx.member, size=ctx.tp.size, generation=gen,
            report=report, timeout_s=timeout,
        )  # fmt: skip
        if TP_GROUP in report["tainted"]:
            ctx.tp.rebuild(ctx.tp.generation + 1)
    if ctx.leader:
        session.publish(RecoveryReady(sender=sender, generation=gen, rank=ctx.rank, **report))

    def on_checkpoint(request: CheckpointRequest) -> None:
        if ctx.rank not in request.writers:
            return
        owners = write_part(ctx, trainer, request, timeout)
        session.publish(
            CheckpointWritten(
                sender=sender,
                generation=request.generation,
                rank=ctx.rank,
                step=request.step,
                owners=owners,
            )
        )

    decision = _next_plan(inbox, gen, timeout, on_checkpoint)
    return _apply(ctx, session, inbox, decision, trainer.plan, trainer, timeout, on_checkpoint)


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
    new_plan: Plan,
    cause: Exception,
    timeout: float,
) -> Trainer:
    """A participant failed while this rank applied ``decision``'s plan: its state is
    not whole. It reports ``torn`` to the change that failure starts (the Core adopts
    the plan as it stands, then plans again), and takes that change's plan, which
    restores a checkpoint inside the job. (The Core takes this path only with a
    checkpoint on disk; else it stops the job, a failure in the apply window.)"""
    gen = decision.generation
    log.warning("recovery.torn", generation=gen, cause=f"{type(cause).__name__}: {cause}")
    _await_event(
        inbox,
        lambda e: isinstance(e, FailureDetected) and e.generation == gen,
        timeout,
        f"failure announcement after a torn apply ({type(cause).__name__}: {cause})",
    )
    if ctx.leader:
        session.publish(
            RecoveryReady(
                sender=sender_name(ctx.rank, ctx.member), generation=gen, rank=ctx.rank,
                committed_step=decision.committed_step, torn=True,
            )
        )  # fmt: skip
    answer = _next_plan(inbox, gen, timeout)
    if not answer.restore:
        raise RuntimeError(
            f"rank {ctx.rank}'s apply of generation {gen} was torn, and the plan of "
            f"generation {gen + 1} restores no checkpoint"
        )
    return _apply(ctx, session, inbox, answer, new_plan, None, timeout)


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


def join(ctx: WorkerContext, session: Session, inbox: Mailbox) -> Trainer:
    """Wait for the Core's plan that gives this new rank a place, and take it: a join is
    a change applied to an empty trainer."""
    timeout = max(60.0, ctx.cfg.liveness.comm_timeout_s)
    decision = _await_event(
        inbox,
        lambda e: isinstance(e, RecoveryPlan) and ctx.rank in e.joined,
        timeout,
        "plan that lets this worker join",
    )
    assert isinstance(decision, RecoveryPlan)
    current = plan_from_dict(json.loads(ctx.store.get(plan_key(decision.generation - 1))))
    return _apply(ctx, session, inbox, decision, current, None, timeout)


def _apply(
    ctx: WorkerContext,
    session: Session,
    inbox: Mailbox,
    decision: RecoveryPlan,
    base: Plan,
    trainer: Trainer | None,
    timeout: float,
    on_checkpoint: Callable[[CheckpointRequest], None] | None = None,
) -> Trainer:
    """Agree on the Core's plan (check, acknowledge, wait for the commit), take its
    generation, apply it to ``trainer`` (None: this rank joins) and report it done."""
    decision, inputs, new_plan = _agree(ctx, session, inbox, decision, base, timeout, on_checkpoint)
    if trainer is None and ctx.rank not in decision.joined and not decision.restore:
        raise RuntimeError(
            f"the plan of generation {decision.generation} no longer adds rank {ctx.rank}"
        )
    ctx.abort.generation = decision.generation
    session.floor_generation = decision.generation  # older generations' messages are stale
    inbox.prune(decision.generation)
    ctx.abort.clear()  # failures announced before are answered by this plan
    # A recovery that stalls must be diagnosable: halfway to the Core's deadline, every
    # thread's stack goes to this worker's log.
    faulthandler.dump_traceback_later(max(1.0, timeout / 2), exit=False)
    result: tuple[Trainer, Applied] | Exception
    try:
        if decision.restore:  # state was lost: from the disk checkpoint
            result = restore(
                ctx, trainer, base, new_plan, set(decision.failed), decision.committed_step
            )
        else:
            result = reconfigure(
                ctx,
                trainer,
                base,
                new_plan,
                set(decision.failed),
                decision.committed_step,
                rebuild=set(decision.rebuild),
                migration=inputs.migration,
            )
    except (CommError, StepAborted) as exc:  # a participant failed meanwhile
        if not ctx.cfg.restores_in_job:
            raise  # the Core stops the job: a failure in the apply window
        result = exc
    finally:
        faulthandler.cancel_dump_traceback_later()
    if isinstance(result, Exception):
        return _after_torn_apply(ctx, session, inbox, decision, new_plan, result, timeout)
    trainer, applied = result
    if ctx.tp is not None:  # the plan is applied when every member has applied it: a
        # member lost before then is a failure in the apply window, as a rank is
        unit_barrier(
            ctx.store, f"applied/g{decision.generation}", ctx.rank, ctx.member,
            ctx.tp.size, timeout_s=timeout, what="apply the plan",
        )  # fmt: skip
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
