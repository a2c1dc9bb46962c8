"""A worker's step loop: one training step at a time, a recovery inside the step.

:meth:`StepLoop.train_step` runs the next step of the job; when the step is aborted
(a failure announced, a peer gone, a pause asked for) the recovery executor applies the
Core's plan in this process and the loop goes on from the committed step, so a call
returns only once a step has completed (the step after a recovery may be an earlier
one: a roll-back redoes steps). :meth:`StepLoop.finish` waits for snapshots and
checkpoints and writes the worker's results. The built-in loop (``elaswave train``)
and a user's script (``elaswave run``, through :mod:`elaswave.embedded`) drive the same
object.
"""

from __future__ import annotations

import concurrent.futures
import gc
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import structlog
import torch

from elaswave import rundir
from elaswave.bus.schema import (
    MigrationDone,
    StepCompleted,
    StepTiming,
    WorkerFinished,
    WorkerStarted,
    sender_name,
)
from elaswave.bus.session import Session
from elaswave.comm.abort import AbortSignal, StepAborted
from elaswave.comm.spec import CommError
from elaswave.fabric.checkpoint import shard_pieces, write_pieces
from elaswave.fabric.hostplane import bind_thread_device
from elaswave.fabric.snapshot import state_record
from elaswave.fabric.verify import Fingerprint
from elaswave.model.llama import layer_index
from elaswave.model.tensor_parallel import fused_parts
from elaswave.runtime.job.results import Trace, WorkerResult, write_worker_result
from elaswave.runtime.worker import executor
from elaswave.runtime.worker.executor import Mailbox, PauseBox
from elaswave.runtime.worker.heartbeat import HeartbeatSender
from elaswave.runtime.worker.outage import CoreWatch
from elaswave.runtime.worker.pipeline import StepResult
from elaswave.runtime.worker.tpgroup import unit_barrier, whole_param
from elaswave.runtime.worker.trainer import Trainer, WorkerContext, initial_trainer

log = structlog.get_logger(__name__)


class _PausedAtBoundary(Exception):
    """The training loop reached the step boundary a PauseRequest asked for."""


@dataclass(frozen=True)
class StepOutcome:
    """One completed step, as this rank saw it."""

    step: int
    loss: float | None
    """The global batch's mean loss (on the last stage's ranks; None elsewhere)."""
    seconds: float
    generation: int
    """The plan generation the step ran under."""
    recovered: bool
    """A recovery happened in this call before the step completed."""


StepHook = Callable[[StepOutcome], None]


class StepLoop:
    """Rank ``ctx.rank``'s training steps (see the module docstring)."""

    def __init__(
        self,
        ctx: WorkerContext,
        session: Session,
        abort: AbortSignal,
        inbox: Mailbox,
        heartbeat: HeartbeatSender,
        pauses: PauseBox,
        watch: CoreWatch,
        *,
        join: bool = False,
    ) -> None:
        self.ctx, self.session, self.abort, self.inbox = ctx, session, abort, inbox
        self.heartbeat, self.pauses, self.watch = heartbeat, pauses, watch
        self.cfg = ctx.cfg
        self.rank = ctx.rank
        self.sender = sender_name(ctx.rank)
        self.hooks: list[StepHook] = []
        watch.store = ctx.store
        self.trainer: Trainer
        if join:
            self._started(-1, -1, joining=True)
            self.trainer = executor.join(ctx, session, inbox)
        else:
            self.trainer = initial_trainer(ctx)
            self._started(*self.trainer.plan.locate(ctx.rank))
        self.step_times: dict[int, float] = {}
        self.pipeline_times: dict[int, float] = {}
        self.losses: dict[int, float] = {}
        self.grad_norms: dict[int, float] = {}
        self.eval_losses: dict[int, float] = {}
        """The held-out loss after each step that evaluated (last stage)."""
        """The global gradient norm of each step with a loss here (where clipping)."""
        self.traces: list[Trace] = []
        self.optimizer_digests: dict[int, str] = {}
        self.optimizer_prints: dict[int, Fingerprint] = {}
        self._writer = concurrent.futures.ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="ckpt",
            initializer=bind_thread_device,
            initargs=(ctx.device,),
        )
        self._writes: list[concurrent.futures.Future] = []
        self.step = self.trainer.committed_step + 1 if join else self.cfg.state.first_step
        self.first_step = self.step
        self._cpu_started = time.process_time()
        self.finished = False

    def _started(self, stage: int, replica: int, *, joining: bool = False) -> None:
        """Announce this process, and wait until the Core's log holds the announcement:
        a copy the Core's receive lost is repaired only while this process answers, and
        a rank killed in its first steps would leave the run without its start."""
        if not self.ctx.leader:
            return  # member 0 speaks for the TP group
        self.session.publish(
            WorkerStarted(
                sender=self.sender, rank=self.rank, stage=stage, replica=replica,
                pid=os.getpid(), host=socket.gethostname(), joining=joining,
                local_rank=self.ctx.local_rank, device=str(self.ctx.device),
            )
        )  # fmt: skip
        if not self.session.confirm():
            log.warning("worker.start_not_logged", rank=self.rank)

    @property
    def done(self) -> bool:
        """Every step of the job has completed on this rank."""
        return self.step >= self.cfg.schedule.steps

    @property
    def place(self) -> tuple[int, int]:
        """(stage, replica) of this rank under the current plan."""
        return self.trainer.plan.locate(self.rank)

    def train_step(self) -> StepOutcome:
        """Run the next step; recover inside it if it is aborted. Raises RuntimeError
        when the job's steps are all done."""
        if self.done:
            raise RuntimeError(f"all {self.cfg.schedule.steps} steps of the job are done")
        ctx, trainer = self.ctx, self.trainer
        recovered = False
        while True:
            step = self.step
            self.heartbeat.step = step  # before looking for a pause: see on_recovery_event
            ctx.pacer.slowdown = ctx.faults.slowdown(step)
            if hasattr(ctx.rng, "begin_step"):
                ctx.rng.begin_step(step)
            pause = self.pauses.pending(trainer.plan.generation)
            try:
                if pause is not None and step > pause.after_step:
                    raise _PausedAtBoundary
                if self.watch.pause_before(step):  # the Core is away: wait, state kept
                    self.watch.wait(step, self.abort.is_set)
                    self.abort.check()  # the returned Core announced a failure meanwhile
                result = trainer.runner.run_step(step)
            except (StepAborted, CommError, _PausedAtBoundary) as exc:
                cause = None if isinstance(exc, _PausedAtBoundary) else exc
                trainer = self.trainer = executor.recover(
                    ctx, trainer, self.session, self.inbox, cause, self.pauses
                )
                self.step = trainer.committed_step + 1
                if hasattr(ctx.rng, "rewind"):
                    ctx.rng.rewind(self.step)
                for record in (
                    self.step_times,
                    self.pipeline_times,
                    self.losses,
                    self.grad_norms,
                    self.eval_losses,
                    self.optimizer_digests,
                    self.optimizer_prints,
                ):
                    for later in [s for s in record if s >= self.step]:
                        del record[later]
                recovered = True
                if self.done:  # the last step turned out committed: nothing to redo
                    last = self.step - 1
                    generation = trainer.plan.generation
                    return StepOutcome(last, self.losses.get(last), 0.0, generation, True)
                continue
            break
        outcome = self._completed(step, result, recovered)
        self.step = step + 1
        unsettled = trainer.memento is not None or trainer.joined
        if unsettled and self.inbox.settled.covers(trainer.plan.generation):
            trainer.forget()  # the change is finished: no roll-back reaches it
        for keeper in trainer.keepers:  # updates no wait for communication has done
            keeper.catch_up()
        if recovered:
            # The groups the change replaced sit in reference cycles (an aborted
            # communicator and its last operation), each holding a process group and its
            # threads: free them now, after the redone step (not inside the recovery).
            gc.collect()
        for hook in self.hooks:
            hook(outcome)
        return outcome

    def _completed(self, step: int, result: StepResult, recovered: bool) -> StepOutcome:
        cfg, trainer = self.cfg, self.trainer
        self.step_times[step] = result.seconds
        self.pipeline_times[step] = result.pipeline_s
        outcome = self._outcome(step, result, recovered)
        # Every TP member's timing: the group is as fast as its slowest member.
        clock = self.ctx.pacer.clock
        self.session.publish(
            StepTiming(
                sender=self.sender, generation=trainer.plan.generation, rank=self.rank,
                step=step, compute_s=clock.compute_s, expected_s=clock.expected_s,
                micro_batches=clock.micro_batches, overruns=clock.overruns,
            )
        )  # fmt: skip
        every = cfg.state.checkpoint_every
        if every and (step + 1) % every == 0:  # committed: snapshot the shard, write later
            _, replica = trainer.plan.locate(self.rank)
            pieces = shard_pieces(trainer.optimizer.layout, replica, trainer.optimizer.state)
            write = partial(  # every TP member writes its own slices
                write_pieces, self.ctx.run_dir, step, self.rank, pieces,
                member=self.ctx.member, tp=cfg.layout.tp,
            )  # fmt: skip
            self._writes.append(self._writer.submit(write, trainer.plan.generation))
        if not self.ctx.leader:  # member 0 reports the rest for the TP group
            return outcome
        if (shadow := result.migration) is not None:
            self.session.publish(
                MigrationDone(
                    sender=self.sender, generation=trainer.plan.generation, rank=self.rank,
                    step=step, early=shadow.transition.early,
                    bytes_streamed=shadow.bytes_streamed, waited_s=shadow.waited_s,
                )
            )  # fmt: skip
        if step < cfg.schedule.trace_steps and trainer.plan.generation == 0:
            self.traces.append(
                Trace(step=step, actions=tuple(result.trace), times=tuple(result.times))
            )
        if cfg.state.verify_snapshots:
            digest, fingerprint = state_record(trainer.optimizer.state)
            self.optimizer_digests[step], self.optimizer_prints[step] = digest, fingerprint
        loss = outcome.loss
        if loss is not None and trainer.plan.stages[-1].ranks[0] == self.rank:
            self.session.publish(
                StepCompleted(
                    sender=self.sender, rank=self.rank, step=step, loss=loss,
                    step_time_s=result.seconds, samples=trainer.plan.global_batch,
                    lr=cfg.optim.lr_at(step),
                    grad_norm=self.grad_norms.get(step, -1.0),
                    eval_loss=self.eval_losses.get(step, -1.0),
                )
            )  # fmt: skip
        return outcome

    def _outcome(self, step: int, result: StepResult, recovered: bool) -> StepOutcome:
        """The step as this rank saw it; its loss recorded (on the last stage)."""
        plan = self.trainer.plan
        loss = None
        if result.loss_sum is not None:
            loss = self.losses[step] = result.loss_sum / plan.global_batch
            norm = self.trainer.optimizer.grad_norms.get(step)
            if norm is not None:
                self.grad_norms[step] = norm
        if result.eval_loss is not None:
            self.eval_losses[step] = result.eval_loss
        return StepOutcome(step, loss, result.seconds, plan.generation, recovered)

    def finish(self) -> None:
        """Wait for checkpoint writes, snapshots and kept snapshots; save this rank's
        parameters (replica 0 of each stage) and results; announce the finish."""
        if self.finished:
            return
        self.finished = True
        cfg, trainer, run_dir = self.cfg, self.trainer, self.ctx.run_dir
        cpu_s = time.process_time() - self._cpu_started  # every thread: training, bus
        self._writer.shutdown(wait=True)
        for write in self._writes:
            write.result()  # surface a failed checkpoint write
        if trainer.optimizer.snapshot is not None:
            trainer.optimizer.snapshot.flush(cfg.liveness.comm_timeout_s)
        for keeper in trainer.keepers:
            keeper.take(cfg.schedule.steps - 1, timeout_s=cfg.liveness.comm_timeout_s)
        stage, replica = trainer.plan.locate(self.rank)
        if replica == 0:
            params = {
                layer_index(layer): {
                    n: whole_param(n, p.detach(), self.ctx.tp, fused_parts(n, cfg.model)).cpu()
                    for n, p in layer.named_parameters()
                }
                for layer in trainer.layers
            }
            if self.ctx.leader:
                path = rundir.stage_params(run_dir, stage)
                path.parent.mkdir(exist_ok=True)
                torch.save(params, path)
        if self.ctx.tp is not None:  # the members leave together (see unit_barrier)
            unit_barrier(self.ctx.store, "finished", self.rank, self.ctx.member,
                         self.ctx.tp.size, timeout_s=cfg.liveness.comm_timeout_s,
                         what="finish")  # fmt: skip
        if not self.ctx.leader:
            return  # member 0 reports for the TP group
        losses, times, digests = self.losses, self.step_times, self.optimizer_digests
        prints = self.optimizer_prints
        held = {k.owner: k.records() for k in trainer.keepers}
        keepers, sender = trainer.keepers, trainer.optimizer.snapshot
        result = WorkerResult(
            rank=self.rank,
            stage=stage,
            replica=replica,
            step_time_s=tuple(times[s] for s in sorted(times)),
            pipeline_s=tuple(self.pipeline_times[s] for s in sorted(self.pipeline_times)),
            eval_steps=tuple(sorted(self.eval_losses)),
            eval_loss=tuple(self.eval_losses[s] for s in sorted(self.eval_losses)),
            loss=tuple(losses[s] for s in sorted(losses)) if losses else None,
            loss_steps=tuple(sorted(losses)),
            grad_norm=tuple(self.grad_norms[s] for s in sorted(losses))
            if losses and self.grad_norms.keys() >= losses.keys()
            else None,
            traces=tuple(self.traces),
            optimizer_shard_numel=trainer.optimizer.state.numel(),
            stage_param_numel=sum(p.numel() for p in trainer.layers.parameters()),
            optimizer_digests=tuple(digests[s] for s in sorted(digests)),
            snapshot_digests={o: tuple(d for d, _ in r) for o, r in held.items()},
            generation=trainer.plan.generation,
            first_step=self.first_step,
            bus=self.session.client.delivery(),
            cpu_s=cpu_s,
            snapshot_cpu_s=sum(k.cpu_s for k in keepers)
            + (sender.cpu_s if sender is not None else 0.0),
            optimizer_device=trainer.optimizer.state.master.device.type,
            optimizer_fingerprints=tuple(prints[s] for s in sorted(prints)),
            snapshot_fingerprints={o: tuple(p for _, p in r) for o, r in held.items()},
            snapshot_host_bytes=sum(k.host_bytes for k in keepers),
        )
        write_worker_result(run_dir, result)
        self.session.publish(WorkerFinished(sender=self.sender, rank=self.rank, ok=True))


def run_to_the_end(loop: StepLoop) -> None:
    """The built-in training loop: every step, then finish."""
    while not loop.done:
        loop.train_step()
    loop.finish()
