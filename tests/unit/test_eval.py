"""``--eval-every``'s settings: which steps evaluate, where the held-out tokens come from,
and what is refused, naming the value."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import numpy as np
import pytest

from elaswave.data.corpus import DataConfig, HeldOut, SyntheticCorpus, open_heldout
from elaswave.runtime.job.config import JobConfig
from elaswave.runtime.job.sections import InjectionConfig, ScheduleConfig
from tests.runs import elaswave


def _tokens(path: Path, count: int) -> Path:
    np.random.default_rng(0).integers(0, 128, size=count).astype("uint16").tofile(path)
    return path


def _pairs(corpus: SyntheticCorpus) -> set[tuple[int, int]]:
    """Every (token, next token) the corpus has."""
    out = set()
    for w in range(len(corpus)):
        tokens = [int(t) for t in corpus.window(w)]
        out.update(itertools.pairwise(tokens))
    return out


def test_every_kth_step_and_the_last_evaluate() -> None:
    schedule = ScheduleConfig(steps=10, eval_every=4)
    assert [s for s in range(10) if schedule.evaluates(s)] == [3, 7, 9]
    assert not any(ScheduleConfig(steps=10).evaluates(s) for s in range(10))


def test_the_synthetic_held_out_set_is_the_same_chain_with_other_sequences() -> None:
    train = SyntheticCorpus(vocab_size=64, seq_len=16, num_samples=2000, seed=3)
    held = SyntheticCorpus(vocab_size=64, seq_len=16, num_samples=50, seed=3, heldout=True)
    pairs, held_pairs = _pairs(train), _pairs(held)
    assert not np.array_equal(train.window(0), held.window(0))
    assert held_pairs <= pairs  # the same successors: only the chain's transitions


def test_the_held_out_file_beside_a_tokenized_train_file_is_found(tmp_path: Path) -> None:
    train = _tokens(tmp_path / "train.bin", 40 * 32 + 1)
    heldout = _tokens(tmp_path / "heldout.bin", 20 * 32 + 1)
    job = JobConfig(
        data=DataConfig(path=str(train)), schedule=ScheduleConfig(eval_every=2, global_batch=8)
    )
    assert job.data.heldout == str(heldout)  # recorded in job.json
    held = open_heldout(job.data, vocab_size=128, seq_len=32, windows=16)
    assert isinstance(held, HeldOut) and len(held) == 20
    inputs, targets = held.batch([0, 19])
    assert inputs.shape == (2, 32) and bool((inputs[0, 1:] == targets[0, :-1]).all())


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        ({"eval_every": -1}, "eval_every = -1: must be 0 (never) or more"),
        ({"eval_batches": 0}, "eval_batches = 0: must be a positive integer"),
    ],
)
def test_a_bad_eval_setting_is_refused_naming_it(schedule: dict, message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        ScheduleConfig(**schedule)


def test_a_token_file_without_held_out_tokens_is_refused_naming_the_flag(tmp_path: Path) -> None:
    data = DataConfig(path=str(_tokens(tmp_path / "tokens.bin", 40 * 32 + 1)))
    with pytest.raises(ValueError, match=r"no held-out tokens beside data.path = .*--eval-data"):
        JobConfig(data=data, schedule=ScheduleConfig(eval_every=2))


@pytest.mark.parametrize(
    ("count", "message"),
    [
        (None, "no such file"),
        (0, "0 tokens, need at least 33"),
        (10, "10 tokens, need at least 33"),
    ],
)
def test_a_bad_held_out_file_is_named_as_the_held_out_setting(
    tmp_path: Path, count: int | None, message: str
) -> None:
    path = tmp_path / "held.bin"
    if count is not None:
        _tokens(path, count)
    data = DataConfig(heldout=str(path))
    with pytest.raises(ValueError, match=f"^data.heldout = '{path}': {message}"):
        open_heldout(data, vocab_size=128, seq_len=32, windows=8)


def test_an_eval_fault_at_a_step_that_does_not_evaluate_is_refused() -> None:
    with pytest.raises(ValueError, match=r"step 2 does not evaluate \(eval_every = 2"):
        JobConfig(
            schedule=ScheduleConfig(steps=6, eval_every=2),
            injection=InjectionConfig(faults=("kill:1@2:eval",)),
        )


def test_too_few_held_out_windows_are_refused_before_any_worker_starts(tmp_path: Path) -> None:
    heldout = _tokens(tmp_path / "few.bin", 5 * 32 + 1)
    proc = elaswave(
        "train", "--steps", "2", "--global-batch", "8", "--eval-every", "1",
        "--eval-data", str(heldout), "--out", str(tmp_path / "run"),
    )  # fmt: skip
    assert proc.returncode != 0
    assert "5 windows of seq_len 32, an evaluation reads 8" in proc.stderr
    assert "Traceback" not in proc.stderr
