"""``elaswave report RUN_DIR`` on a real run with a fail-stop and layer migration: a valid
PNG labelled EMULATED, one printed line per plan change matching summary.json; bad input
gets one line and status 2."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.png import read_png
from tests.runs import Run, elaswave, train

JOB = ("--dp", "2", "--pp", "2", "--steps", "6", "--global-batch", "16", "--micro-batch", "2")


@pytest.fixture(scope="module")
def faulted(runs_dir) -> Run:
    return train(
        runs_dir / "report_kill",
        *JOB,
        *("--device", "emulated", "--fault", "kill:1@3:backward", "--rebalance", "migrate"),
    )


def _layers(stages) -> str:
    return " ".join(f"[{s.layers[0]},{s.layers[1]})" for s in stages)


def test_report_of_a_fail_stop_with_migration(faulted):
    proc = elaswave("report", str(faulted.out), timeout=60)
    assert proc.returncode == 0, proc.stderr
    png = read_png(faulted.out / "report.png")
    assert 400 <= png.width <= 4000 and 300 <= png.height <= 4000, (png.width, png.height)
    assert "EMULATED timings" in png.text["Title"]

    (rec,) = faulted.summary.recoveries
    assert (rec.kind, rec.step, rec.ranks) == ("fail-stop", 3, (1,))
    after = _layers(rec.plan.stages)
    assert after != "[0,3) [3,6)", "the planner should have moved a layer"
    lines = proc.stdout.splitlines()
    assert "6 steps (steps 0-5)" in lines[0] and "EMULATED timings" in lines[0], lines[0]
    first = faulted.summary.schedule
    assert first is not None
    assert lines[1] == f"initial plan: layers [0,3) [3,6); dp 2 2; schedule {first}"
    switch = (
        f"schedule {first}"
        if rec.plan.schedule == first
        else f"schedule {first} → {rec.plan.schedule}"
    )
    assert lines[2].startswith(
        f"step 3: fail-stop ranks [1]: layers [0,3) [3,6) → {after}; dp 2 2 → 1 2; {switch} "
        "(shrink + resize + migrate; "
    ), lines[2]
    assert f"{rec.bytes_moved} bytes moved" in lines[2]
    assert lines[3:] == [f"elaswave: wrote {faulted.out / 'report.png'}"]
    assert png.text["Description"] == "\n".join(lines[:3])


def _one_error_line(proc: subprocess.CompletedProcess, message: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("elaswave: error: ") and message in lines[0], lines[0]
    assert proc.stdout == ""


def _copy(faulted: Run, dest, *names: str):
    dest.mkdir()
    for name in names:
        shutil.copy(faulted.out / name, dest / name)
    return dest


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda f, tmp: tmp / "nope", "does not exist"),
        (
            lambda f, tmp: _copy(f, tmp / "running", "job.json", "events.log"),
            "the job is still running or did not finish",
        ),
    ],
    ids=["missing", "no-summary"],
)
def test_run_dir_without_a_finished_run(faulted, tmp_path, make, message):
    _one_error_line(elaswave("report", str(make(faulted, tmp_path)), timeout=60), message)


def test_corrupt_files_are_named(faulted, tmp_path):
    run = _copy(faulted, tmp_path / "run", "job.json", "summary.json", "events.log")
    with (run / "events.log").open("ab") as log:
        log.write(b"\xc1 not msgpack")
    _one_error_line(elaswave("report", str(run), timeout=60), "events.log' is corrupt")
    text = (run / "summary.json").read_text()
    (run / "summary.json").write_text(text[: len(text) // 2])
    _one_error_line(elaswave("report", str(run), timeout=60), "summary.json' is corrupt")
    assert not (run / "report.png").exists()


def test_out_in_a_missing_directory(faulted, tmp_path):
    out = tmp_path / "missing" / "r.png"
    proc = elaswave("report", str(faulted.out), "--out", str(out), timeout=60)
    _one_error_line(proc, f"directory {str(out.parent)!r} does not exist")


def test_without_matplotlib_the_plot_extra_is_named(faulted, tmp_path):
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from elaswave.cli.main import main\n"
        f"sys.exit(main(['report', {str(faulted.out)!r}, '--out', {str(tmp_path / 'r.png')!r}]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    _one_error_line(proc, "install the plot extra: pip install 'elaswave[plot]'")
