"""What a run leaves behind, typed: ``RUN_DIR/summary.json`` (:class:`Summary`) and each
worker's ``RUN_DIR/workers/rankN.json`` (:class:`WorkerResult`).

Both are written and read here only, by one codec (:mod:`elaswave.engine.codec`) from the
dataclasses themselves; their recovery records are the Core's own
(:class:`~elaswave.engine.record.RecoveryRecord`, written as
:func:`~elaswave.engine.record.record_to_json` spells them). summary.json is the contract
that tests, benchmarks and users read: later versions only add keys (with a default, so
that an older file still reads), and :attr:`Summary.SCHEMA` names its version
(``schema_version`` in the file; a file without one is of version 1).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from elaswave import rundir
from elaswave.engine.codec import Forms, from_json, to_json
from elaswave.engine.record import RecoveryRecord, record_from_json, record_to_json
from elaswave.engine.schedule import Schedule

_FORMS: Forms = {RecoveryRecord: (record_to_json, record_from_json)}
SCHEMA_KEY = "schema_version"
_T = TypeVar("_T")


@dataclass(frozen=True, kw_only=True)
class Layout:
    """The job's layout at its start."""

    dp: int
    pp: int
    tp: int


@dataclass(frozen=True, kw_only=True)
class BusCounts:
    """Delivery counters of the bus (:mod:`elaswave.bus.reliable`): the Core's, and the
    workers' summed."""

    core: Mapping[str, int]
    workers: Mapping[str, int]


@dataclass(frozen=True, kw_only=True)
class Summary:
    """A finished run (``RUN_DIR/summary.json``)."""

    SCHEMA: ClassVar[int] = 1

    layout: Layout
    global_batch: int
    steps_completed: int
    """The step the run ended at (its first step plus the steps it trained)."""
    loss: tuple[float, ...]
    """The loss of every step this run trained, from ``first_step`` on."""
    step_time_s: tuple[float, ...]
    """Each step's time: its slowest rank's."""
    samples_per_s: float
    param_digest: str | None
    """sha256 of every final parameter in canonical layer order, fp32 little-endian; None
    where the run directory holds some layers' only (a multi-host job without a shared
    run directory: each host's holds the stages its ranks saved)."""
    events: int
    """Messages the Core logged."""
    recoveries: tuple[RecoveryRecord, ...]
    """Every change of plan, in order."""
    device: str
    timing: str
    """``measured``, or ``emulated`` (the times are the emulated device's)."""
    first_step: int
    predicted_step_s: float | None
    """The planners' simulated step time of the initial plan (None: not priced)."""
    bus: BusCounts
    core_incarnations: int | None = None
    """How many Cores ran the job (None: its host wrote the summary, the Core lost)."""
    snapshot_host_bytes: Mapping[int, int] | None = None
    """Host memory each rank's snapshots of other ranks' shards took at the end, by rank
    (grows with ``--snapshot-copies``; None: no worker reported it)."""
    lr: tuple[float, ...] | None = None
    """The learning rate of every step, as ``loss`` (None in summaries before it)."""
    grad_norm: tuple[float, ...] | None = None
    """The global gradient norm of every step before clipping, as ``loss`` (None where
    the job does not clip gradients)."""
    eval_steps: tuple[int, ...] = ()
    """The steps after which the held-out loss was evaluated (``--eval-every``)."""
    eval_loss: tuple[float, ...] = ()
    """The mean held-out loss per window after each of ``eval_steps``."""
    schedule: Schedule | None = None
    """The pipeline schedule of the initial plan (its ``--schedule`` choice; each
    change's plan records its own). None in summaries written before it was recorded."""


@dataclass(frozen=True, kw_only=True)
class Trace:
    """The actions a stage replica ran in one step, in order: (``F``, ``B``, ``I`` or
    ``W``, micro-batch), and when each ran: (start, end) in seconds from the step's start
    (its waits for what it receives included)."""

    step: int
    actions: tuple[tuple[str, int], ...]
    times: tuple[tuple[float, float], ...] = ()


@dataclass(frozen=True, kw_only=True)
class WorkerResult:
    """What a rank reports of its run (``RUN_DIR/workers/rankN.json``); member 0 of a
    TP group reports for the group."""

    rank: int
    stage: int
    replica: int
    step_time_s: tuple[float, ...]
    """Its step times, from ``first_step`` on."""
    loss: tuple[float, ...] | None
    """The losses of the steps it ran in the last stage (None: it never did)."""
    loss_steps: tuple[int, ...]
    """The steps ``loss`` is of."""
    traces: tuple[Trace, ...]
    optimizer_shard_numel: int
    stage_param_numel: int
    optimizer_digests: tuple[str, ...]
    """Per-step digests of its optimizer shard (``--verify-snapshots``)."""
    snapshot_digests: Mapping[int, tuple[str, ...]]
    """Per-step digests of the snapshots it holds, by owner (``--verify-snapshots``)."""
    generation: int
    """The plan generation it finished under."""
    first_step: int
    bus: Mapping[str, int]
    cpu_s: float
    snapshot_cpu_s: float
    """CPU time its snapshot work took (the keepers' and its own sender's)."""
    optimizer_device: str | None = None
    """The device type its optimizer shard lived on (``cpu``, ``cuda``): a host holder's
    snapshot equals it bit for bit on ``cpu`` only (:func:`elaswave.fabric.verify.exact_on`)."""
    optimizer_fingerprints: tuple[tuple[float, ...], ...] | None = None
    """Per-step fingerprints of its optimizer shard (``--verify-snapshots``)."""
    snapshot_fingerprints: Mapping[int, tuple[tuple[float, ...], ...]] | None = None
    """Per-step fingerprints of the snapshots it holds, by owner (``--verify-snapshots``)."""
    snapshot_host_bytes: int = 0
    """Host memory its snapshots of other ranks' shards took at the end (every copy it
    holds: shard states and gradient buffers)."""
    grad_norm: tuple[float, ...] | None = None
    """The global gradient norm of each step of ``loss_steps`` (None: not clipped)."""
    pipeline_s: tuple[float, ...] | None = None
    """Per step, as ``step_time_s``: the pipeline's part (to the end of the last action
    and its sends, before the optimizer step). None in results written before it."""
    eval_steps: tuple[int, ...] = ()
    """The steps it evaluated the held-out loss after, in the last stage."""
    eval_loss: tuple[float, ...] = ()
    """The held-out loss after each of ``eval_steps``."""


def write_summary(run_dir: Path, summary: Summary) -> None:
    doc = {**to_json(summary, Summary, _FORMS), SCHEMA_KEY: Summary.SCHEMA}
    (run_dir / rundir.SUMMARY).write_text(json.dumps(doc, indent=2))


def read_summary(run_dir: Path) -> Summary:
    """The summary of the finished run in ``run_dir``; ValueError naming the file and
    what is wrong with it (missing, not JSON, of a newer schema, malformed)."""
    path = run_dir / rundir.SUMMARY
    doc = _read_json(path, "summary")
    version = doc.pop(SCHEMA_KEY, 1)
    if version != Summary.SCHEMA:
        raise ValueError(
            f"{str(path)!r} is a summary of schema {version!r}; this ElasWave reads schema "
            f"{Summary.SCHEMA}"
        )
    return _decode(doc, Summary, path)


def write_worker_result(run_dir: Path, result: WorkerResult) -> None:
    path = rundir.worker_result(run_dir, result.rank)
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(to_json(result, WorkerResult)))


def read_worker_results(run_dir: Path) -> list[WorkerResult]:
    """Every worker's result in ``run_dir``, by rank."""
    paths = rundir.worker_results(run_dir)
    return [_decode(_timed(_read_json(p, "worker result")), WorkerResult, p) for p in paths]


def _timed(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with every trace's ``times`` (results written before traces had them:
    none)."""
    traces = doc.get("traces")
    if isinstance(traces, list):
        traces = [{"times": [], **t} if isinstance(t, dict) else t for t in traces]
        return {**doc, "traces": traces}
    return doc


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{str(path)!r} does not exist: the run has no {what}") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{str(path)!r} is not a readable {what}: {exc}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{str(path)!r} is not a {what}: expected a JSON object")
    return doc


def _decode(doc: dict[str, Any], cls: type[_T], path: Path) -> _T:
    """``doc`` as ``cls``; a field added later (its default None) is None when an older
    file lacks it."""
    later = {f.name: None for f in dataclasses.fields(cls) if f.default is None}  # type: ignore[arg-type]
    try:
        value: _T = from_json({**later, **doc}, cls, _FORMS)
    except ValueError as exc:
        raise ValueError(f"{str(path)!r} is malformed: {exc}") from None
    return value
