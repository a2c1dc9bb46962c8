"""Per-step snapshots of ZeRO optimizer shards in host memory (paper §5.1).

After the reduce-scatter, each owner sends its reduced gradient shard (not the three
times larger optimizer state) to its snapshot holder, whose background thread applies
the very same AdamW update to a host copy, overlapped with the next step. Both ends run
on background threads that block in gloo directly: the training thread only enqueues. The holder
keeps the last two step versions, so a step abandoned by a failure can roll back to the
committed one, and every version since the step before its own committed step (see
:func:`kept_versions`). Bit-for-bit equality with the owner holds because both sides run
:func:`adamw_update` on the same fp32 inputs (on CPU; a device owner and a host holder
may round differently, which the integrity check tolerates by design of the remap).
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import structlog
import torch
import torch.distributed as dist

from elaswave.comm.group import CommError, P2PGroup, TagSpace, p2p_tag
from elaswave.fabric.zero import OptimizerConfig, ShardState, adamw_update, recyclable

log = structlog.get_logger(__name__)


def state_digest(state: ShardState) -> str:
    """sha256 of a shard's master weights and moments (fp32 bytes)."""
    h = hashlib.sha256()
    for t in (state.master, state.exp_avg, state.exp_avg_sq):
        h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def snapshot_link_name(owner: int, holder: int) -> str:
    return f"snap.{owner}-{holder}"


def kept_versions(steps: Iterable[int], holder_step: int | None) -> list[int]:
    """The snapshot versions (steps) a holder keeps: the two newest, and every one from
    the step before ``holder_step`` (the holder's own committed step; None: unknown) on.

    When a stage loses every rank, the survivors roll back to the step before the newest
    any of them committed (:func:`elaswave.engine.replan.plan_fail_stop`), since the lost
    stage may have stopped a step behind them. It may instead have run a step ahead of
    the survivor that holds its snapshots: the two newest versions alone then miss the
    step rolled back to (scripts/chaos --seed 14 --case 121). An owner runs at most one
    step ahead of any other stage, so this keeps at most three versions, and three in
    steady state: an owner's next version arrives before its holder commits that step.
    """
    ordered = sorted(steps)
    cut = ordered[-2:]
    if holder_step is not None:
        cut = [*cut, holder_step - 1]
    return [v for v in ordered if v >= min(cut)] if ordered else []


@dataclass
class SnapshotKeeper:
    """Holds one owner's shard snapshot on this rank and keeps it current.

    ``versions`` maps step -> state after that step's update (step -1: initial state);
    :func:`kept_versions` says which are kept, given ``holder_step()``, the holder's own
    committed step (None: the two newest are kept).
    """

    owner: int
    link: P2PGroup
    cfg: OptimizerConfig
    initial: ShardState
    generation: int = 0
    initial_step: int = -1
    """The step ``initial`` is the state after (-1: before any step)."""
    record_digests: bool = False
    holder_step: Callable[[], int] | None = None
    versions: dict[int, ShardState] = field(default_factory=dict)
    digests: list[str] = field(default_factory=list)
    error: BaseException | None = None
    _done: threading.Condition = field(default_factory=threading.Condition)
    _thread: threading.Thread | None = None
    _closed: bool = False
    cpu_s: float = 0.0
    """CPU seconds this keeper's thread has used (receiving and updating)."""

    def __post_init__(self) -> None:
        self.versions[self.initial_step] = self.initial.clone_to("cpu")

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name=f"snapshot-{self.owner}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        """Receive and apply each step's gradient, the steps after ``initial_step`` in
        order; the receive for the next step is posted as soon as the last is applied."""
        step = self.initial_step
        grad: torch.Tensor | None = None
        spare: ShardState | None = None  # a version no longer kept: the next one's buffers
        while not self._closed:
            step += 1
            try:
                latest = self.versions[step - 1]
                if grad is None or grad.shape != latest.master.shape:
                    grad = torch.empty_like(latest.master)
                # Blocks this thread only; a dead owner ends it with CommError.
                self.link.recv_detached(
                    grad, self.owner, tag=p2p_tag(self.generation, step, TagSpace.SNAPSHOT)
                )
                state = latest.updated_copy(into=spare if recyclable(spare, latest) else None)
                spare = None
                adamw_update(state, grad, step=step, cfg=self.cfg)
                digest = state_digest(state) if self.record_digests else ""
            except BaseException as exc:  # surfaced to the training thread by wait()
                if not self._closed:
                    log.warning("snapshot.failed", owner=self.owner, step=step, error=str(exc))
                with self._done:
                    self.error = exc
                    self._done.notify_all()
                return
            with self._done:
                self.versions[step] = state
                own = self.holder_step() if self.holder_step is not None else None
                kept = set(kept_versions(self.versions, own))
                for old in [v for v in self.versions if v not in kept]:
                    spare = self.versions.pop(old)
                if self.record_digests:
                    self.digests.append(digest)
                self.cpu_s = time.thread_time()
                self._done.notify_all()

    def wait(self, step: int, timeout_s: float) -> ShardState:
        """Block until ``step``'s snapshot is applied; raise if it never will be.

        A version already applied is returned even if the keeper failed afterwards (its
        owner dying mid-step is exactly when the committed version is needed).
        """
        with self._done:
            self._done.wait_for(
                lambda: (
                    step in self.versions or self.error is not None or max(self.versions) > step
                ),
                timeout=timeout_s,
            )
            if step in self.versions:
                return self.versions[step]
            if self.error is not None:
                raise CommError(self.link.name, "snapshot", self.error)
            raise CommError(
                self.link.name,
                "snapshot",
                f"step {step} not applied in time (have {sorted(self.versions)})",
            )

    def close(self) -> None:
        """Stop keeping. Returns at once: a keeper blocked on a gradient that will never
        come (its owner abandoned the step, or training ended) stays parked on its daemon
        thread."""
        self._closed = True


class SnapshotSender:
    """The owner's side: ship each step's reduced gradient shard to the holder.

    :meth:`send` posts the send and hands it to a background thread that waits for it,
    so the training thread never waits on the snapshot path.
    """

    def __init__(self, link: P2PGroup, holder: int, generation: int = 0) -> None:
        self.link = link
        self.holder = holder
        self.generation = generation
        self.error: BaseException | None = None
        self._queue: queue.Queue[tuple[dist.Work, torch.Tensor, int] | None] = queue.Queue()
        self._idle = threading.Condition()
        self._in_flight = 0
        self.cpu_s = 0.0
        """CPU seconds the sender's thread has used."""
        self._thread = threading.Thread(
            target=self._run, name=f"snapshot-send-{holder}", daemon=True
        )
        self._thread.start()

    def send(self, grad_shard: torch.Tensor, step: int) -> None:
        """Send ``step``'s gradient shard (not modified afterwards) to the holder."""
        buf = grad_shard.detach().to("cpu").contiguous()
        work = self.link.isend(buf, self.holder, p2p_tag(self.generation, step, TagSpace.SNAPSHOT))
        with self._idle:
            self._in_flight += 1
        self._queue.put((work, buf, step))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            work, _buf, step = item  # the buffer stays alive until the send is done
            try:
                self.link.wait_detached(work, "send")
            except BaseException as exc:
                log.warning("snapshot.send_failed", holder=self.holder, step=step, error=str(exc))
                with self._idle:
                    self.error = exc
                    self._idle.notify_all()
                return
            with self._idle:
                self._in_flight -= 1
                self.cpu_s = time.thread_time()
                self._idle.notify_all()

    def flush(self, timeout_s: float) -> None:
        """Wait until every queued gradient has been delivered (at the end of training)."""
        with self._idle:
            self._idle.wait_for(lambda: self._in_flight == 0 or self.error, timeout=timeout_s)
            if self.error is not None:
                raise CommError(self.link.name, "snapshot send", self.error)
            if self._in_flight:
                raise CommError(
                    self.link.name, "snapshot send", f"not delivered within {timeout_s:g} s"
                )

    def close(self) -> None:
        """Stop sending; returns at once (a send blocked on a dead holder stays parked)."""
        self._queue.put(None)
