"""Gradients summed in float64 (``[optim] grad_reduce_dtype = "float64"``) through
faults: a dp2 x pp2 job that loses a rank mid-backward, takes a joiner and loses another
rank mid-forward trains to the same bits as the same job in one process, fault-free,
under the recipe (clipping every step, a cosine schedule): losses and every parameter
equal (every step's gradient norm to its float64 rounding), for the built-in model and
a tied-embedding Llama.
Replay reproduces every plan (:func:`tests.runs.train`). The arithmetic:
tests/unit/test_exact_sums.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers

from elaswave.runtime.core.compare import compare_runs
from tests.fault.test_recipe import RECIPE as CLIP_COSINE
from tests.runs import Run, train

pytestmark = pytest.mark.timeout(400)

RECIPE = CLIP_COSINE + 'grad_reduce_dtype = "float64"\n'
STEPS = ("--steps", "8", "--global-batch", "16", "--micro-batch", "2")
FAULTS = ("--fault", "kill:1@3:backward", "--fault", "join@5", "--fault", "kill:2@6:forward")
TIED = dict(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            tie_word_embeddings=True, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)  # fmt: skip


@pytest.fixture(scope="module")
def exact(runs_dir: Path) -> tuple[str, ...]:
    path = runs_dir / "exact_sums.toml"
    path.write_text(RECIPE)
    return ("--config", str(path))


def _same_bits(run: Run, ref: Run) -> None:
    diff = compare_runs(run.out, ref.out)
    assert diff.loss_rel == 0.0 and diff.param_rel == 0.0, diff
    norms, expected = run.summary.grad_norm, ref.summary.grad_norm
    assert norms is not None and expected is not None and min(expected) > 0.5  # all clip
    # the norm itself is a float64 sum over each layout's shards: equal to its last bits
    assert norms == pytest.approx(expected, rel=1e-14, abs=0)


@pytest.mark.parametrize("model", ["builtin", "tied"])
def test_a_job_through_two_kills_and_a_join_has_the_bits_of_one_process(runs_dir, exact, model):
    args = exact
    if model == "tied":
        directory = runs_dir / "exact_tied_llama"
        if not (directory / "config.json").exists():
            transformers.LlamaConfig(**TIED).save_pretrained(directory)
        args = (*exact, "--model", f"hf:{directory}")
    ref = train(runs_dir / f"exact_{model}_one", *args, "--dp", "1", "--pp", "1", *STEPS)
    run = train(runs_dir / f"exact_{model}", *args, "--dp", "2", "--pp", "2", *STEPS, *FAULTS)
    # (a join may come in the same change as the second kill)
    assert {rank for r in run.summary.recoveries for rank in r.ranks} == {1, 2, 4}
    _same_bits(run, ref)


def test_a_tp_job_killed_mid_backward_has_the_bits_of_one_tp_group(runs_dir, exact):
    """Within one TP width: a TP layer's own sums are cut by its width, so it is the
    reference (another width agrees to rounding: tests/fault/test_tensor_parallel.py)."""
    tp = ("--tp", "2", *STEPS)
    ref = train(runs_dir / "exact_tp_one", *exact, "--dp", "1", "--pp", "1", *tp)
    run = train(runs_dir / "exact_tp", *exact, "--dp", "2", "--pp", "2", *tp,
                "--fault", "kill:2@3:backward")  # fmt: skip
    assert [r.ranks for r in run.summary.recoveries] == [(1,)]  # unit 1: ranks 2 and 3
    _same_bits(run, ref)


def test_survivors_that_do_not_divide_a_micro_batch_keep_its_blocks_whole(runs_dir, exact):
    """dp4 x pp2 losing a rank mid-backward: the stage's three survivors take 4 + 2 + 2
    samples of every 8 in rotation, whole 2-sample blocks (3 + 3 + 2 cut one between two
    ranks and missed the bits by 7e-9: chaos seed 19937, case 37)."""
    job = ("--steps", "10", "--global-batch", "16", "--micro-batch", "2")
    ref = train(runs_dir / "exact_blocks_one", *exact, "--dp", "1", "--pp", "1", *job)
    run = train(runs_dir / "exact_blocks", *exact, "--dp", "4", "--pp", "2", *job,
                "--ranks-per-node", "3", "--fault", "kill:6@6:backward")  # fmt: skip
    (recovery,) = run.summary.recoveries
    assert sorted(recovery.plan.stages[1].sizes) == [2, 2, 4]
    _same_bits(run, ref)
