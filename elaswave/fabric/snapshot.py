"""Per-step snapshots of ZeRO optimizer shards in host memory (paper §5.1).

After the reduce-scatter, each owner sends its reduced gradient shard (not the three
times larger optimizer state) to its snapshot holder, which applies the very same AdamW
update to a host copy during its next steps, a piece at a time, while its training
thread waits for communication (:mod:`elaswave.comm.idle`). Sending and receiving run
on threads that block in gloo directly: the training thread only enqueues.
The holder can give the last two step versions, so a step abandoned by a failure can
roll back to the committed one, and every version since the step before its own
committed step (see :func:`kept_versions`); it keeps them as one state and the
gradients not yet applied to it (:class:`SnapshotKeeper`). Bit-for-bit equality with the
owner holds because both sides run
:func:`adamw_update` on the same fp32 inputs (on CPU; a device owner's AdamW kernel rounds
apart from the host's, and ``--verify-snapshots`` then compares within a tolerance:
:mod:`elaswave.fabric.verify`).
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time
from collections.abc import Callable, Collection, Generator, Iterable, Sequence
from dataclasses import dataclass, field

import structlog
import torch
import torch.distributed as dist

from elaswave.comm.abort import AbortSignal, StepAborted
from elaswave.comm.group import P2PGroup
from elaswave.comm.idle import IDLE, IdleTask
from elaswave.comm.spec import CommError, TagSpace, p2p_tag
from elaswave.fabric.adamw import OptimizerConfig, ShardState, adamw_pieces, adamw_update
from elaswave.fabric.hostplane import (
    HostCopy,
    bind_thread_device,
    host_copier,
    host_empty,
    host_state,
    host_zeros,
)
from elaswave.fabric.verify import Fingerprint, state_fingerprint

log = structlog.get_logger(__name__)

PIECE_WAIT_S = 60.0
"""How long a thread that needs a keeper's ``base`` waits for the piece of an update
another thread is running (a millisecond or so; past this that thread is stuck)."""

_END = object()

GRADIENT, END = 1.0, 0.0
"""The last element of each frame an owner sends a holder: with ``GRADIENT`` the frame
is the step's gradient shard and this trailer; ``END`` says the owner's sender was
closed (a change ends every generation's snapshot streams) and sends nothing more in
this generation. The holder's receive for the next step is posted before the owner
knows whether it will run that step; a live owner that abandons it ends the stream with
an ``END`` frame on that step's tag, so that no keeper's thread stays parked on a live
link, holding the thread, its buffer and the link's group for good (scripts/gpu_check's
churn: a survivor held one parked keeper thread per change). An exact value in every
floating-point type, in a slot that a gradient never fills."""


def end_frame(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The frame that ends an owner's stream to a keeper of a ``numel``-element shard."""
    frame = host_zeros(numel + 1, dtype)
    frame[-1] = END
    return frame


def state_digest(state: ShardState) -> str:
    """sha256 of a shard's master weights and moments (fp32 bytes)."""
    h = hashlib.sha256()
    for t in (state.master, state.exp_avg, state.exp_avg_sq):
        h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def state_record(state: ShardState) -> tuple[str, Fingerprint]:
    """What ``--verify-snapshots`` records of a version: its digest and fingerprint
    (:mod:`elaswave.fabric.verify`)."""
    return state_digest(state), state_fingerprint(state)


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

    The versions it can give (the states after steps ``base_step`` .. ``newest``) are
    kept as one state, ``base`` (after ``base_step``), and the gradients received since,
    not yet applied. A gradient is applied to ``base`` in place once :func:`kept_versions`
    (given ``holder_step()``, the holder's own committed step; None: the two newest are
    kept) no longer keeps the version before it. So each step's update runs once, as
    before, without the copy an out-of-place update needs: the keeper streams one AdamW
    pass per step over its shard, where keeping each version whole took a 3-tensor copy
    too, and holds one state and two or three gradients instead of three states.
    :meth:`wait` and :meth:`take` apply the gradients up to the step asked for.
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
    device: torch.device | None = None
    """This process's training device (its thread's current device); the keeper's
    own tensors are host-plane buffers."""
    error: BaseException | None = None
    _base: ShardState = field(init=False)
    _base_step: int = field(init=False)
    _grads: dict[int, torch.Tensor] = field(init=False, default_factory=dict)
    """Gradients of steps ``_base_step + 1`` .. ``newest``, received and not applied."""
    _records: list[tuple[str, Fingerprint]] = field(init=False, default_factory=list)
    _spares: list[torch.Tensor] = field(init=False, default_factory=list)
    """Gradients applied: the next receives' buffers."""
    _applying: bool = False
    """A thread is running a piece of an update of ``base`` (outside the lock)."""
    _partial: tuple[int, Generator[None, None, None]] | None = None
    """The update of ``base`` to step ``_base_step + 1`` under way: its pieces not run
    yet. ``base`` is then part-updated, no step's version, until it is finished."""
    _idle: IdleTask[None] | None = None
    """This keeper's idle work, while queued."""
    _broken: bool = False
    """An update raised halfway: ``base`` is no step's version."""
    _ended: int | None = None
    """The step whose frame ended the owner's stream (its sender was closed): no
    version after ``newest`` will come."""
    _done: threading.Condition = field(default_factory=threading.Condition)
    _thread: threading.Thread | None = None
    _closed: bool = False
    cpu_s: float = 0.0
    """CPU seconds this keeper's updates have used (on whichever thread ran them)."""

    def __post_init__(self) -> None:
        self._base = host_state(self.initial)
        self._base_step = self.initial_step

    @property
    def host_bytes(self) -> int:
        """Host memory this keeper holds: the owner's shard state (master weights and
        two moments) and the gradient buffers it keeps (received, or spare)."""
        with self._done:
            tensors = [self._base.master, self._base.exp_avg, self._base.exp_avg_sq]
            tensors += [*self._grads.values(), *self._spares]
            return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def newest(self) -> int:
        """The newest step whose version this keeper can give."""
        return self._base_step + len(self._grads)

    def steps(self) -> list[int]:
        """The steps whose versions this keeper can give."""
        with self._done:
            return list(range(self._base_step, self.newest + 1))

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name=f"snapshot-{self.owner}", daemon=True
        )
        self._thread.start()

    @property
    def receiving(self) -> bool:
        """Whether the keeper's thread still runs (blocked on the next frame, or storing one)."""
        return self._thread is not None and self._thread.is_alive()

    def _grad(self, step: int) -> torch.Tensor:
        """``step``'s gradient: its frame without the trailer (the lock held)."""
        return self._grads[step][:-1].view(self._base.master.shape)

    def _run(self) -> None:
        """Receive each step's gradient, the steps after ``initial_step`` in order; the
        receive for the next step is posted as soon as the last one is stored. The
        updates are idle work (:mod:`elaswave.comm.idle`); :meth:`catch_up` is the
        training thread's fallback where waits leave them behind. Ends at an ``END``
        frame (the owner closed its sender), or when the link fails (a dead owner)."""
        bind_thread_device(self.device)
        step = self.initial_step
        while not self._closed:
            step += 1
            try:
                with self._done:
                    grad = self._spares.pop() if self._spares else None
                if grad is None:
                    grad = host_empty(self._base.master.numel() + 1, self._base.master.dtype)
                # Blocks this thread only; a dead owner ends it with CommError.
                self.link.recv_detached(
                    grad, self.owner, tag=p2p_tag(self.generation, step, TagSpace.SNAPSHOT)
                )
                trailer = grad[-1].item()
                if trailer not in (GRADIENT, END):
                    raise CommError(self.link.name, "snapshot", f"frame trailer {trailer!r}")
            except BaseException as exc:  # surfaced to the training thread by wait()
                if not self._closed:
                    log.warning("snapshot.failed", owner=self.owner, step=step, error=str(exc))
                with self._done:
                    self.error = exc
                    self._done.notify_all()
                return
            with self._done:
                if trailer == END:
                    self._ended = step
                    self._done.notify_all()
                    return
                if self._closed:  # a version was taken: it must not change
                    return
                self._grads[step] = grad
                self._done.notify_all()
                if self._idle is None:
                    self._idle = IDLE.submit(self._apply_due(), f"snapshot of {self.owner}")

    def _due(self) -> int:
        """The oldest step kept now: ``base`` may be advanced to it (the lock held)."""
        own = self.holder_step() if self.holder_step is not None else None
        return min(kept_versions(range(self._base_step, self.newest + 1), own))

    def _apply_due(self) -> Generator[None, None, None]:
        """The due updates, a piece at a time (this keeper's idle work). Ends when none
        is due, or when another thread is running a piece (which then goes on)."""
        while True:
            with self._done:
                if self._closed or self._applying or not self._piece(self._due()):
                    self._idle = None
                    return
            yield

    def catch_up(self, slack: int = 2) -> None:
        """Apply the due updates on the calling thread once more than ``slack`` are due
        (the waits for communication have not done them)."""
        with self._done:
            due = self._due()
            if not self._closed and due - self._base_step > slack:
                self._advance(due)

    def _advance(self, to_step: int) -> None:
        """Bring ``base`` to ``to_step`` (the update under way first) on this thread,
        after the piece another thread may be running. The lock held."""
        while True:
            self._settled(PIECE_WAIT_S)
            if not self._piece(to_step):
                return

    def _piece(self, to_step: int) -> bool:
        """Run one piece of the update of ``base`` toward ``to_step`` (the update under
        way first, whatever ``to_step``); False if there is none. Called with the lock
        held and no piece running; releases the lock while the piece computes, so that
        receiving and reading the step's progress never wait for it. The gradients
        applied become the next receives' buffers."""
        if self._partial is None:
            if self._base_step >= to_step:
                return False
            step = self._base_step + 1
            pieces = adamw_pieces(self._base, self._grad(step), step=step, cfg=self.cfg)
            self._partial = (step, pieces)
        step, pieces = self._partial
        self._applying = True
        self._done.release()
        failed: BaseException | None = None
        try:
            t0 = time.thread_time()
            end = next(pieces, _END) is _END
            record = state_record(self._base) if end and self.record_digests else None
            self.cpu_s += time.thread_time() - t0
        except BaseException as exc:
            failed = exc
            raise
        finally:
            self._done.acquire()
            self._applying = False
            if failed is not None:  # base is part-updated for good: no version to give
                self.error, self._broken, self._partial = failed, True, None
            self._done.notify_all()
        if end:
            self._partial = None
            self._base_step = step
            self._spares.append(self._grads.pop(step))
            if record is not None:
                self._records.append(record)
        return True

    def _ready(self, step: int, timeout_s: float) -> None:
        """Block until ``step``'s version can be given and ``base`` is whole (the lock
        held); raise if it never can (an update that ran may have passed it)."""
        self._await(step, timeout_s)
        self._whole(timeout_s)
        self._await(step, 0)

    def _whole(self, timeout_s: float) -> None:
        """Finish the update under way, if any, on this thread (the lock held); raise if
        an update failed halfway, leaving ``base`` no step's version."""
        self._settled(timeout_s)
        if self._partial is not None:
            self._advance(self._partial[0])
        if self._broken:
            raise CommError(self.link.name, "snapshot", f"an update failed: {self.error!r}")

    def _settled(self, timeout_s: float) -> None:
        """Wait until no thread is running a piece of an update (the lock held)."""
        if not self._done.wait_for(lambda: not self._applying, timeout=timeout_s):
            raise CommError(self.link.name, "snapshot", f"update not done in {timeout_s:g} s")

    def _await(self, step: int, timeout_s: float) -> None:
        """Block until ``step``'s version can be given (the lock held); raise if never."""
        self._done.wait_for(
            lambda: (
                step <= self.newest
                or self.error is not None
                or self._closed
                or self._ended is not None
            ),
            timeout=timeout_s,
        )
        if self._base_step <= step <= self.newest:
            return
        if step < self._base_step:
            raise CommError(
                self.link.name, "snapshot", f"step {step} no longer kept (have {self.steps()})"
            )
        if self.error is not None:
            raise CommError(self.link.name, "snapshot", self.error)
        if self._ended is not None:
            raise CommError(
                self.link.name,
                "snapshot",
                f"step {step} never sent: the owner ended its snapshots at step {self._ended}",
            )
        raise CommError(
            self.link.name,
            "snapshot",
            f"step {step} not applied in time (have {self.steps()})",
        )

    def wait(self, step: int, timeout_s: float) -> ShardState:
        """A copy of ``step``'s version, once the keeper can give it; raise if it never
        will. The keeper goes on keeping.

        A version that can be given is given even if the keeper failed afterwards (its
        owner dying mid-step is exactly when the committed version is needed).
        """
        with self._done:
            self._ready(step, timeout_s)
            return self._copy(step)

    def take(self, step: int, timeout_s: float) -> ShardState:
        """``step``'s version itself, no copy: the keeper stops (as :meth:`close`), and
        the versions after ``step`` are dropped. For a recovery's roll-back and the end
        of training."""
        with self._done:
            self._ready(step, timeout_s)
            self._closed = True
            self._advance(step)
            self._grads.clear()
            self._done.notify_all()
            return self._base

    def digests(self) -> list[str]:
        """sha256 of each version after ``initial_step`` (``record_digests`` only),
        versions not yet applied included (computed on a copy)."""
        return [digest for digest, _ in self.records()]

    def records(self) -> list[tuple[str, Fingerprint]]:
        """:func:`state_record` of each version after ``initial_step``
        (``record_digests`` only), versions not yet applied included (on a copy)."""
        with self._done:
            self._whole(timeout_s=60)
            out = list(self._records)
            if self._grads:
                self._copy(self.newest, each=lambda state: out.append(state_record(state)))
            return out

    def _copy(self, step: int, each: Callable[[ShardState], None] | None = None) -> ShardState:
        """A copy of ``base`` brought to ``step`` through the held gradients, ``each``
        called after every update (the lock held, no update running)."""
        state = host_state(self._base)
        for k in range(self._base_step + 1, step + 1):
            adamw_update(state, self._grad(k), step=k, cfg=self.cfg)
            if each is not None:
                each(state)
        return state

    def close(self) -> None:
        """Stop keeping. Returns at once; the keeper's thread, blocked on the owner's
        next frame, ends when the owner's ``END`` frame comes (its sender closed at the
        same change) or its link fails (the owner died)."""
        with self._done:
            self._closed = True
            self._done.notify_all()


_ABORT_POLL_S = 0.05
"""How often a wait for a snapshot's delivery looks at the abort signal."""


class SnapshotSender:
    """The owner's side: ship each step's reduced gradient shard to the holder (and to
    the holders of its further copies, ``more``: one host copy, sent to each).

    :meth:`send` copies the shard into a host-plane buffer (:mod:`~elaswave.fabric.hostplane`)
    and hands it to a background thread that waits for the send. A host copy is complete
    at once, and its send is posted right away; a device's is made on a copy stream, and
    the thread posts its send once the copy's event has completed. The training thread
    waits for the delivery only before the step's all-gather (:meth:`wait_delivered`),
    with the optimizer update done meanwhile.
    """

    def __init__(
        self,
        link: P2PGroup,
        holder: int,
        generation: int = 0,
        device: torch.device | None = None,
        abort: AbortSignal | None = None,
        more: Sequence[tuple[P2PGroup, int]] = (),
        initial_step: int = -1,
        shard: tuple[int, torch.dtype] | None = None,
    ) -> None:
        """``device``: where the gradient shards live (default: the host). ``abort``:
        ends :meth:`wait_delivered` when the Core announces a failure. ``more``: the
        link and holder of each further copy. ``initial_step``: the step the holders'
        keepers start after (their first receive is for the step after it).
        ``shard``: the shard's element count and type, for the ``END`` frame
        :meth:`close` sends (None: those of the shards sent; nothing is sent if none was)."""
        self.abort = abort
        self.link = link
        self.holder = holder
        self._targets = [(link, holder), *more]
        self.generation = generation
        self.device = device
        self.error: BaseException | None = None
        self._copier = host_copier(device or torch.device("cpu"))
        self._queue: queue.Queue[tuple[list[_Posted] | None, HostCopy, int] | _Ending] = (
            queue.Queue()
        )
        self._next_step = initial_step + 1
        self._shard = shard
        self._idle = threading.Condition()
        self._in_flight = 0
        self.cpu_s = 0.0
        """CPU seconds the sender's thread has used."""
        self._thread = threading.Thread(
            target=self._run, name=f"snapshot-send-{holder}", daemon=True
        )
        self._thread.start()

    def _post(self, copy: HostCopy, step: int, skip: Collection[int] = ()) -> list[_Posted]:
        """Post ``copy`` to every holder but those in ``skip`` (their links failed)."""
        tag = p2p_tag(self.generation, step, TagSpace.SNAPSHOT)
        return [
            _Posted(link, holder, link.isend(copy.tensor, holder, tag))
            for link, holder in self._targets
            if holder not in skip
        ]

    def send(self, grad_shard: torch.Tensor, step: int) -> None:
        """Send ``step``'s gradient shard (not modified afterwards) to the holder."""
        copy = self._copier.copy(grad_shard, extra=1)
        copy.tensor[-1] = GRADIENT  # the copy stream fills the elements before it only
        self._next_step, self._shard = step + 1, (grad_shard.numel(), grad_shard.dtype)
        work = self._post(copy, step) if copy.ready else None
        with self._idle:
            self._in_flight += 1
        self._queue.put((work, copy, step))

    def _run(self) -> None:
        """Wait for each queued send, in order. A holder whose link fails gets nothing
        more; the others go on receiving every step, and at :meth:`close` their ``END``
        frame, on the tag of the step each of them waits for next."""
        bind_thread_device(self.device)
        failed: set[int] = set()
        while not isinstance(item := self._queue.get(), _Ending):
            work, copy, step = item  # the buffer stays alive until the send is done
            try:
                if work is None:  # a device copy: post once it has landed
                    copy.wait()
                    work = self._post(copy, step, skip=failed)
            except BaseException as exc:  # the copy, or a post on a failed link
                self._failed(exc, step)
                return
            for sent in work:
                if sent.holder in failed:
                    continue
                try:
                    sent.link.wait_detached(sent.work, "send")
                except BaseException as exc:
                    failed.add(sent.holder)
                    self._failed(exc, step, sent.holder)
            with self._idle:
                self._in_flight -= 1
                self.cpu_s = time.thread_time()
                self._idle.notify_all()
        self._end(item, failed)

    def _failed(self, exc: BaseException, step: int, holder: int | None = None) -> None:
        """A send failed (the holder died or left): ends :meth:`wait_delivered`."""
        log.warning("snapshot.send_failed", holder=holder, step=step, error=str(exc))
        with self._idle:
            self.error = self.error or exc
            self._idle.notify_all()

    def _end(self, ending: _Ending, failed: Collection[int]) -> None:
        """Send each holder whose link has not failed the ``END`` frame, on the tag of
        the step it waits for (each has every step sent before)."""
        if ending.shard is None:
            return
        frame = end_frame(*ending.shard)
        try:
            posted = self._post(HostCopy(frame), ending.step, skip=failed)
        except BaseException as exc:  # a link failed meanwhile
            log.info("snapshot.end_not_sent", error=str(exc))
            return
        for sent in posted:
            try:
                sent.link.wait_detached(sent.work, "send")
            except BaseException as exc:  # a holder that died or left meanwhile
                log.info("snapshot.end_not_sent", holder=sent.holder, error=str(exc))

    def wait_delivered(self, timeout_s: float) -> None:
        """Wait until the holder has every gradient sent so far (a holder that failed
        ends the wait: the Core announces it, and the snapshots are placed again).

        Called before the step's all-gather: no rank can commit a step before the
        owner's all-gather of it, so a recovery's roll-back step always has its
        snapshot at the holder. Without this wait a holder whose receiving thread fell
        behind (a loaded host) lacked the step every survivor rolled back to, and the
        job stopped (scripts/chaos --seed 6502 --case 97: the holder had step 4 of an
        owner that died in step 7's snapshot phase)."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._in_flight and self.error is None:
                if self.abort is not None and self.abort.is_set():
                    raise StepAborted(self.abort.reason)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommError(
                        self.link.name, "snapshot send", f"not delivered within {timeout_s:g} s"
                    )
                self._idle.wait(min(left, _ABORT_POLL_S))

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
        """Stop sending, and end each holder's stream (:data:`END`) once what was
        queued is sent. Returns at once; the thread ends when the holders have the
        frame, or their links fail."""
        self._queue.put(_Ending(self._next_step, self._shard))


@dataclass(frozen=True)
class _Posted:
    """A frame's send to one holder, posted."""

    link: P2PGroup
    holder: int
    work: dist.Work


@dataclass(frozen=True)
class _Ending:
    """A sender's close, queued behind its sends: the step the holders' keepers wait
    for next, and the shard's element count and type (None: none was ever known)."""

    step: int
    shard: tuple[int, torch.dtype] | None
