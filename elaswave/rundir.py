"""The layout of a run directory: every file and folder a job writes there, named once.

::

    RUN_DIR/
      host.json              the job as the host wrote it (no bus endpoints yet)
      job.json               the job with its bus endpoints: what everyone else reads
      events.log             the Core's event log (msgpack records)
      core_state.json        what a restarted Core resumes from
      core_restore.msgpack   the Core's newest restore point of the event log
      core_result.json       the Core's outcome
      core.pid               the running Core's process id
      summary.json           the run's summary, written when it ends
      profile.json           the measured layer costs the job was planned with (--profile)
      logs/rankN.log         each worker's output
      logs/coreN.log         each Core incarnation's output
      workers/rankN.json     each worker's result
      params/stageS.pt       each stage's final parameters (its replica 0 writes them)
      faults/rankN.json      an injected fault that killed rank N, and when
      checkpoints/stepK/     a checkpoint: one rankN.pt per rank (its shard's pieces)

No dependency: every layer may import it (the checkpoint writer in
:mod:`elaswave.fabric` as well as the runtime and the CLI).
"""

from __future__ import annotations

from pathlib import Path

HOST_SPEC = "host.json"
"""The job as the host wrote it (the store's address, no bus yet): Core incarnation 0
reads it and writes :data:`JOB` with the bus endpoints, which everyone else reads."""
JOB = "job.json"
"""The job spec (:class:`~elaswave.runtime.job.config.JobSpec`): config and endpoints."""
EVENT_LOG = "events.log"
"""The Core's log of every event on the bus."""
HEALTH_LOG = "health"
"""The Core's rolling log of the liveness and timing chatter (step timings, heartbeats):
numbered segments, its newest records only (:mod:`elaswave.bus.rolling`)."""
CORE_STATE = "core_state.json"
"""What a restarted Core resumes from, beside the event log: membership, the plan and
its generation, the recoveries so far, and a change under way."""
RESTORE_POINT = "core_restore.msgpack"
"""The Core's newest restore point: its state read back from the event log up to a
position (:mod:`elaswave.runtime.core.restorepoint`)."""
CORE_RESULT = "core_result.json"
"""The Core's outcome: ``{"ok": true}`` or ``{"ok": false, "reason": ...}``."""
CORE_PID = "core.pid"
"""The running Core's process id."""
SUMMARY = "summary.json"
"""The run's summary (losses, timings, recoveries), written when it ends."""
PROFILE = "profile.json"
"""The layers measured before the job started
(:class:`~elaswave.runtime.host.profile.LayerProfile`), when it was profiled; job.json
carries them priced for the planners."""
REPORT = "report.png"
"""Where ``elaswave report`` draws the run by default."""
LOGS = "logs"
WORKERS = "workers"
PARAMS = "params"
FAULTS = "faults"
CHECKPOINTS = "checkpoints"

TENSORBOARD = "tensorboard"
"""The job's TensorBoard scalars (:mod:`elaswave.runtime.host.tensorboard`)."""
OUTPUTS = (
    WORKERS, PARAMS, LOGS, FAULTS, EVENT_LOG, SUMMARY, JOB, CORE_STATE, CORE_RESULT,
    HOST_SPEC, CORE_PID, PROFILE, TENSORBOARD, RESTORE_POINT, HEALTH_LOG,
)  # fmt: skip
"""What one run writes; a new run in the same directory clears them first (and
:data:`CHECKPOINTS` too unless it resumes from them)."""


def rank_log(run_dir: Path, rank: int) -> Path:
    return run_dir / LOGS / f"rank{rank}.log"


def core_log(run_dir: Path, incarnation: int) -> Path:
    return run_dir / LOGS / f"core{incarnation}.log"


def worker_result(run_dir: Path, rank: int) -> Path:
    return run_dir / WORKERS / f"rank{rank}.json"


def worker_results(run_dir: Path) -> list[Path]:
    """Every worker's result file, sorted by name."""
    return sorted((run_dir / WORKERS).glob("rank*.json"))


def stage_params(run_dir: Path, stage: int) -> Path:
    return run_dir / PARAMS / f"stage{stage}.pt"


def stage_params_files(run_dir: Path) -> list[Path]:
    """Every stage's final parameter file, sorted by name."""
    return sorted((run_dir / PARAMS).glob("stage*.pt"))


def fault_record(run_dir: Path, rank: int) -> Path:
    return run_dir / FAULTS / f"rank{rank}.json"


def step_dir(run_dir: Path, step: int) -> Path:
    """The checkpoint of ``step``."""
    return run_dir / CHECKPOINTS / f"step{step}"
