"""The Core's side of fail-stop recovery: watch the workers, plan, record.

A worker process that exits non-zero is declared failed at once (a launcher sees the
exit within milliseconds, far below a collective timeout). Exits within a short grace
window are treated as one failure (a node loss kills several ranks together). The
supervisor then runs the protocol: FailureDetected -> every survivor stops at a step
boundary and reports its committed step (RecoveryReady) -> the Schedule Engine's pure
planner decides -> RecoveryPlan -> every survivor applies it (RecoveryDone).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import structlog
import torch.distributed as dist

from elaswave.bus.schema import (
    FailureDetected,
    MigrationDone,
    PauseRequest,
    PlanAck,
    PlanCommit,
    RecoveryDone,
    RecoveryFinished,
    RecoveryKind,
    RecoveryPlan,
    RecoveryReady,
    RecoveryStarted,
    StragglerDetected,
)
from elaswave.engine.plan import Plan, plan_from_dict, plan_key, plan_to_dict
from elaswave.engine.recovery import Rebalancing, next_plan, plan_digest, plan_fail_stop
from elaswave.engine.stopping import Outcome, Stopping, on_exit, on_report, outcome, stop_phase
from elaswave.engine.straggler import StragglerVerdict
from elaswave.fabric.errors import Unrecoverable
from elaswave.rundir import CORE_STATE, fault_record, rank_log
from elaswave.runtime.config import JobConfig
from elaswave.runtime.core import Core
from elaswave.runtime.faults import FaultKind, validate_faults
from elaswave.runtime.inputs import decide_migration, rebalancing_fields, rebalancing_of
from elaswave.runtime.slowwatch import StragglerWatch

log = structlog.get_logger(__name__)

_R = TypeVar("_R", RecoveryReady, RecoveryDone, MigrationDone)
"""A recovery event that one rank sends about one generation."""

EXIT_GRACE_S = 0.5
"""How long a participant that exited is given for its report to arrive before its
exit counts as a failure inside the recovery."""

CORE_FAULT_ENV = "ELASWAVE_CORE_FAULT"
"""Tests: ``plan`` or ``commit`` makes the Core SIGKILL itself right after it publishes
a recovery's plan (or its commit), ``finished`` once every worker has exited; the job
host does not pass it to a restarted Core."""

GRACE_S = 0.02
"""Exits this close together are announced as one failure. Later exits, until every
survivor has stopped, widen the announced set instead of starting a second recovery."""


def plan_summary(plan: Plan) -> dict[str, Any]:
    """A plan as summary.json records it: its micro-batches per step and, per stage, its
    layers, ranks, micro-batch shares (whether they rotate, and in blocks of how
    many micro-batches) and clock."""
    return {
        "generation": plan.generation,
        "num_micro_batches": plan.num_micro_batches,
        "stages": [
            {
                "layers": [s.layer_start, s.layer_stop],
                "ranks": list(s.ranks),
                "sizes": list(s.sizes),
                "rotate": s.rotate,
                "block": s.block,
                "mhz": s.mhz,
            }
            for s in plan.stages
        ],
    }


class JobFailed(RuntimeError):
    """The job could not complete; the message says which rank and why."""


def last_error(log_path: Path) -> str:
    """The worker's own account of its failure (its ``worker.failed`` log record), if any.

    A SIGKILLed worker has none: whatever else it logged is not the cause.
    """
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        with contextlib.suppress(ValueError):
            doc = json.loads(line)
            if isinstance(doc, dict) and doc.get("event") == "worker.failed":
                return str(doc.get("error", ""))
    return ""


def fault_point(name: str) -> None:
    if os.environ.get(CORE_FAULT_ENV) == name:
        log.warning("core.fault_injected", point=name)
        os.kill(os.getpid(), signal.SIGKILL)


def exit_text(code: int) -> str:
    """How a process ended: ``signal SIGKILL``, ``code 1``."""
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"


class Supervisor:
    def __init__(
        self,
        cfg: JobConfig,
        run_dir: Path,
        core: Core,
        procs: dict[int, Any],
        *,
        spawn: Callable[[int], Awaitable[Any]] | None = None,
        store: dist.Store | None = None,
        state: dict[str, Any] | None = None,
    ) -> None:
        """``procs``: the workers' processes (``asyncio.subprocess.Process`` or the host
        link's :class:`~elaswave.runtime.hostlink.WorkerHandle`). ``spawn(rank)`` starts a
        worker that joins the running job; ``store`` is where the Core publishes the
        current plan for it. ``state``: a predecessor's :data:`CORE_STATE` to resume."""
        self.cfg = cfg
        self.run_dir = run_dir
        self.spawn = spawn
        self.store = store
        self.core = core
        self.procs = procs
        self.plan = cfg.plan()
        self.alive = set(procs)
        self.recoveries: list[dict[str, Any]] = []
        self.fenced: dict[int, str] = {}
        """rank -> why the Core killed it (a hang seen from missed heartbeats)."""
        self.timeout_s = max(30.0, cfg.train.comm_timeout_s)
        self.slowdowns: dict[int, float] = {}
        """Compute slowdown factors of the ranks the straggler detector flagged."""
        self._finishing: list[asyncio.Task[None]] = []
        """Recoveries waiting for their redone step to complete."""
        self._changing = asyncio.Lock()
        """Held while a plan change is under way: one change at a time."""
        self._waits: dict[asyncio.Future[int], int] = {}
        self._added = asyncio.Event()
        """Set when a worker is spawned, so that the exit watch includes it."""
        t = cfg.train
        self.stragglers = StragglerWatch(
            window=t.straggler_window,
            threshold=t.straggler_threshold,
            min_steps=t.straggler_min_steps,
        )
        self._inflight: dict[str, Any] | None = None
        """The change under way since its first announcement (what a successor redoes)."""
        self._pending: dict[str, Any] | None = None
        """The plan about to be committed, and its record so far (what a successor
        finishes when the commit went out)."""
        self._joins_done = 0
        self._scales_done = 0
        if state is not None:
            self.plan = plan_from_dict(state["plan"])
            self.alive = {int(r) for r in state["alive"]}
            self.fenced = {int(r): why for r, why in state["fenced"].items()}
            self.recoveries = list(state["recoveries"])
            self.slowdowns = {int(r): f for r, f in state["slowdowns"].items()}
            self._inflight = state["inflight"]
            self._pending = state["pending"]
            self._joins_done = int(state["joins_done"])
            self._scales_done = int(state["scales_done"])
            # A worker the predecessor asked for that the host never started is not one.
            self.alive &= set(procs)

    def persist(self) -> None:
        """Write :data:`CORE_STATE` (atomically: a successor reads it whole or not at all)."""
        doc = {
            "plan": plan_to_dict(self.plan),
            "alive": sorted(self.alive),
            "fenced": {str(r): why for r, why in self.fenced.items()},
            "recoveries": self.recoveries,
            "slowdowns": {str(r): f for r, f in self.slowdowns.items()},
            "inflight": self._inflight,
            "pending": self._pending,
            "joins_done": self._joins_done,
            "scales_done": self._scales_done,
        }
        path = self.run_dir / CORE_STATE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)

    def rebalancing(self) -> Rebalancing:
        """The throughput planner's inputs: the job's policy and the measured slowdowns."""
        return rebalancing_of(self.cfg, self.slowdowns)

    async def run(self) -> None:
        """Watch the workers until every one has exited; recover each failure.

        The watchers (heartbeats, stragglers, joins) run beside the exit watch. A change
        one of them started that cannot complete (JobFailed) ends the job at once: the
        exit watch re-raises it the moment it sees it, and nothing starts after it."""
        waits = {asyncio.ensure_future(p.wait()): rank for rank, p in self.procs.items()}
        self._waits = waits
        self.persist()
        watchers = [
            asyncio.create_task(self._watch_heartbeats()),
            asyncio.create_task(self._watch_stragglers()),
            asyncio.create_task(self._watch_joins()),
        ]

        def surface() -> None:
            """Raise what a watcher raised (a watcher that returned has nothing to do)."""
            for task in watchers:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    task.result()

        try:
            async with self._changing:
                await self._resume()
            while waits:
                added = asyncio.ensure_future(self._added.wait())
                done, _ = await asyncio.wait(
                    {*waits, added, *(t for t in watchers if not t.done())},
                    return_when=asyncio.FIRST_COMPLETED,
                )
                added.cancel()
                self._added.clear()
                surface()
                failed = self._members_only(self._exits({waits.pop(f) for f in done if f in waits}))
                if self.plan.ranks and not self._members():
                    self._stop_joiners()  # the job is over; late joiners have no place
                if not failed:
                    continue
                seen_at = time.time()
                await asyncio.sleep(GRACE_S)
                failed |= self._members_only(self._exits(self.alive))
                async with self._changing:
                    surface()  # the change that held the lock may have failed the job
                    # A change under way may have taken these exits into its plan already.
                    if failed := {r: c for r, c in failed.items() if r in self.plan.ranks}:
                        await self._on_failure(failed, seen_at)
            surface()
        finally:
            for task in watchers:
                task.cancel()
            # Their errors were raised above, or are superseded by the one on its way.
            await asyncio.gather(*watchers, return_exceptions=True)
            # Every worker has exited: each redone step has completed, or never will.
            for task in self._finishing:
                if not task.done():
                    await asyncio.wait([task], timeout=1.0)
                    task.cancel()
            for outcome in await asyncio.gather(*self._finishing, return_exceptions=True):
                if isinstance(outcome, Exception):
                    log.error("core.recovery_record_failed", error=repr(outcome))
            for proc in self.procs.values():
                if proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
            for fut in waits:
                with contextlib.suppress(BaseException):
                    await fut

    async def _watch_heartbeats(self) -> None:
        """Fence a worker that is alive but silent: SIGKILL it, so it fails like a crash."""
        timeout = self.cfg.train.heartbeat_timeout_s
        tick = min(0.1, timeout / 4)
        last_tick = time.monotonic()
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            if now - last_tick > max(4 * tick, timeout / 2):
                # The Core itself was stalled (stopped, starved): it cannot tell a silent
                # worker from a period it did not watch. Silence counts from now.
                log.warning("core.stalled", seconds=round(now - last_tick, 2))
                for rank in self.core.last_heartbeat:
                    self.core.last_heartbeat[rank] = now
            last_tick = now
            for rank in sorted(self.alive - set(self.fenced)):
                last = self.core.last_heartbeat.get(rank)
                if last is not None and now - last > timeout:
                    self.fenced[rank] = f"no heartbeat for {now - last:.1f} s (hung); fenced"
                    log.warning("core.fencing", rank=rank, silent_s=now - last)
                    self.persist()
                    with contextlib.suppress(ProcessLookupError):
                        self.procs[rank].kill()

    async def _watch_stragglers(self) -> None:
        """Run the fail-slow detector as step timings arrive; rebalance around a rank it
        flags (or back when it recovers) if the job's policy can change anything."""
        if not self.cfg.train.detects_stragglers:
            return
        while True:
            await asyncio.sleep(0.1)
            if self._changing.locked():
                continue
            verdict = self.stragglers.update(self.core.step_timings, self.alive)
            if verdict is None:
                continue
            assert verdict.step is not None  # a verdict that flags or clears evaluated a step
            slowdowns = {s.rank: s.factor for s in verdict.stragglers}
            await self.core.publish(
                StragglerDetected(
                    sender="core",
                    generation=self.plan.generation,
                    step=verdict.step,
                    ranks=sorted(slowdowns),
                    factors=[slowdowns[r] for r in sorted(slowdowns)],
                    recovered=list(verdict.recovered),
                    reason=verdict.reason,
                )
            )
            log.warning("core.stragglers", step=verdict.step, slowdowns=slowdowns)
            async with self._changing:
                self.slowdowns = slowdowns
                candidate, _ = next_plan(self.plan, (), self.rebalancing())
                last = max(t.step for t in self.core.step_timings)
                if last + 2 >= self.cfg.train.steps:
                    continue  # the job ends before a change could pay off
                if candidate != self.plan and self.alive:
                    await self._on_straggler(verdict, sorted(slowdowns) or list(verdict.recovered))

    async def _on_straggler(self, verdict: StragglerVerdict, ranks: list[int]) -> None:
        """Pause every worker at a step boundary and apply the rebalanced plan."""
        await self._pause_and_apply(
            RecoveryKind.FAIL_SLOW, ranks, f"{RecoveryKind.FAIL_SLOW}: {verdict.reason}"
        )

    async def _pause_and_apply(
        self,
        kind: str,
        ranks: list[int],
        detail: str,
        joined: Sequence[int] = (),
        failed: dict[int, int] | None = None,
    ) -> None:
        """Ask the plan's workers to stop after their next step, then change the plan
        (adding the ``joined`` ranks, which are already waiting for it).

        A member that fails before every member has stopped (``failed``: those already
        lost, for a restarted Core) joins the change: the failure is announced, the
        members still training abort their step and report, and the plan both drops the
        failed ranks and adds the joiners."""
        gen, seen_at = self.plan.generation, time.time()
        failed = dict(failed or {})
        self._inflight = {
            "kind": kind,
            "generation": gen,
            "ranks": list(ranks),
            "detail": detail,
            "joined": list(joined),
            "failed": {str(r): c for r, c in failed.items()},
        }
        self.persist()
        after = max((t.step for t in self.core.step_timings), default=-1) + 1
        await self.core.publish(
            PauseRequest(sender="core", generation=gen, after_step=after, reason=detail)
        )
        base = detail

        def paused_detail(lost: dict[int, int]) -> str:
            return f"{base}; then, while pausing: {self._describe(lost)}" if lost else base

        stopped = await self._stop_members(failed, paused_detail, "pause")
        failed, members = dict(stopped.failed), set(stopped.members)
        detail = paused_detail(failed)
        await self._apply_plan(
            kind=kind,
            ranks=sorted(set(ranks) | set(failed)),
            failed=sorted(failed),
            joined=joined,
            detail=detail,
            survivors=members | set(joined),
            origin=seen_at,
            seen_at=seen_at,
        )

    def _lost(self, ranks: set[int]) -> dict[int, int]:
        """The ``ranks`` that have exited with an error (whoever noticed it first), now
        out of ``alive``: their exit codes."""
        lost = {r: c for r in ranks if (c := self.procs[r].returncode) is not None and c != 0}
        self._exits(set(lost))  # bookkeeping, for those the exit watch has not taken yet
        return lost

    async def _watch_joins(self) -> None:
        """Start the workers that join: at a ``join@STEP`` fault's step, and for every
        ScaleRequest; then fit each into the job once it is up."""
        joins = sorted(
            f.step for f in validate_faults(
                self.cfg.train.faults,
                world_size=self.cfg.train.num_ranks,
                ranks_per_node=self.cfg.train.ranks_per_node,
                steps=self.cfg.train.steps,
            )
            if f.kind is FaultKind.JOIN
        )  # fmt: skip
        joins = joins[self._joins_done :]  # a restarted Core: those its predecessor started
        while True:
            await asyncio.sleep(0.1)
            done = max((s for s, _ in self.core.steps_completed), default=-1)
            due = sum(1 for step in joins if step <= done + 1)
            requests = self.core.scale_requests[self._scales_done :]
            self._scales_done += len(requests)
            self._joins_done += due
            want = due + sum(r.add for r in requests)
            if due:
                joins = joins[due:]
            for _ in range(want):
                await self._start_joiner()
            if want:
                self.persist()
            ready = [
                e.rank
                for e in self.core.joining
                if e.rank in self.alive and e.rank not in self.plan.ranks
            ]
            if ready and done + 2 < self.cfg.train.steps:
                async with self._changing:
                    await self._on_join(sorted(ready))

    def _stop_joiners(self) -> None:
        for rank in sorted(self.alive - set(self.plan.ranks)):
            log.warning("core.joiner_stopped", rank=rank, reason="the job has finished")
            with contextlib.suppress(ProcessLookupError):
                self.procs[rank].terminate()

    async def _start_joiner(self) -> None:
        if self.spawn is None or self.store is None:
            log.warning("core.join_refused", reason="this job cannot start workers")
            return
        rank = max(self.procs) + 1
        proc = await self.spawn(rank)
        self.procs[rank] = proc
        self.alive.add(rank)
        self._waits[asyncio.ensure_future(proc.wait())] = rank
        self._added.set()
        log.warning("core.joiner_started", rank=rank, pid=proc.pid)

    async def _on_join(self, ranks: list[int]) -> None:
        """Pause the job at a step boundary and apply a plan that includes ``ranks``."""
        assert self.store is not None
        self.store.set(plan_key(self.plan.generation), json.dumps(plan_to_dict(self.plan)))
        await self._pause_and_apply(RecoveryKind.JOIN, ranks, f"ranks {ranks} join", joined=ranks)

    def _members(self) -> set[int]:
        """The live ranks of the current plan: a joiner still starting up has no step
        to stop at and takes no part in a change until a plan includes it."""
        return self.alive & set(self.plan.ranks)

    def _members_only(self, failed: dict[int, int]) -> dict[int, int]:
        """Drop the workers that never joined: they leave nothing behind to recover."""
        for rank in [r for r in failed if r not in self.plan.ranks]:
            log.warning("core.joiner_exited", rank=rank, code=failed.pop(rank))
        return failed

    def _exits(self, ranks: set[int]) -> dict[int, int]:
        """Exit codes of the ``ranks`` that have exited with an error since last asked.

        Every exited rank leaves ``alive``; a clean exit (code 0) is a finished worker.
        """
        gone = {
            r: self.procs[r].returncode
            for r in ranks
            if r in self.alive and self.procs[r].returncode is not None
        }
        self.alive -= set(gone)
        for rank in gone:  # what it did not deliver, no one can send again
            self.core.client.tracker.forget(f"rank{rank}")
        if gone:
            self.persist()
        return {r: code for r, code in gone.items() if code != 0}

    def _describe(self, failed: dict[int, int]) -> str:
        return "; ".join(
            (
                f"rank {r}: {self.fenced[r]}"
                if r in self.fenced
                else f"rank {r} exited with {exit_text(c)}"
            )
            + (f": {why}" if (why := last_error(rank_log(self.run_dir, r))) else "")
            for r, c in sorted(failed.items())
        )

    async def _on_failure(self, failed: dict[int, int], seen_at: float) -> None:
        if not self.cfg.train.recovery:
            raise JobFailed(f"{self._describe(failed)} (recovery is off)")
        gen = self.plan.generation
        self._inflight = {
            "kind": RecoveryKind.FAIL_STOP,
            "generation": gen,
            "failed": {str(r): c for r, c in failed.items()},
            "seen_at": seen_at,
        }
        stopped = await self._stop_members(failed, lambda lost: self._describe(lost), "stop")
        ranks, detail = sorted(stopped.failed), self._describe(dict(stopped.failed))
        killed = [self._kill_time(r) for r in ranks]
        origin = min((t for t in killed if t is not None), default=seen_at)
        await self._apply_plan(
            kind=RecoveryKind.FAIL_STOP,
            ranks=ranks,
            failed=ranks,
            detail=detail,
            survivors=set(stopped.members),
            origin=origin,
            seen_at=seen_at,
        )

    async def _stop_members(
        self, failed: dict[int, int], detail: Callable[[dict[int, int]], str], what: str
    ) -> Stopping:
        """The stop phase of a change (:mod:`elaswave.engine.stopping`): announce the
        ``failed`` ranks, and members of the plan already gone, then take every member's
        report or exit until each member left has reported. Each loss is announced with
        the whole failed set. ``detail(failed)`` words a failed set for the messages.
        JobFailed when no member is left, or when one neither reports nor exits within
        the timeout."""
        gen = self.plan.generation
        state, announce = stop_phase(
            gen, frozenset(self.plan.ranks), failed | self._lost(set(self.plan.ranks))
        )
        seen: set[int] = set()
        while True:
            for a in announce:
                self._exits(set(a.ranks))  # bookkeeping for the exits not taken yet
                failed_now = dict(state.failed)
                assert self._inflight is not None
                self._inflight["failed"] = {str(r): c for r, c in failed_now.items()}
                self.persist()
                why = detail(failed_now)
                log.warning(
                    "core.failure_detected", ranks=list(a.ranks), generation=gen, detail=why
                )
                await self.core.publish(
                    FailureDetected(
                        sender="core",
                        generation=gen,
                        ranks=list(a.ranks),
                        source="process-exit",
                        detail=why,
                    )
                )
            announce = []
            result = outcome(state)
            if result is Outcome.NONE_LEFT:
                raise JobFailed(f"{detail(dict(state.failed))}; no worker survives")
            if result is Outcome.STOPPED:
                return state
            members = set(state.members)

            def news(members: set[int] = members) -> bool:
                reported = set(self._events(RecoveryReady, gen)) & members
                exited = {r for r in members if self.procs[r].returncode is not None}
                return bool(reported - seen) or bool(exited)

            if not await self.core.wait_until(news, self.timeout_s):
                missing = sorted(state.members - state.reported)
                raise JobFailed(
                    f"{detail(dict(state.failed))}; ranks {missing} did not {what} at a step "
                    f"boundary within {self.timeout_s:g} s"
                )
            for rank in sorted(members):
                if (code := self.procs[rank].returncode) is not None:
                    state, more = on_exit(state, rank, code)
                    announce += more
            for rank in set(self._events(RecoveryReady, gen)) & set(state.members):
                state = on_report(state, rank, gen)
                seen.add(rank)

    async def _apply_plan(
        self,
        *,
        kind: str,
        ranks: list[int],
        failed: list[int],
        joined: Sequence[int] = (),
        detail: str,
        survivors: set[int],
        origin: float,
        seen_at: float,
    ) -> None:
        """Every survivor has stopped at a step boundary: plan, announce, collect every
        participant's acknowledgement, commit, wait until every participant has applied
        the plan, and record the recovery.

        A participant that exits before acknowledging, or does not acknowledge within
        ``plan_ack_timeout_s`` (it is fenced), joins the failed set and a new announcement
        of the same generation supersedes the old one, which never runs."""
        gen = self.plan.generation
        failed, joined, ranks = list(failed), list(joined), list(ranks)
        survivors = set(survivors)
        reports = self._events(RecoveryReady, gen)
        first = 1 + max(  # a restarted Core supersedes what its predecessor announced
            (e.attempt for e in self.core.announcements
             if isinstance(e, RecoveryPlan) and e.generation == gen + 1),
            default=-1,
        )  # fmt: skip
        for attempt in itertools.count(first):
            commits = {r: e.committed_step for r, e in reports.items() if r in survivors}
            try:
                decision = plan_fail_stop(
                    self.plan,
                    failed,
                    commits,
                    ranks_per_node=self.cfg.train.ranks_per_node,
                    snapshots=self.cfg.train.snapshots,
                    rebalancing=self.rebalancing(),
                    joined=joined,
                )
            except Unrecoverable as exc:
                raise JobFailed(f"unrecoverable: {detail}; {exc}") from None
            planned_at = time.time()
            redo = decision.committed_step + 1
            stale = sorted(
                r
                for r, e in reports.items()
                if r in survivors and e.params_step != decision.committed_step
            )
            migration = decide_migration(self.cfg, self.plan, decision.plan, stale, joined)
            if attempt == 0:
                await self.core.publish(
                    RecoveryStarted(
                        sender="core",
                        generation=gen + 1,
                        step=redo,
                        kind=kind,
                        ranks=ranks,
                        reason=decision.reason,
                    )
                )
            digest = plan_digest(decision.plan)
            await self.core.publish(
                RecoveryPlan(
                    sender="core",
                    generation=gen + 1,
                    failed=failed,
                    committed_step=decision.committed_step,
                    plan_digest=digest,
                    reason=decision.reason,
                    rebuild=sorted(
                        {name for r, e in reports.items() if r in survivors for name in e.tainted}
                    ),
                    **rebalancing_fields(self.cfg, self.slowdowns),
                    kind=kind,
                    joined=joined,
                    stale=stale,
                    attempt=attempt,
                    migration=migration["mode"],
                )
            )
            fault_point("plan")
            lost = await self._collect_acks(survivors, gen + 1, digest, attempt)
            if not lost:
                break
            why = self._describe(lost)
            log.warning("core.plan_superseded", generation=gen + 1, attempt=attempt, why=why)
            detail = f"{detail}; then before the plan ran: {why}"
            failed = sorted(set(failed) | (set(lost) - set(joined)))
            joined = [r for r in joined if r not in lost]
            ranks = sorted(set(ranks) | set(lost))
            survivors -= set(lost)
            if not survivors & set(self.plan.ranks):
                raise JobFailed(f"{detail}; no worker survives")
        self._pending = {
            "generation": gen + 1,
            "digest": digest,
            "attempt": attempt,
            "plan": plan_to_dict(decision.plan),
            "survivors": sorted(survivors),
            "detail": detail,
            "origin": origin,
            "seen_at": seen_at,
            "planned_at": planned_at,
            "record": {
                "step": redo,
                "kind": kind,
                "ranks": ranks,
                "generation": gen + 1,
                "committed_step": decision.committed_step,
                "reason": decision.reason,
                "superseded": attempt,
                "migration": migration,
                "plan": plan_summary(decision.plan),
            },
        }
        self.persist()  # before the commit: a successor that finds it sent finishes it
        await self.core.publish(
            PlanCommit(sender="core", generation=gen + 1, plan_digest=digest, attempt=attempt)
        )
        fault_point("commit")
        await self._complete(self._pending, committed_at=time.time())

    async def _complete(self, pending: dict[str, Any], committed_at: float) -> None:
        """The plan is committed: wait until every participant has applied it, and
        record the change."""
        gen, origin, planned_at = pending["generation"], pending["origin"], pending["planned_at"]
        survivors = set(pending["survivors"])
        await self._await_all(
            survivors, RecoveryDone, gen, pending["detail"], "apply the recovery plan"
        )
        done_at = time.time()
        done = self._events(RecoveryDone, gen).values()
        record = {
            **pending["record"],
            "mttr_s": done_at - origin,
            "phases": {
                "detect": pending["seen_at"] - origin,
                "plan": planned_at - pending["seen_at"],
                "ack": committed_at - planned_at,
                "comm": max((e.comm_s for e in done), default=0.0),
                "remap": max((e.remap_s for e in done), default=0.0),
                "resume": max((e.resume_s for e in done), default=0.0),
                "redo": None,
            },
            "bytes_moved": sum(e.bytes_sent for e in done),
            "params_s": max((e.params_s for e in done), default=0.0),
        }
        self.recoveries.append(record)
        self.plan = plan_from_dict(pending["plan"])
        self._inflight = self._pending = None
        self.persist()
        log.warning("core.recovered", **{k: v for k, v in record.items() if k != "reason"})
        self._finishing.append(
            asyncio.create_task(self._finish_recovery(record, origin, planned_at, done_at))
        )

    async def _resume(self) -> None:
        """A restarted Core: finish or redo the change its predecessor left under way.

        A plan whose commit went out is being applied by the workers: wait for them and
        record it. A change announced but not committed is announced again, superseding
        whatever plan the predecessor proposed (the workers acknowledge the new attempt).
        """
        pending, inflight = self._pending, self._inflight
        if pending is not None and any(
            isinstance(e, PlanCommit)
            and e.generation == pending["generation"]
            and e.plan_digest == pending["digest"]
            for e in self.core.announcements
        ):
            log.warning("core.resuming", generation=pending["generation"], state="committed")
            await self._complete(pending, committed_at=time.time())
            return
        self._pending = None
        if inflight is None:
            return
        log.warning("core.resuming", generation=inflight["generation"], state="announced")
        if inflight["kind"] == RecoveryKind.FAIL_STOP:
            failed = {int(r): c for r, c in inflight["failed"].items()}
            await self._on_failure(failed, inflight["seen_at"])
        else:
            await self._pause_and_apply(
                inflight["kind"],
                inflight["ranks"],
                inflight["detail"],
                inflight["joined"],
                failed={int(r): c for r, c in inflight.get("failed", {}).items()},
            )

    async def _finish_recovery(
        self, record: dict[str, Any], origin: float, planned_at: float, done_at: float
    ) -> None:
        """MTTR ends when the redone step completes (its StepCompleted, published after
        the last stage committed it): record it, then announce RecoveryFinished."""
        redo = record["step"]

        def redone() -> float | None:
            return next(
                (t for s, t in self.core.steps_completed if s == redo and t >= planned_at), None
            )

        try:
            await self.core.wait_until(lambda: redone() is not None, self.timeout_s)
        finally:
            if (at := redone()) is not None:
                record["mttr_s"] = at - origin
                record["phases"]["redo"] = max(0.0, at - done_at)
            if record["migration"]["mode"] == "nonblocking":  # every rank ran the transition
                gen, ranks = record["generation"], len(self.plan.ranks)
                await self.core.wait_until(
                    lambda: len(self._events(MigrationDone, gen)) >= ranks, 2.0
                )
            migrated = self._events(MigrationDone, record["generation"]).values()
            if migrated:
                record["migration"]["bytes_streamed"] = sum(e.bytes_streamed for e in migrated)
                record["migration"]["waited_s"] = max(e.waited_s for e in migrated)
        await self.core.publish(
            RecoveryFinished(
                sender="core",
                generation=record["generation"],
                step=redo,
                kind=record["kind"],
                ranks=record["ranks"],
                mttr_s=record["mttr_s"],
            )
        )

    async def _collect_acks(
        self, ranks: set[int], generation: int, digest: str, attempt: int
    ) -> dict[int, int]:
        """Wait until every rank acknowledged ``digest``; return the ranks lost instead
        (exit codes): those that exited, else those silent past the deadline (fenced)."""

        def acked() -> set[int]:
            return {
                e.rank
                for e in self.core.recovery_events
                if isinstance(e, PlanAck)
                and e.generation == generation
                and e.attempt == attempt
                and e.plan_digest == digest
            }

        def exited() -> set[int]:
            return {r for r in ranks if self.procs[r].returncode is not None}

        timeout = self.cfg.train.plan_ack_timeout_s
        await self.core.wait_until(lambda: ranks <= acked() or bool(exited()), timeout)
        if gone := exited():
            return self._exits(gone) or {r: self.procs[r].returncode or 0 for r in gone}
        silent = ranks - acked()
        for rank in sorted(silent):
            self.fenced[rank] = (
                f"did not acknowledge the plan of generation {generation} within {timeout:g} s; "
                "fenced"
            )
            log.warning("core.fencing", rank=rank, generation=generation, attempt=attempt)
            with contextlib.suppress(ProcessLookupError):
                self.procs[rank].kill()
        for rank in silent:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.procs[rank].wait(), 10.0)
        lost = self._exits(silent)
        for rank in silent - set(lost):  # killed but not reaped yet: out of the plan all the same
            self.alive.discard(rank)
            lost[rank] = -signal.SIGKILL
        return lost

    async def _await_all(
        self, ranks: set[int], kind: type, generation: int, detail: str, what: str
    ) -> None:
        """Wait for ``kind`` from every rank; fail at once if one of them exits before it
        reported (one that exits after is a later failure, which the exit watch takes).

        A clean exit counts as a report, and so does a step trained under ``generation``
        (for RecoveryDone): that worker went past this point, and its report was lost on
        the bus with no sender left to publish it again."""

        def through() -> set[int]:
            clean = {r for r in ranks if self.procs[r].returncode == 0}
            if kind is RecoveryDone:
                trained = self.core.trained_generation
                clean |= {r for r in ranks if trained.get(r, -1) >= generation}
            return set(self._events(kind, generation)) | clean

        def exited() -> dict[int, int]:
            return {
                r: code for r in ranks - through() if (code := self.procs[r].returncode) is not None
            }

        ok = await self.core.wait_until(
            lambda: ranks <= through() or bool(exited()), self.timeout_s
        )
        if exited():  # a report still on its way (delayed, or being repaired) settles it
            ok = await self.core.wait_until(lambda: ranks <= through(), EXIT_GRACE_S)
        if gone := exited():
            every = self.cfg.train.checkpoint_every
            resume = (
                f"resume from its latest checkpoint with --resume {self.run_dir}"
                if every
                else "it wrote no checkpoint (train with --checkpoint-every K to be able to resume)"
            )
            # Those killed (or fenced) are the cause; peers that then failed on their
            # links with them are named, their errors left to their logs.
            cause = {r: c for r, c in gone.items() if c < 0 or r in self.fenced} or gone
            then = sorted(set(gone) - set(cause))
            after = (
                f"; then ranks {then} stopped on errors with them (see logs/rankN.log)"
                if then
                else ""
            )
            raise JobFailed(
                f"{detail}; then, while waiting for every rank to {what}: "
                f"{self._describe(cause)}{after} (a failure in that window is not recovered: "
                f"the job stops; {resume})"
            )
        if not ok:
            missing = sorted(ranks - through())
            raise JobFailed(f"{detail}; ranks {missing} did not {what} within {self.timeout_s:g} s")

    def _events(self, kind: type[_R], generation: int) -> dict[int, _R]:
        """This generation's recovery events of ``kind``, by rank (the latest of each)."""
        return {
            e.rank: e
            for e in self.core.recovery_events
            if isinstance(e, kind) and e.generation == generation
        }

    def _kill_time(self, rank: int) -> float | None:
        path = fault_record(self.run_dir, rank)
        with contextlib.suppress(OSError, ValueError, KeyError):
            return float(json.loads(path.read_text())["killed_at"])
        return None
