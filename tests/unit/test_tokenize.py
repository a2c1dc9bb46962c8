"""``elaswave tokenize``: text files into memory-mapped token files and a held-out split
that the same inputs always give, with a trained byte-level BPE or a given tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from elaswave.cli.tokenize import END, tokenize
from elaswave.data.corpus import DataConfig


def _texts(root: Path, count: int = 40) -> Path:
    root.mkdir()
    for i in range(count):
        body = "".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}\n\n" for j in range(20))
        (root / f"m{i:02d}.py").write_text(body)
    (root / "notes.txt").write_text("not python\n")
    (root / "vendored").mkdir()
    (root / "vendored" / "other.py").write_text("left out\n")
    return root


def test_text_files_become_token_files_with_a_held_out_split(tmp_path):
    texts = _texts(tmp_path / "texts")
    out = tmp_path / "tokens"
    files = tokenize(texts, out, glob="**/*.py", exclude=("vendored/*",), vocab=300, held_out=0.2)
    assert files.documents == 40 and 0 < files.heldout_documents < 40
    assert files.dtype == "uint16" and files.vocab_size == 300
    record = json.loads((out / "tokens.json").read_text())
    assert record["train_tokens"] == files.train_tokens
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    end = tok.token_to_id(END)
    train = np.memmap(out / "train.bin", dtype=np.uint16, mode="r")
    held = np.memmap(out / "heldout.bin", dtype=np.uint16, mode="r")
    assert len(train) == files.train_tokens and len(held) == files.heldout_tokens
    assert int((train == end).sum()) == 40 - files.heldout_documents  # one end per document
    first = train[: int(np.argmax(train == end))].tolist()
    originals = {p.read_text() for p in texts.glob("*.py")}
    assert tok.decode(first) in originals  # ids decode back to a document, byte for byte
    assert 0 < files.unigram_heldout_loss < np.log(300)
    assert DataConfig(path=str(out / "train.bin"), dtype=files.dtype).dtype == "uint16"
    given = out / "tokenizer.json"
    again = tokenize(
        texts,
        tmp_path / "again",
        glob="**/*.py",
        exclude=("vendored/*",),
        tokenizer=given,
        held_out=0.2,
    )
    assert again == files  # the same split and ids from the same inputs
    assert (tmp_path / "again" / "train.bin").read_bytes() == (out / "train.bin").read_bytes()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"glob": "*.rs"}, "no files under"),
        ({"held_out": 1.5}, "--held-out 1.5: must be in"),
        ({"vocab": 100}, "--vocab 100: must be in"),
        ({"tokenizer": Path("/nonexistent.json")}, "is not a tokenizer.json"),
        ({"glob": "/etc/*"}, r"--glob '/etc/\*': Non-relative patterns are unsupported; give"),
        ({"glob": "**a"}, r"--glob '\*\*a': Invalid pattern"),
        ({"exclude": ("*",)}, r"no files under .* match '\*.py' after --exclude '\*'"),
    ],
)
def test_bad_input_is_refused_naming_it(tmp_path, kwargs, message):
    texts = _texts(tmp_path / "texts", count=3)
    with pytest.raises(ValueError, match=message):
        tokenize(texts, tmp_path / "out", **{"glob": "*.py", **kwargs})


@pytest.mark.parametrize("out", ["file", "file/below"])
def test_an_out_dir_a_file_blocks_is_refused_naming_it(tmp_path, out):
    texts = _texts(tmp_path / "texts", count=3)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"OUT_DIR '.*/file.*': a file is in the way"):
        tokenize(texts, tmp_path / out, glob="*.py")
