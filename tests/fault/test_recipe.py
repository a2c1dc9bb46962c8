"""The recipe under faults: gradients clipped by their global norm (a threshold every
step exceeds) under a cosine learning-rate schedule. A rank killed while the step's
gradient is being reduced and clipped, and a TP member killed after its optimizer
update, are recovered inside the step; the run matches its fault-free twin (losses,
parameters and every step's gradient norm), and replay reproduces every plan
(:func:`tests.runs.train`)."""

from __future__ import annotations

import pytest

from elaswave.runtime.core.compare import compare_runs
from tests.runs import train

pytestmark = pytest.mark.timeout(300)

JOB = ("--dp", "2", "--pp", "2", "--steps", "6", "--global-batch", "8", "--micro-batch", "1")
RECIPE = """
[optim]
warmup_steps = 1
lr_schedule = "cosine"
min_lr = 3e-4
max_grad_norm = 0.5
"""


@pytest.fixture(scope="module")
def recipe(runs_dir):
    path = runs_dir / "recipe.toml"
    path.write_text(RECIPE)
    return ("--config", str(path))


def _matches(run, ref) -> None:
    diff = compare_runs(run.out, ref.out)
    assert diff.loss_rel <= 1e-4 and diff.param_rel <= 1e-4, diff
    norms, expected = run.summary.grad_norm, ref.summary.grad_norm
    assert norms is not None and expected is not None and len(norms) == len(expected)
    assert all(abs(a - b) <= 1e-4 * b for a, b in zip(norms, expected, strict=True))


def test_a_kill_while_the_gradient_is_reduced_and_clipped_is_recovered(runs_dir, recipe):
    ref = train(runs_dir / "recipe_ref", *JOB, *recipe)
    norms, lrs = ref.summary.grad_norm, ref.summary.lr
    assert norms is not None and min(norms) > 0.5  # every step clips
    assert lrs is not None and lrs[0] > lrs[3] > lrs[5] == 3e-4  # the cosine decay
    run = train(runs_dir / "recipe_kill", *JOB, *recipe, "--fault", "kill:1@3:grad-sync")
    (recovery,) = run.summary.recoveries
    assert recovery.kind == "fail-stop" and list(recovery.ranks) == [1]
    _matches(run, ref)


# long: the TP group's part of the norm: tests/unit/test_recipe.py and the layout script
@pytest.mark.long
def test_a_tp_member_killed_after_its_clipped_update_is_recovered(runs_dir, recipe):
    job = ("--dp", "2", "--pp", "1", "--tp", "2", "--steps", "6", "--global-batch", "8",
           "--micro-batch", "1")  # fmt: skip
    ref = train(runs_dir / "recipe_tp_ref", *job, *recipe)
    run = train(runs_dir / "recipe_tp_kill", *job, *recipe, "--fault", "kill:3@2:optimizer")
    assert len(run.summary.recoveries) == 1
    _matches(run, ref)
