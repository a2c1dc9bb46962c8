"""How a host starts one of the job's workers, on node 0 and on every other host alike:
forked by the host's zygote (milliseconds), or exec'd when there is no zygote or a
``worker_prefix`` must run in front of it (a fresh Python that imports torch: seconds)."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from elaswave.rundir import rank_log
from elaswave.runtime.host.zygote import ForkedProcess, Zygote
from elaswave.runtime.job.config import JobConfig
from elaswave.runtime.job.localrank import LocalRanks

WORKER_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


async def start_worker(
    cfg: JobConfig,
    run_dir: Path,
    rank: int,
    *,
    join: bool,
    zygote: Zygote | None,
    devices: LocalRanks,
) -> asyncio.subprocess.Process | ForkedProcess:
    """Worker ``rank`` of ``cfg`` (a joiner when ``join``), its output in its rank log,
    on the device of this host's ``devices`` it takes (given back when it exits)."""
    argv = ["--run-dir", str(run_dir), "--rank", str(rank), *(["--join"] if join else [])]
    env = {**WORKER_ENV, **devices.env(rank)}
    try:
        with rank_log(run_dir, rank).open("wb") as out:
            if zygote is not None and not cfg.layout.worker_prefix:
                forked = await zygote.spawn("worker", argv, {**env}, [out.fileno()])
                return ForkedProcess(zygote, forked)
            command = [*cfg.layout.worker_command(rank), sys.executable]
            return await asyncio.create_subprocess_exec(
                *command, "-m", "elaswave.runtime.worker.process", *argv,
                stdout=out, stderr=asyncio.subprocess.STDOUT, env={**os.environ, **env},
            )  # fmt: skip
    except BaseException:
        devices.release(rank)
        raise
