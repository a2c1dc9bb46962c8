"""``elaswave tokenize TEXT_DIR OUT_DIR``: text files into the token files ``--data``
reads, with a Hugging Face ``tokenizers`` tokenizer, and a held-out split.

The files under TEXT_DIR matching ``--glob`` and none of the ``--exclude`` patterns (on
their path below TEXT_DIR) are read in sorted order, each a document.
With ``--tokenizer FILE`` (a ``tokenizer.json``) they are encoded with it; otherwise a
byte-level BPE of ``--vocab`` tokens is trained on them once and written to
OUT_DIR/tokenizer.json. Documents are split by a hash of their path (the same split on
every machine and every run): about ``--held-out`` of them go to OUT_DIR/heldout.bin,
the rest to OUT_DIR/train.bin, each a flat memory-mapped array of token ids (uint16
when the vocabulary fits, int32 otherwise), every document followed by the end-of-text
token. OUT_DIR/tokens.json records the counts, the dtype and the held-out tokens'
cross-entropy under the training split's unigram frequencies: the loss a model that
ignores context gets, the baseline a trained model's held-out loss should fall below.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

END = "<|endoftext|>"
"""The token every document ends with (a trained tokenizer's first special token)."""


@dataclass(frozen=True)
class TokenFiles:
    """What OUT_DIR/tokens.json records."""

    vocab_size: int
    dtype: str
    documents: int
    train_tokens: int
    heldout_documents: int
    heldout_tokens: int
    unigram_heldout_loss: float
    """Held-out cross-entropy (nats per token) under the training split's unigram
    frequencies (add-one smoothed)."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tokenize",
        help="turn a directory of text files into token files for --data",
        description="Encode TEXT_DIR's files (--glob) with a tokenizers tokenizer (given, or "
        "a byte-level BPE trained on them) into OUT_DIR/train.bin and OUT_DIR/heldout.bin "
        "(memory-mapped token ids; --data OUT_DIR/train.bin --data-dtype as tokens.json "
        "says), OUT_DIR/tokenizer.json and OUT_DIR/tokens.json.",
    )
    p.add_argument("text_dir", type=Path)
    p.add_argument("out_dir", type=Path)
    p.add_argument("--glob", default="**/*", help="which files are text (default every file)")
    p.add_argument(
        "--exclude", action="append", default=[],
        help="leave out files whose path below TEXT_DIR matches this pattern (repeatable; "
        "e.g. 'site-packages/*')",
    )  # fmt: skip
    p.add_argument("--tokenizer", type=Path, help="a tokenizer.json to use (default: train one)")
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary of a trained BPE")
    p.add_argument("--held-out", type=float, default=0.02, help="share of documents held out")


def run(args: argparse.Namespace) -> int:
    files = tokenize(
        args.text_dir, args.out_dir, glob=args.glob, exclude=tuple(args.exclude),
        tokenizer=args.tokenizer,
        vocab=args.vocab, held_out=args.held_out,
    )  # fmt: skip
    print(
        f"elaswave: {files.documents} documents, {files.train_tokens} training and "
        f"{files.heldout_tokens} held-out tokens ({files.dtype}, vocabulary "
        f"{files.vocab_size}); unigram held-out loss {files.unigram_heldout_loss:.4f}; "
        f"train with --data {args.out_dir / 'train.bin'} --data-dtype {files.dtype}"
    )
    return 0


def tokenize(
    text_dir: Path,
    out_dir: Path,
    *,
    glob: str = "**/*",
    exclude: tuple[str, ...] = (),
    tokenizer: Path | None = None,
    vocab: int = 4096,
    held_out: float = 0.02,
) -> TokenFiles:
    """Write OUT_DIR's token files; ValueError naming a bad input."""
    if not text_dir.is_dir():
        raise ValueError(f"{str(text_dir)!r} is not a directory of text files")
    if not 0.0 < held_out < 1.0:
        raise ValueError(f"--held-out {held_out}: must be in (0, 1)")
    if tokenizer is None and not 256 < vocab <= 1 << 20:
        raise ValueError(f"--vocab {vocab}: must be in (256, {1 << 20}]")
    try:
        found = [p for p in text_dir.glob(glob) if p.is_file()]
    except (ValueError, NotImplementedError) as exc:  # pathlib refuses '', 'a**', '/abs'
        raise ValueError(
            f"--glob {glob!r}: {exc}; give a pattern relative to TEXT_DIR such as '**/*.txt'"
        ) from None
    paths = sorted(
        p
        for p in found
        if not any(fnmatch.fnmatch(str(p.relative_to(text_dir)), x) for x in exclude)
    )
    if not paths:
        left = f" after --exclude {', '.join(map(repr, exclude))}" if found else ""
        raise ValueError(f"no files under {str(text_dir)!r} match {glob!r}{left}")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ValueError(f"OUT_DIR {str(out_dir)!r}: a file is in the way of a directory") from None
    tok = _tokenizer(paths, tokenizer, vocab)
    tok.save(str(out_dir / "tokenizer.json"))
    end = tok.token_to_id(END)
    if end is None:
        raise ValueError(f"the tokenizer has no {END!r} token to end documents with")
    size = tok.get_vocab_size()
    dtype = np.uint16 if size <= 1 << 16 else np.int32
    held = [_held_out(p, text_dir, held_out) for p in paths]
    counts = {}
    for split, wanted in (("train", False), ("heldout", True)):
        chosen = [p for p, h in zip(paths, held, strict=True) if h == wanted]
        counts[split] = _write(out_dir / f"{split}.bin", _encoded(tok, chosen, end), dtype)
    if not counts["heldout"][0] or not counts["train"][0]:
        raise ValueError(
            f"{len(paths)} documents leave a split empty at --held-out {held_out}; "
            "give more documents or another share"
        )
    files = TokenFiles(
        vocab_size=size,
        dtype=np.dtype(dtype).name,
        documents=len(paths),
        train_tokens=counts["train"][0],
        heldout_documents=sum(held),
        heldout_tokens=counts["heldout"][0],
        unigram_heldout_loss=_unigram_loss(out_dir, dtype, size),
    )
    (out_dir / "tokens.json").write_text(json.dumps(asdict(files), indent=2) + "\n")
    return files


def _tokenizer(paths: list[Path], given: Path | None, vocab: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if given is not None:
        try:
            return Tokenizer.from_file(str(given))
        except Exception as exc:  # tokenizers raises its own kinds
            raise ValueError(f"--tokenizer {str(given)!r} is not a tokenizer.json: {exc}") from None
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((_text(p) for p in paths), trainer=trainer, length=len(paths))
    return tok


def _text(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def _held_out(path: Path, root: Path, share: float) -> bool:
    digest = hashlib.sha256(str(path.relative_to(root)).encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < share


def _encoded(tok: Any, paths: list[Path], end: int) -> Iterator[list[int]]:
    for start in range(0, len(paths), 256):
        batch = [_text(p) for p in paths[start : start + 256]]
        for encoding in tok.encode_batch(batch):
            yield [*encoding.ids, end]


def _write(path: Path, documents: Iterator[list[int]], dtype: type) -> tuple[int, int]:
    """Append every document's ids to ``path``; (tokens, documents) written."""
    tokens = docs = 0
    with path.open("wb") as f:
        for ids in documents:
            f.write(np.asarray(ids, dtype=dtype).tobytes())
            tokens += len(ids)
            docs += 1
    return tokens, docs


def _unigram_loss(out_dir: Path, dtype: type, size: int) -> float:
    train = np.memmap(out_dir / "train.bin", dtype=dtype, mode="r")
    heldout = np.memmap(out_dir / "heldout.bin", dtype=dtype, mode="r")
    counts = np.bincount(train, minlength=size).astype(np.float64) + 1.0
    log_p = np.log(counts / counts.sum())
    return float(-log_p[heldout].mean()) if len(heldout) else math.nan
