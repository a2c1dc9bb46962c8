"""Helpers for tests that drive the real ``elaswave`` CLI in subprocesses."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import zmq

from elaswave.runtime.core.compare import load_params
from elaswave.runtime.core.replay import replay_run
from elaswave.runtime.job.results import Summary, WorkerResult, read_summary, read_worker_results
from tests import forkserver


@dataclass
class Run:
    out: Path
    proc: subprocess.CompletedProcess

    @property
    def summary(self) -> Summary:
        return read_summary(self.out)

    def workers(self) -> list[WorkerResult]:
        return read_worker_results(self.out)

    def params(self) -> dict[int, dict[str, torch.Tensor]]:
        return load_params(self.out)


DEVICE_ARGS: tuple[str, ...] = ()
"""Put before the arguments of every job a test starts (a later ``--device`` wins): the
fault suite runs on ``--device cpu-strict`` (:mod:`tests.fault.conftest`)."""


def _job(args: tuple[str, ...]) -> list[str]:
    """``args`` of an ``elaswave`` command, with :data:`DEVICE_ARGS` for a job."""
    if args and args[0] in ("train", "run"):
        return [args[0], *DEVICE_ARGS, *args[1:]]
    return list(args)


def elaswave(*args: str, timeout: float = 240, fresh: bool = False) -> subprocess.CompletedProcess:
    """``elaswave ARGS`` to its end, its output captured (text); started by the tests'
    fork server (:mod:`tests.forkserver`) unless ``fresh`` (a new interpreter, as a
    person's shell starts it) or ``ELASWAVE_TEST_EXEC=1``."""
    if forkserver.enabled() and not fresh:
        return forkserver.run(_job(args), timeout=timeout)
    return subprocess.run(
        [sys.executable, "-m", "elaswave.cli.main", *_job(args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


Job = subprocess.Popen | forkserver.Command
"""A job in the background: what the tests use of ``subprocess.Popen``."""


def launch(out: Path, *args: str, env: dict[str, str] | None = None) -> Job:
    """``elaswave train`` in the background; its stderr goes to OUT.stderr beside OUT."""
    with out.with_suffix(".stderr").open("w") as err:
        if forkserver.enabled():
            argv = _job(("train", "--out", str(out), *args))
            return forkserver.start(argv, stdout=subprocess.DEVNULL, stderr=err, env=env)
        return subprocess.Popen(
            [sys.executable, "-m", "elaswave.cli.main", *_job(("train", "--out", str(out), *args))],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=env,
        )


def train(out: Path, *args: str, timeout: float = 240) -> Run:
    """Run ``elaswave train`` to success; then replay its recovery plans from its event
    log, every one of which must come out byte for byte as the Core announced it."""
    proc = elaswave("train", "--out", str(out), *args, timeout=timeout)
    assert proc.returncode == 0, f"train failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    run = Run(out, proc)
    check_replay(run)
    return run


def check_replay(run: Run) -> None:
    """Every recovery of ``run`` has a plan that replay reproduces."""
    result = replay_run(run.out)
    assert result.diverged is None, result.diverged
    # One committed plan per recovery, after the announcements it superseded.
    recoveries = run.summary.recoveries
    assert [(p.generation, p.attempt) for p in result.plans] == [
        (r.generation, attempt) for r in recoveries for attempt in range(r.superseded + 1)
    ], result.plans


@contextlib.contextmanager
def plain_publisher(endpoint: str) -> Iterator[zmq.Socket]:
    """A bare ZeroMQ PUB socket (no handshake, no keys) connected to ``endpoint``: what a
    stranger or a buggy tool would use."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    try:
        pub.connect(endpoint)
        yield pub
    finally:
        pub.close(linger=0)
        ctx.term()


def await_logged(out: Path, job: Job, kind: type, timeout_s: float = 120) -> None:
    """Wait until RUN_DIR/events.log holds an event of ``kind`` while ``job`` runs."""
    from elaswave.bus.eventlog import read_event_log

    deadline = time.monotonic() + timeout_s
    while not any(isinstance(r.event, kind) for r in read_event_log(out / "events.log")):
        assert job.poll() is None, f"the job ended before any {kind.__name__}"
        assert time.monotonic() < deadline, f"no {kind.__name__} within {timeout_s:g} s"
        time.sleep(0.1)


@contextlib.contextmanager
def background_job(out: Path, *args: str) -> Iterator[Job]:
    """``elaswave train`` running in the background; yields once RUN_DIR/job.json exists.

    stdout and stderr are pipes (text). The job is killed if still running on exit.
    """
    argv = _job(("train", "--out", str(out), *args))
    job = (
        forkserver.start(argv)
        if forkserver.enabled()
        else subprocess.Popen(
            [sys.executable, "-m", "elaswave.cli.main", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    )
    try:
        deadline = time.monotonic() + 60
        while not (out / "job.json").exists():
            assert job.poll() is None, f"job ended early: {job.communicate()[1]}"
            assert time.monotonic() < deadline, "job.json never appeared"
            time.sleep(0.1)
        yield job
    finally:
        if job.poll() is None:
            job.kill()
        job.communicate()


def wait_for_event(out: Path, what, proc, timeout_s: float = 120) -> None:
    """Until RUN_DIR ``out``'s logs hold an event ``what`` accepts, while ``proc`` (the
    job) runs; AssertionError when the job ends first or ``timeout_s`` passes."""
    from elaswave.runtime.core.runlog import read_run_log

    deadline = time.monotonic() + timeout_s
    while not any(what(r.event) for r in read_run_log(out)):
        assert proc.poll() is None, "the job ended before it got there"
        assert time.monotonic() < deadline, "the job never got there"
        time.sleep(0.05)
