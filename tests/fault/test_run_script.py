"""``elaswave run SCRIPT``: the user's script is every worker's training loop, with its
own model and dataset; a SIGKILL is recovered inside its ``job.train_step()``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from elaswave.bus.eventlog import read_event_log
from elaswave.bus.schema import WorkerStarted
from elaswave.runtime.core.compare import compare_runs
from tests.runs import Run, check_replay, elaswave

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_hf_llama.py"
STEPS = 20


def _run(out: Path, *flags: str, script: Path = EXAMPLE, fresh: bool = False) -> Run:
    proc = elaswave("run", "--out", str(out), *flags, str(script), fresh=fresh)
    assert proc.returncode == 0, f"run failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    run = Run(out, proc)
    check_replay(run)
    return run


@pytest.fixture(scope="module")
def example_runs(runs_dir) -> dict[str, Run]:
    """The README's command (dp2 x pp2, 20 steps) in a new interpreter, as a person runs
    it, and the same script in one process."""
    return {
        "2x2": _run(
            runs_dir / "run_2x2", "--dp", "2", "--pp", "2", "--steps", str(STEPS), fresh=True
        ),
        "1x1": _run(runs_dir / "run_1x1", "--dp", "1", "--pp", "1", "--steps", str(STEPS)),
    }


@pytest.mark.timeout(300)
def test_the_readme_command_trains_the_scripts_model_on_its_dataset(example_runs):
    two, one = example_runs["2x2"], example_runs["1x1"]
    assert two.summary.steps_completed == STEPS
    assert two.summary.loss[-1] < two.summary.loss[0] - 0.5  # it learns the counting
    diff = compare_runs(two.out, one.out)  # the dataset is addressed by global sample id
    assert diff.loss_rel <= 1e-5 and diff.param_rel <= 1e-5, diff
    # The script's step hook printed the loss on the last stage's first replica.
    logged = (two.out / "logs" / "rank2.log").read_text().splitlines()
    assert [line.split()[3] for line in logged if " loss " in line] == [
        str(s) for s in range(STEPS)
    ]


@pytest.mark.timeout(300)
def test_a_kill_is_recovered_inside_the_scripts_train_step(runs_dir, example_runs):
    run = _run(runs_dir / "run_kill", "--dp", "2", "--pp", "2", "--steps", str(STEPS),
               "--fault", "kill:1@5:backward")  # fmt: skip
    s = run.summary
    assert s.steps_completed == STEPS
    assert [r.ranks for r in s.recoveries] == [(1,)]
    diff = compare_runs(run.out, example_runs["2x2"].out)
    assert diff.loss_rel <= 1e-4 and diff.param_rel <= 1e-4, diff
    started = [
        r.event.rank
        for r in read_event_log(run.out / "events.log")
        if isinstance(r.event, WorkerStarted)
    ]
    assert sorted(started) == [0, 1, 2, 3]  # no process started again
    log = (run.out / "logs" / "rank2.log").read_text()
    assert "FailureDetected [1]" in log  # the script's subscription
    assert "step 5 loss" in log and "(after a recovery)" in log  # its hook
    # TensorBoard scalars beside summary.json, read by TensorBoard's own reader.
    board = EventAccumulator(str(run.out / "tensorboard"))
    board.Reload()
    assert {e.step for e in board.Scalars("train/loss")} == set(range(STEPS))
    assert [e.value for e in board.Scalars("plan/ranks")] == [4.0, 3.0]
    (mttr,) = board.Scalars("recovery/mttr_s")
    assert mttr.value == pytest.approx(s.recoveries[0].mttr_s, rel=1e-6)


def test_the_script_outside_a_job_says_how_to_start_it():
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("elaswave: error: elaswave.job() runs inside")
    assert "elaswave run" in proc.stderr


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("print('hello')\n", "never called elaswave.job(): nothing to run"),
        ("raise KeyError('no data here')\n", "failed before elaswave.job() (status 1): KeyError"),
        (
            "import elaswave\nelaswave.job(model='hf:/nonexistent/model')\n",
            "model directory '/nonexistent/model' has no config.json",
        ),
    ],
)
def test_a_script_that_cannot_start_a_job_gets_one_line(tmp_path, body, message):
    script = tmp_path / "train.py"
    script.write_text(body)
    proc = elaswave("run", "--out", str(tmp_path / "out"), str(script))
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.timeout(300)
@pytest.mark.long  # scripts/test_long
def test_a_script_that_stops_early_fails_the_job_naming_the_step(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import elaswave\njob = elaswave.job()\njob.train_step()\n")
    proc = elaswave("run", "--out", str(tmp_path / "out"), "--steps", "3", str(script))
    assert proc.returncode == 1, proc.stderr
    logs = "".join(p.read_text() for p in (tmp_path / "out" / "logs").glob("rank*.log"))
    assert "returned at step 1 of 3: call job.train_step() until job.done" in logs


@pytest.mark.timeout(300)
# long: the README's command: test_the_readme_command_trains_the_scripts_model_on_its_dataset
@pytest.mark.long
def test_the_built_in_model_example_trains_as_elaswave_train_does(runs_dir):
    """examples/train_builtin.py (no model, no dataset: the job's) is the built-in loop."""
    job = ("--dp", "1", "--pp", "2", "--steps", "4", "--global-batch", "8", "--micro-batch", "2")
    script = _run(runs_dir / "run_builtin", *job, script=EXAMPLE.parent / "train_builtin.py")
    proc = elaswave("train", "--out", str(runs_dir / "train_builtin"), *job)
    assert proc.returncode == 0, proc.stderr
    diff = compare_runs(script.out, runs_dir / "train_builtin")
    assert diff.loss_rel == 0.0 and diff.param_rel == 0.0, diff
