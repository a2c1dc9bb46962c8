"""``elaswave train`` on a real pseudo-terminal shows a person readable lines (progress,
the failure and its recovery) and no structured log; without a terminal its output is
the step lines on stdout and the Core's JSON log on stderr, as scripts read it."""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.runs import elaswave

JOB = ("--dp", "2", "--pp", "2", "--steps", "8", "--fault", "kill:1@5:backward")

RAW_DICT = re.compile(r"\w=\{|\w=\[\{|': ")
"""structlog's key-value rendering of a dict (``plan={'generation': ...``)."""


def _on_a_terminal(*args: str, timeout: float = 100.0) -> tuple[int, list[str]]:
    """Run ``elaswave`` with stdin, stdout and stderr on one pseudo-terminal; its exit
    code and every line it showed (a ``\\r`` rewrite starts a line of its own)."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "elaswave.cli.main", *args],
        stdin=follower,
        stdout=follower,
        stderr=follower,
    )
    os.close(follower)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: every writer has closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(leader)
    text = b"".join(chunks).decode(errors="replace")
    return code, [line for line in re.split(r"[\r\n]+", text) if line.strip()]


@pytest.mark.timeout(120)
def test_a_recovery_on_a_terminal_reads_as_sentences(tmp_path):
    out = tmp_path / "run"
    code, lines = _on_a_terminal("train", *JOB, "--out", str(out))
    shown = "\n".join(lines)
    assert code == 0, shown
    assert not [x for x in lines if x.lstrip().startswith("{")], f"a JSON line:\n{shown}"
    assert not [x for x in lines if RAW_DICT.search(x)], f"a raw key=value dict:\n{shown}"
    assert "elaswave: step 5: rank 1 failed: rank 1 exited with signal SIGKILL" in lines
    (recovered,) = [x for x in lines if x.startswith("elaswave: step 5: recovered rank 1 in ")]
    assert recovered.endswith(
        "; now 3 ranks in 2 stages: stage 0 = rank 0 on layers 0-2; "
        "stage 1 = ranks 2, 3 on layers 3-5"
    ), recovered
    assert "step    8/8" in shown
    assert lines[-1].startswith("elaswave: done: 8 steps")
    core_log = [json.loads(x) for x in (out / "logs" / "core0.log").read_text().splitlines()]
    assert "core.recovered" in [r["event"] for r in core_log], "the Core's log is kept whole"


@pytest.mark.timeout(120)
@pytest.mark.long  # terminal output: test_a_recovery_on_a_terminal_reads_as_sentences
def test_log_format_json_shows_the_cores_log_on_a_terminal(tmp_path):
    code, lines = _on_a_terminal("train", *JOB, "--log-format", "json", "--out", str(tmp_path))
    shown = "\n".join(lines)
    assert code == 0, shown
    records = [json.loads(x) for x in lines if x.startswith("{")]
    assert {"core.failure_detected", "core.recovered"} <= {r["event"] for r in records}, shown
    assert any(x.startswith("elaswave: step 5: recovered rank 1 in ") for x in lines), shown


@pytest.mark.timeout(120)
@pytest.mark.long  # terminal output: the sentences case; JSON lines: tests/unit/test_logs*.py
def test_without_a_terminal_the_output_is_step_lines_and_the_cores_json_log(tmp_path):
    proc = elaswave("train", *JOB, "--out", str(tmp_path / "run"), timeout=100)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    assert out[0].startswith("elaswave: training dp=2 x pp=2")
    assert [x.split("  loss")[0] for x in out[1:-1]] == [f"step {n:>4}/8" for n in range(1, 9)]
    assert out[-1].startswith("elaswave: done: 8 steps")
    records = [json.loads(x) for x in proc.stderr.splitlines()]
    assert {"core.failure_detected", "core.recovered"} <= {r["event"] for r in records}
    core_log = Path(tmp_path / "run" / "logs" / "core0.log").read_text().splitlines()
    assert [json.loads(x) for x in core_log] == records, "stderr relays the Core's log"
