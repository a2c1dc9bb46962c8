"""The tests' starter of ``elaswave`` commands (tests/forkserver.py) gives what a fresh
process gives: exit code, output, working directory, a kill."""

from __future__ import annotations

import signal
import subprocess

import pytest

from tests import forkserver


def test_a_command_gets_its_exit_code_its_output_and_the_callers_directory(tmp_path, monkeypatch):
    bad = forkserver.run(["train", "--dp", "0"], timeout=60)
    assert bad.returncode == 2
    assert bad.stderr.strip() == "elaswave: error: dp = 0: must be a positive integer"
    usage = forkserver.run(["--help"], timeout=60)
    assert usage.returncode == 0 and usage.stdout.startswith("usage: elaswave")
    monkeypatch.chdir(tmp_path)
    made = forkserver.run(["keys", "here"], timeout=60)
    assert made.returncode == 0, made.stderr
    assert (tmp_path / "here" / "server.key").exists()


def test_a_command_past_its_time_is_named_and_can_be_killed(tmp_path):
    job = forkserver.start(["train", "--out", str(tmp_path / "run"), "--steps", "100000"])
    with pytest.raises(subprocess.TimeoutExpired):
        job.wait(0.5)
    assert job.poll() is None
    job.send_signal(signal.SIGKILL)
    assert job.wait(30) == -signal.SIGKILL
    out, err = job.communicate(30)  # its processes die with it: the pipes close
    assert isinstance(out, str) and isinstance(err, str)
