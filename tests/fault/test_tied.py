"""Tied input and output embeddings (a Llama with ``tie_word_embeddings``, as Llama-3.2
1B/3B ship) through recovery: the embedding's copy on the first stage and the head's on
the last stay equal bit for bit, and each run matches its fault-free twin, when a rank
is killed mid-backward, when the stage holding the embedding is lost whole (a rank of
the last stage takes it over from the snapshots), and when the head moves (the pipeline
shortened to one stage that holds both copies, then grown back by a joiner that takes
the head). Replay reproduces every plan (:func:`tests.runs.train`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from elaswave.runtime.core.compare import compare_runs, load_params
from tests.runs import Run, train

pytestmark = pytest.mark.timeout(400)

SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             tie_word_embeddings=True, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)  # fmt: skip
JOB = ("--dp", "2", "--pp", "2", "--steps", "8", "--global-batch", "8", "--micro-batch", "1")
EMULATED = ("--device", "emulated", "--dp", "2", "--pp", "2")


@pytest.fixture(scope="module")
def tied(runs_dir: Path) -> tuple[str, ...]:
    directory = runs_dir / "hf_llama_tied"
    if not (directory / "config.json").exists():
        transformers.LlamaConfig(**SHAPE).save_pretrained(directory)
    return ("--model", f"hf:{directory}")


def _matches(run: Run, twin: Run, tolerance: float = 1e-4) -> None:
    diff = compare_runs(run.out, twin.out)
    assert diff.loss_rel <= tolerance and diff.param_rel <= tolerance, diff
    params = load_params(run.out)
    head = params[max(params)]["lm_head.weight"]
    assert torch.equal(params[0]["embed_tokens.weight"], head)  # the copies, bit for bit


def test_a_tied_models_kill_mid_backward_matches_its_twin(runs_dir, tied):
    twin = train(runs_dir / "tied_ref", *tied, *JOB)
    run = train(runs_dir / "tied_kill", *tied, *JOB, "--fault", "kill:1@3:backward")
    assert [r.ranks for r in run.summary.recoveries] == [(1,)]
    _matches(run, twin)


# long: a layout: tests/unit/test_hf_model.py (the copies' gradients against transformers)
@pytest.mark.long
def test_a_tied_model_trains_the_same_under_dp2_x_pp2_as_in_one_process(runs_dir, tied):
    one = train(runs_dir / "tied_one", *tied, *JOB[4:])
    _matches(train(runs_dir / "tied_layout", *tied, *JOB), one, tolerance=1e-5)


# long: a stage lost whole: tests/fault/test_fail_stop.py (its state the same machinery)
@pytest.mark.long
def test_the_stage_holding_the_embedding_lost_whole_is_taken_over(runs_dir, tied):
    job = (*tied, *EMULATED, "--steps", "16", "--global-batch", "16", "--micro-batch", "2")
    twin = train(runs_dir / "tied_stage_ref", *job)
    faults = ("kill:0@3:backward", "kill:1@5:forward", "join@7", "join@9")
    run = train(runs_dir / "tied_stage_lost", *job, *(x for f in faults for x in ("--fault", f)))
    stages = [[st.ranks for st in r.plan.stages] for r in run.summary.recoveries]
    assert stages[1][0] == (3,), f"a stage-1 rank takes the embedding's stage: {stages}"
    _matches(run, twin)


# long: growth: tests/fault/test_reform.py (the built-in model)
@pytest.mark.long
def test_the_head_moves_when_the_pipeline_shortens_and_grows_back(runs_dir, tied):
    config = runs_dir / "tied_short.toml"
    config.write_text(f'[model]\nsource = "{tied[1]}"\nseq_len = 8\n')
    job = ("--config", str(config), *EMULATED, "--steps", "20", "--global-batch", "16",
           "--micro-batch", "1")  # fmt: skip
    twin = train(runs_dir / "tied_grow_ref", *job)
    faults = ("kill:2@2:backward", "kill:3@2:backward", "kill:1@4:forward", "join@5", "join@5")
    run = train(runs_dir / "tied_grow", *job, *(x for f in faults for x in ("--fault", f)))
    shapes = [[st.ranks for st in r.plan.stages] for r in run.summary.recoveries]
    assert shapes[1] == [(0,)] and len(shapes[2]) == 2, shapes  # one stage, then two
    _matches(run, twin)


# long: the clip masks: tests/unit/test_recipe.py; TP with the tied pair: test_model_adapters
@pytest.mark.long
def test_a_tied_tensor_parallel_models_gradient_norm_is_one_processs(runs_dir, tied):
    """Clipping's norm counts the tied weight on its embedding's copy and what TP keeps
    whole on member 0 only, both at once: dp2 x tp2 reports one process's norms."""
    config = runs_dir / "tied_norm.toml"
    config.write_text("[optim]\nmax_grad_norm = 1000.0\n")
    job = (*tied, "--config", str(config), "--steps", "3", "--global-batch", "8",
           "--micro-batch", "1", "--profile", "off")  # fmt: skip
    one = train(runs_dir / "tied_norm_one", *job)
    split = train(runs_dir / "tied_norm_tp", *job, "--dp", "2", "--tp", "2")
    norms, expected = split.summary.grad_norm, one.summary.grad_norm
    assert norms is not None and expected is not None
    assert all(abs(a - b) <= 1e-6 * b for a, b in zip(norms, expected, strict=True))
