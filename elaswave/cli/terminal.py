"""What ``elaswave train`` and ``run`` show a person on a terminal.

The progress line (step, loss, samples/s), rewritten in place; and for every change of
plan, short lines from the job's bus events: what happened, to which ranks, at which
step, then the outcome (recovered in N ms and the new layout in words, or the wait for
nodes and the checkpoint before the job stops; the CLI then says why it stopped).
Without a terminal the progress is one plain line per step and nothing else.

Step numbers in the change lines are step indices, as in ``--fault kill:1@8``,
``summary.json`` and the event log; the progress line counts the steps done.

:func:`people` is the log sink for ``--log-format auto`` on a terminal
(:mod:`elaswave.logs`): the few structured log records a person must see (the Core
lost and restarted, a host lost or joined, an error) become one readable line each on
stderr; the rest stay in ``RUN_DIR/logs/``.
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from elaswave.bus.schema import (
    CheckpointRequest,
    Event,
    FailureDetected,
    RecoveryFinished,
    RecoveryKind,
    RecoveryPlan,
    RunFinished,
    StepCompleted,
    WaitingForNodes,
)
from elaswave.engine.change import state_from_json
from elaswave.engine.plan import Plan
from elaswave.rundir import CORE_STATE


class Screen:
    """The terminal of this process: at most one status line is open at a time
    (rewritten in place with ``\\r``); any whole line, on stdout or stderr, ends it
    first so that nothing is written onto it."""

    def __init__(self) -> None:
        self._open: TextIO | None = None

    def status(self, stream: TextIO, line: str) -> None:
        stream.write("\r" + line)
        stream.flush()
        self._open = stream

    def end(self) -> None:
        """End the open status line, if any; it stays on the screen."""
        if self._open is not None:
            self._open.write("\n")
            self._open.flush()
            self._open = None

    def say(self, stream: TextIO, line: str) -> None:
        self.end()
        stream.write(line + "\n")
        stream.flush()


SCREEN = Screen()
"""One terminal per process: the progress line and the log lines share it."""


class Progress:
    """The live progress line (step, loss, samples/s) and, on a terminal, a line or two
    for every change of plan."""

    def __init__(
        self,
        steps: int,
        *,
        emulated: bool = False,
        run_dir: Path | None = None,
        stream: TextIO = sys.stdout,
    ) -> None:
        self.steps = steps
        self.unit = "samples/s (emulated)" if emulated else "samples/s"
        self.run_dir = run_dir
        """Where the Core keeps its state: the new layout after a change is read there."""
        self.stream = stream
        self.tty = stream.isatty()
        self.step = -1
        """The last completed step."""

    def __call__(self, event: Event) -> None:
        if isinstance(event, StepCompleted):
            self._step(event)
        elif self.tty:
            self._change(event)

    def _step(self, event: StepCompleted) -> None:
        self.step = event.step
        rate = event.samples / event.step_time_s if event.step_time_s > 0 else float("nan")
        line = (
            f"step {event.step + 1:>4}/{self.steps}  loss {event.loss:.4f}  {rate:8.1f} {self.unit}"
        )
        if event.lr > 0:
            line += f"  lr {event.lr:.3g}"
        if event.clipped:
            line += f"  grad norm {event.grad_norm:.3g}"
        if event.evaluated:
            line += f"  held-out {event.eval_loss:.4f}"
        if not self.tty:
            self.stream.write(line + "\n")
            self.stream.flush()
            return
        SCREEN.status(self.stream, line)
        if event.evaluated:  # kept on screen, not overwritten by the next step's line
            SCREEN.say(
                self.stream,
                f"elaswave: held-out loss {event.eval_loss:.4f} after step {event.step + 1}",
            )
        if event.step + 1 == self.steps:
            SCREEN.end()

    def _change(self, event: Event) -> None:
        if isinstance(event, RunFinished):
            SCREEN.end()  # the CLI says how it ended
            return
        line = change_line(event, step=self.step + 1, layout=self._layout, run_dir=self.run_dir)
        if line is not None:
            SCREEN.say(self.stream, f"elaswave: {line}")

    def _layout(self, generation: int) -> str | None:
        """The layout of plan ``generation`` in words, if it is the Core's current one."""
        if self.run_dir is None:
            return None
        try:
            plan = state_from_json(json.loads((self.run_dir / CORE_STATE).read_text())).plan
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return layout_text(plan) if plan.generation == generation else None


def change_line(
    event: Event,
    *,
    step: int,
    layout: Callable[[int], str | None],
    run_dir: Path | None = None,
) -> str | None:
    """A person's line for a change-of-plan event (None for the others). ``step``: the
    step under way; ``layout``: the layout of a plan generation in words, if known."""
    match event:
        case FailureDetected(ranks=ranks, source=source, detail=detail):
            return f"step {step}: {ranks_text(ranks)} failed: {detail or source}"
        case RecoveryPlan(attempt=0, kind=RecoveryKind.FAIL_SLOW) as plan:
            return f"step {plan.committed_step + 1}: {_slow_text(plan)}; rebalancing"
        case RecoveryPlan(attempt=0, kind=RecoveryKind.JOIN, joined=joined) as plan:
            return f"step {plan.committed_step + 1}: {ranks_text(joined)} joining"
        case RecoveryFinished() as done:
            now = layout(done.generation)
            return f"step {done.step}: {_outcome(done)}" + (f"; now {now}" if now else "")
        case WaitingForNodes(needed=needed, wait_s=wait_s):
            scale = f" (elaswave scale {run_dir} --add {needed} adds them)" if run_dir else ""
            return (
                f"too few ranks left for every stage: waiting up to {wait_s:g} s for "
                f"{needed} more{scale}"
            )
        case CheckpointRequest(step=checkpoint):
            return (
                f"no rank joined in time: writing a checkpoint of step {checkpoint} from "
                "memory before the job stops"
            )
    return None


def _outcome(done: RecoveryFinished) -> str:
    took = f"in {done.mttr_s * 1000:.0f} ms"
    match done.kind:
        case RecoveryKind.FAIL_SLOW:
            return f"rebalanced {took}"
        case RecoveryKind.JOIN:
            return f"{ranks_text(done.joined)} joined {took}"
    joined = f", {ranks_text(done.joined)} joined" if done.joined else ""
    return f"recovered {ranks_text(done.ranks)} {took}{joined}"


def _slow_text(plan: RecoveryPlan) -> str:
    """The measured slowdowns the plan answers, in words."""
    if not plan.slow_ranks:
        return "no rank is slow any more"
    pairs = list(zip(plan.slow_ranks, plan.slow_factors, strict=False))
    if len(pairs) == 1:
        (rank, factor), *_ = pairs
        return f"rank {rank} is {factor:.2f}x slower than its peers"
    slow = ", ".join(f"{rank} ({factor:.2f}x)" for rank, factor in pairs)
    return f"ranks {slow} are slower than their peers"


def ranks_text(ranks: Sequence[int]) -> str:
    """``rank 1``, ``ranks 1, 3`` (``no rank`` for none)."""
    if not ranks:
        return "no rank"
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def layout_text(plan: Plan) -> str:
    """A plan in words: its ranks, and each stage's ranks and layers (and the samples of
    every micro-batch each takes, where they differ)."""
    stages = []
    for s in plan.stages:
        layers = f"{s.layer_start}-{s.layer_stop - 1}"
        text = f"stage {s.stage} = {ranks_text(s.ranks)} on layers {layers}"
        if len(set(s.sizes)) > 1:
            rotation = ", rotating" if s.rotate else ""
            text += f" ({'+'.join(map(str, s.sizes))} samples{rotation})"
        stages.append(text)
    ranks, pp = len(plan.ranks), plan.pp
    counts = f"{ranks} rank{'s' * (ranks != 1)} in {pp} stage{'s' * (pp != 1)}"
    return f"{counts}: " + "; ".join(stages)


# -- log records for people (--log-format auto on a terminal) -------------------------


def _exit(code: Any) -> str:
    if isinstance(code, int) and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


_SENTENCES: dict[str, Callable[[Mapping[str, Any]], str]] = {
    "host.core_lost": lambda r: (
        f"the Core was lost ({_exit(r.get('code'))}); starting it again; the workers train "
        f"on (its log: logs/core{r.get('incarnation')}.log)"
    ),
    "core.restarted": lambda r: (
        f"the Core restarted (incarnation {r.get('incarnation')}) and took over the job"
    ),
    "host.summarising": lambda r: (
        f"{r.get('reason')}: the summary is written from the workers' results"
    ),
    "host.node_lost": lambda r: (
        f"host {r.get('node')} lost ({r.get('why')}): its ranks {r.get('ranks')} fail"
    ),
    "host.node_joined": lambda r: (
        f"host {r.get('node')} ({r.get('host')}) joined with {r.get('slots')} worker slot(s)"
    ),
    "agent.joined": lambda r: (
        f"node {r.get('node')} joined run {r.get('run_id')} with {r.get('slots')} worker slot(s)"
    ),
}
"""The log records a person must see, in words."""

_SERIOUS = ("error", "critical", "exception")


def log_line(record: Mapping[str, Any], *, relayed: bool) -> str | None:
    """A person's line for a structured log record, or None to leave it to the log
    files: the records of :data:`_SENTENCES`; this process's other warnings and errors;
    the Core's errors (its log names the rest)."""
    event = str(record.get("event", ""))
    if (sentence := _SENTENCES.get(event)) is not None:
        return f"elaswave: {sentence(record)}"
    level = str(record.get("level", "warning"))
    if relayed:
        if level not in _SERIOUS:
            return None
        error = f": {record['error']}" if "error" in record else ""
        where = f"logs/core{record.get('core', 0)}.log"
        return f"elaswave: the Core logged {level} {event}{error} ({where})"
    fields = ", ".join(
        f"{k} {v}"
        for k, v in record.items()
        if k not in ("event", "level", "timestamp", "exception") and not isinstance(v, dict)
    )
    line = f"elaswave: {level}: {event}" + (f" ({fields})" if fields else "")
    return line + (f"\n{record['exception']}" if "exception" in record else "")


def people(record: Mapping[str, Any], *, relayed: bool) -> None:
    """The log sink for people (:class:`elaswave.logs.PeopleSink`): stderr, one line."""
    line = log_line(record, relayed=relayed)
    if line is not None:
        to_stderr(line)


def to_stderr(line: str) -> None:
    """Write a log line on stderr, after ending the progress line (:data:`elaswave.logs.Write`)."""
    SCREEN.say(sys.stderr, line)
