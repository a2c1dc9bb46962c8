"""The Core's shell around the change protocol (:mod:`elaswave.engine.protocol`).

Watchers observe the job (worker exits, heartbeats, the bus through the recorder's
:meth:`~elaswave.runtime.core.recorder.Core.protocol_events`, the fail-slow detector)
and feed one bounded queue; one loop takes each input (or a Tick when one of the
protocol's deadlines passes) through the pure ``step``, persists the new state
(``core_state.json``, :func:`elaswave.engine.change.state_to_json`) before acting, and
carries out the actions: publish, kill, spawn, share the plan, log, stop the job. The
watchers run in a TaskGroup: an exception in any of them ends the rest at once and
surfaces.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import structlog
import torch.distributed as dist

from elaswave.bus.schema import PlanCommit, RecoveryPlan, ScaleRequest
from elaswave.engine.actions import Action, Kill, Note, Publish, SharePlan, Spawn, Stop, Terminate
from elaswave.engine.change import (
    State,
    StateVersionError,
    initial_state,
    log_position,
    state_from_json,
    state_to_json,
)
from elaswave.engine.inputs import (
    Exited,
    Input,
    OnDisk,
    Ready,
    Restarted,
    Silent,
    Straggling,
    Tick,
)
from elaswave.engine.phases.shared import exit_text
from elaswave.engine.plan import Plan, plan_key, plan_to_dict
from elaswave.engine.protocol import deadline, step
from elaswave.engine.record import RecoveryRecord
from elaswave.fabric.checkpoint import complete_steps
from elaswave.rundir import CORE_STATE
from elaswave.runtime.core.observe import exited, to_input
from elaswave.runtime.core.recorder import Core, ProtocolEvents
from elaswave.runtime.core.slowwatch import StragglerWatch
from elaswave.runtime.core.units import WorkerProcess
from elaswave.runtime.job.child import RULE_BROKEN
from elaswave.runtime.job.config import JobConfig
from elaswave.runtime.job.inputs import rules_of

log = structlog.get_logger(__name__)

__all__ = [
    "CORE_FAULT_ENV",
    "CORE_RESTORE_EVERY_ENV",
    "JobFailed",
    "Supervisor",
    "exit_text",
    "fault_point",
    "load_state",
]

CORE_FAULT_ENV = "ELASWAVE_CORE_FAULT"
"""Tests: ``plan`` or ``commit`` makes the Core SIGKILL itself right after it publishes
a recovery's plan (or its commit), ``finished`` once every worker has exited; the job
host does not pass it to a restarted Core."""

CORE_RESTORE_EVERY_ENV = "ELASWAVE_CORE_RESTORE_EVERY"
"""Tests: the event log bytes between the Core's restore points (default
:data:`~elaswave.runtime.core.restorepoint.RESTORE_EVERY`)."""

FINISH_WAIT_S = 1.0
"""How long, once every worker has exited, a redone step's completion is waited for."""

CHECKPOINT_POLL_S = 0.5
"""How often the Core looks for newly completed disk checkpoints."""


class JobFailed(RuntimeError):
    """The job could not complete; the message says which rank and why."""


class _Over(Exception):
    """Every worker has exited: end the watchers."""


def load_state(path: Path) -> tuple[State, int]:
    """A predecessor's persisted state (:data:`CORE_STATE`) and the event log position
    it has taken in; JobFailed, naming the file and the versions, for a state of another
    version."""
    try:
        doc = json.loads(path.read_text())
        return state_from_json(doc, source=str(path)), log_position(doc, source=str(path))
    except StateVersionError as exc:
        raise JobFailed(str(exc)) from None


def fault_point(name: str) -> None:
    if os.environ.get(CORE_FAULT_ENV) == name:
        log.warning("core.fault_injected", point=name)
        os.kill(os.getpid(), signal.SIGKILL)


class Supervisor:
    def __init__(
        self,
        cfg: JobConfig,
        run_dir: Path,
        core: Core,
        procs: Mapping[int, WorkerProcess],
        *,
        spawn: Callable[[int], Awaitable[WorkerProcess]] | None = None,
        store: dist.Store | None = None,
        state: State | None = None,
        taken: int = 0,
    ) -> None:
        """``procs``: the workers' processes, by plan rank. ``spawn(rank)`` starts a
        worker that joins the running job; ``store`` is where the Core publishes the
        current plan for it. ``state``: a predecessor's (:func:`load_state`) to resume,
        with the event log position it has taken in (``taken``)."""
        self.cfg, self.run_dir, self.core = cfg, run_dir, core
        self.procs: dict[int, WorkerProcess] = dict(procs)
        self.spawn, self.store = spawn, store
        self.rules = rules_of(cfg, run_dir, can_spawn=spawn is not None and store is not None)
        self.restarted = state is not None
        self.state = state if state is not None else initial_state(cfg.plan())
        self.inputs: asyncio.Queue[tuple[Input, int | None]] = asyncio.Queue(maxsize=1024)
        """Inputs, each with its event's log position (None: not a bus event's)."""
        self.taken = taken
        """The log position of the last bus event the state has taken in: persisted with
        the state, a successor feeds the protocol the events after it only."""
        self._group: asyncio.TaskGroup | None = None
        self.stragglers = StragglerWatch(
            window=cfg.elastic.straggler_window,
            threshold=cfg.elastic.straggler_threshold,
            min_steps=cfg.elastic.straggler_min_steps,
        )

    @property
    def plan(self) -> Plan:
        return self.state.plan

    @property
    def recoveries(self) -> tuple[RecoveryRecord, ...]:
        return self.state.recoveries

    def persist(self) -> None:
        """Write :data:`CORE_STATE` (atomically: a successor reads it whole or not at all)."""
        path = self.run_dir / CORE_STATE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state_to_json(self.state, self.taken)))
        os.replace(tmp, path)
        self.core.taken = self.taken

    async def run(self) -> None:
        """Run the protocol until every worker has exited (JobFailed if the job stops)."""
        self.persist()
        try:
            with self.core.protocol_events() as events:
                async with asyncio.TaskGroup() as group:
                    self._group = group
                    for rank, proc in self.procs.items():
                        group.create_task(self._watch_exit(rank, proc))
                    group.create_task(self._watch_bus(events))
                    group.create_task(self._watch_heartbeats())
                    if self.cfg.detects_stragglers:
                        group.create_task(self._watch_stragglers())
                    if self.rules.restore:
                        group.create_task(self._watch_checkpoints())
                    await self._loop()
                    raise _Over
        except BaseExceptionGroup as group_error:
            errors = [e for e in _leaves(group_error) if not isinstance(e, _Over)]
            if errors:
                raise errors[0] from None
        finally:
            for proc in self.procs.values():
                if proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
            for proc in self.procs.values():
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(proc.wait(), 5.0)

    async def _loop(self) -> None:
        if self.restarted:
            await self._step(Restarted(frozenset(self.procs)))
        ended: float | None = None
        while True:
            if not self.state.alive and self.state.change is None:
                # Every worker has exited and no change is left to decide (one under way
                # ends at its deadlines: committed, or the job stops naming the loss).
                ended = ended or time.monotonic()
                if not self.state.finishing or time.monotonic() - ended > FINISH_WAIT_S:
                    return
            await self._step(*await self._next())

    async def _next(self) -> tuple[Input, int | None]:
        """The next input and its log position; a Tick when the protocol's next deadline
        passes first (and at least every 0.1 s)."""
        due = deadline(self.rules, self.state)
        wait = 0.1 if due is None else min(0.1, max(0.0, due - time.time()))
        try:
            async with asyncio.timeout(wait):
                return await self.inputs.get()
        except TimeoutError:
            return Tick(), None

    async def _step(self, event: Input, position: int | None = None) -> None:
        if isinstance(event, Ready | Exited) and self.rules.restore:
            # A member stopped for a change, or one was lost, which may find state lost:
            # plan it knowing every checkpoint completed until now (the watcher looks
            # every 0.5 s; with every member lost, no Ready comes).
            steps = await asyncio.to_thread(self._complete_steps)
            if steps != frozenset(self.state.checkpoints):
                await self._step(OnDisk(tuple(sorted(steps))))
        state, actions = step(self.rules, self.state, event, time.time())
        if position is not None:  # every bus event before it has been taken in
            self.taken = position
        if state != self.state:
            self.state = state
            self.persist()  # before acting: a successor redoes what may not have happened
        for action in actions:
            await self._act(action)

    async def _act(self, action: Action) -> None:
        match action:
            case Publish(event=event):
                await self.core.publish(event)
                if isinstance(event, RecoveryPlan):
                    fault_point("plan")
                elif isinstance(event, PlanCommit):
                    fault_point("commit")
            case Kill(rank=rank):
                with contextlib.suppress(ProcessLookupError):
                    self.procs[rank].kill()
            case Terminate(rank=rank):
                with contextlib.suppress(ProcessLookupError):
                    self.procs[rank].terminate()
            case Spawn(rank=rank):
                assert self.spawn is not None
                assert self._group is not None
                proc = self.procs[rank] = await self.spawn(rank)
                self._group.create_task(self._watch_exit(rank, proc))
                log.warning("core.joiner_started", rank=rank, pid=proc.pid)
            case SharePlan(plan=plan):
                assert self.store is not None
                self.store.set(plan_key(plan.generation), json.dumps(plan_to_dict(plan)))
            case Note(event=name, fields=fields):
                log.warning(name, **fields)
            case Stop(reason=reason):
                raise JobFailed(reason)

    async def _watch_exit(self, rank: int, proc: WorkerProcess) -> None:
        code = await proc.wait()
        self.core.forget_worker(rank, self.cfg.layout.tp)
        # A TP group's exit is explained by the member that ended it.
        process = getattr(proc, "exited_member", None)
        gone = exited(self.run_dir, rank, code, process=process)
        if code == RULE_BROKEN:  # a bug that a recovery would hide: stop and name it
            raise JobFailed(f"rank {rank} broke a rule of its device's backend: {gone.why}")
        await self.inputs.put((gone, None))

    async def _watch_bus(self, events: ProtocolEvents) -> None:
        """Feed the events the protocol takes: those read back from a predecessor's
        log first, then each as it arrives."""
        scales = 0
        async for arrival in events:
            if (x := to_input(arrival.event, arrival.t, scales)) is not None:
                await self.inputs.put((x, arrival.position))
            scales += isinstance(arrival.event, ScaleRequest)

    async def _watch_heartbeats(self) -> None:
        """Fence a worker that is alive but silent."""
        timeout = self.cfg.liveness.heartbeat_timeout_s
        tick = min(0.1, timeout / 4)
        last_tick = time.monotonic()
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            if now - last_tick > max(4 * tick, timeout / 2):
                # The Core itself was stalled (stopped, starved): it cannot tell a silent
                # worker from a period it did not watch. Silence counts from now.
                log.warning("core.stalled", seconds=round(now - last_tick, 2))
                self.core.reset_silence(now)
            last_tick = now
            for rank in sorted(self.state.alive - set(self.state.fenced)):
                last = self.core.last_heartbeat.get(rank)
                if last is not None and now - last > timeout:
                    why = f"no heartbeat for {now - last:.1f} s (hung); fenced"
                    await self.inputs.put((Silent(rank, why), None))

    async def _watch_stragglers(self) -> None:
        """Run the fail-slow detector on the step timings while no change is under way."""
        while True:
            await asyncio.sleep(0.1)
            if self.state.change is not None:
                continue
            verdict = self.stragglers.update(self.core.take_step_timings(), set(self.state.alive))
            if verdict is None:
                continue
            assert verdict.step is not None  # a verdict that flags or clears evaluated a step
            slowdowns = {s.rank: s.factor for s in verdict.stragglers}
            straggling = Straggling(verdict.step, slowdowns, verdict.recovered, verdict.reason)
            await self.inputs.put((straggling, None))

    async def _watch_checkpoints(self) -> None:
        """Tell the protocol which disk checkpoints are complete: it restores the newest
        one it can when state is lost (read from the pieces' manifests, off the loop)."""
        while True:
            steps = await asyncio.to_thread(self._complete_steps)
            if steps != frozenset(self.state.checkpoints):
                await self.inputs.put((OnDisk(tuple(sorted(steps))), None))  # in turn
            await asyncio.sleep(CHECKPOINT_POLL_S)

    def _complete_steps(self) -> frozenset[int]:
        known = frozenset(self.state.checkpoints)
        return complete_steps(self.run_dir, self.cfg.model.num_layers, known, self.cfg.layout.tp)


def _leaves(group: BaseExceptionGroup[Any]) -> list[BaseException]:
    out: list[BaseException] = []
    for e in group.exceptions:
        out += _leaves(e) if isinstance(e, BaseExceptionGroup) else [e]
    return out
