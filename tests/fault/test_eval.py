"""``--eval-every``: the held-out loss, evaluated inside the step by the pipeline.

The held-out losses of dp2 x pp2 equal dp1 x pp1's (the same windows, the same per-window
losses, summed in float64), the last one equals ``elaswave evaluate`` of the finished
run's parameters, and a rank killed in the middle of an evaluation is recovered inside
the step: the evaluation is redone with it, and the run matches its fault-free twin
(:func:`tests.runs.train` replays every plan)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from elaswave.cli.evaluate import evaluate
from elaswave.runtime.core.compare import compare_runs
from tests.runs import train

pytestmark = pytest.mark.timeout(300)

STEPS = ("--steps", "6", "--global-batch", "8", "--micro-batch", "1", "--eval-every", "2")


def _heldout(runs_dir) -> Path:
    """A held-out token file of 20 windows of the tiny model's sequence length."""
    path = runs_dir / "heldout.bin"
    np.random.default_rng(7).integers(0, 128, size=20 * 32 + 1).astype("uint16").tofile(path)
    return path


def _within(losses, expected, rel: float) -> bool:
    return all(abs(a - b) <= rel * b for a, b in zip(losses, expected, strict=True))


@pytest.fixture(scope="module")
def ref(runs_dir):
    return train(runs_dir / "eval_ref", "--dp", "1", "--pp", "1", *STEPS)


def test_the_held_out_loss_is_the_same_on_every_layout_and_through_a_kill(runs_dir, ref):
    steps, losses = ref.summary.eval_steps, ref.summary.eval_loss
    assert steps == (1, 3, 5) and losses[0] > losses[-1] > 0  # it learns
    assert max(ref.summary.loss[-1] / losses[-1], losses[-1] / ref.summary.loss[-1]) < 1.5
    split = train(runs_dir / "eval_dp2pp2", "--dp", "2", "--pp", "2", *STEPS)
    assert split.summary.eval_steps == steps
    assert _within(split.summary.eval_loss, losses, 1e-6)
    killed = train(
        runs_dir / "eval_kill", "--dp", "2", "--pp", "2", *STEPS, "--fault", "kill:3@3:eval"
    )
    (recovery,) = killed.summary.recoveries
    assert recovery.kind == "fail-stop" and list(recovery.ranks) == [3]
    assert killed.summary.eval_steps == steps
    assert all(
        abs(a - b) <= 1e-4 * b for a, b in zip(killed.summary.eval_loss, losses, strict=True)
    )
    diff = compare_runs(killed.out, ref.out)
    assert diff.loss_rel <= 1e-4 and diff.param_rel <= 1e-4, diff


def test_the_last_evaluation_is_what_elaswave_evaluate_gives(runs_dir):
    heldout = _heldout(runs_dir)
    run = train(
        runs_dir / "eval_file", "--dp", "2", "--pp", "2", "--steps", "3", "--global-batch", "8",
        "--micro-batch", "1", "--eval-every", "3", "--eval-batches", "2", "--eval-data",
        str(heldout),
    )  # fmt: skip
    assert run.summary.eval_steps == (2,)
    offline = evaluate(run.out, heldout, max_samples=16)
    assert offline.samples == 16
    assert abs(run.summary.eval_loss[-1] - offline.loss) <= 1e-6 * offline.loss
