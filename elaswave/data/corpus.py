"""Token sources: a deterministic learnable synthetic corpus, and a user's token file.

Both map a global sample id to one ``seq_len + 1`` window of token ids (inputs and shifted
targets). Sample ids count through epochs; each epoch visits the corpus in a permutation
drawn from (data seed, epoch), so the data a sample id names never depends on the layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

TOKEN_DTYPES = ("uint16", "int32", "int64")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where samples come from."""

    path: str | None = None
    """A pre-tokenised file: a flat numpy memmap of token ids. None: the synthetic corpus."""
    dtype: str = "uint16"
    """Element type of ``path``: one of uint16, int32, int64."""
    num_samples: int = 4096
    """Size of the synthetic corpus, in samples."""
    seed: int = 1234
    """Seed of the synthetic corpus and of the epoch permutations."""
    heldout: str | None = None
    """Held-out tokens for ``--eval-every`` (a token file of ``dtype``). None: beside a
    ``train.bin`` of ``elaswave tokenize``, its ``heldout.bin``; with the synthetic corpus,
    other sequences of the same chain."""

    def __post_init__(self) -> None:
        if self.dtype not in TOKEN_DTYPES:
            raise ValueError(
                f"data.dtype = {self.dtype!r}: valid values are {', '.join(TOKEN_DTYPES)}"
            )
        if self.num_samples < 1:
            raise ValueError(f"data.num_samples = {self.num_samples}: must be at least 1")
        if self.seed < 0:  # numpy's generators take no negative seed
            raise ValueError(f"data.seed = {self.seed}: must be >= 0")


class TokenSource(Protocol):
    def __len__(self) -> int: ...

    def window(self, index: int) -> np.ndarray:
        """Tokens of corpus sample ``index``: ``seq_len + 1`` ids."""
        ...


class SyntheticCorpus:
    """A sparse random Markov chain over the vocabulary: learnable, with a known floor.

    Each token has three possible successors with probabilities 0.7, 0.2 and 0.1, so a
    model that learns the chain reaches about 0.80 nats per token from ln(vocab).
    """

    def __init__(
        self, *, vocab_size: int, seq_len: int, num_samples: int, seed: int, heldout: bool = False
    ) -> None:
        """``heldout``: other sequences of the same chain (a held-out set)."""
        rng = np.random.default_rng(seed)
        successors = rng.integers(0, vocab_size, size=(vocab_size, 3))
        if heldout:
            rng = np.random.default_rng((seed, 1))
        probs = np.array([0.7, 0.2, 0.1])
        tokens = np.empty((num_samples, seq_len + 1), dtype=np.int64)
        tokens[:, 0] = rng.integers(0, vocab_size, size=num_samples)
        choices = rng.choice(3, size=(num_samples, seq_len), p=probs)
        for t in range(seq_len):
            tokens[:, t + 1] = successors[tokens[:, t], choices[:, t]]
        self._tokens = tokens

    def __len__(self) -> int:
        return self._tokens.shape[0]

    def window(self, index: int) -> np.ndarray:
        return self._tokens[index]


class TokenFile:
    """A user's pre-tokenised corpus: a flat file of token ids, read through a memmap."""

    def __init__(
        self,
        path: str | Path,
        *,
        dtype: str,
        seq_len: int,
        vocab_size: int,
        setting: str = "data.path",
    ) -> None:
        """``setting``: the setting that named ``path``, for the errors (data.path, or
        data.heldout for the held-out tokens)."""
        path = Path(path)
        where = f"{setting} = {str(path)!r}"
        if dtype not in TOKEN_DTYPES:
            raise ValueError(f"data.dtype = {dtype!r}: valid values are {', '.join(TOKEN_DTYPES)}")
        if not path.is_file():
            raise ValueError(f"{where}: no such file")
        itemsize = np.dtype(dtype).itemsize
        size = path.stat().st_size
        if size % itemsize:
            raise ValueError(
                f"{where}: {size} bytes is not a whole number of {dtype} tokens; is "
                "data.dtype right?"
            )
        count = size // itemsize
        if count <= seq_len:  # an empty file included: numpy cannot map one
            raise ValueError(
                f"{where}: {count} tokens, need at least {seq_len + 1} for one sample of "
                f"seq_len {seq_len}"
            )
        self._tokens = np.memmap(path, dtype=dtype, mode="r")
        self._seq_len = seq_len
        self._len = (len(self._tokens) - 1) // seq_len
        head = self._tokens[: min(len(self._tokens), 1 << 20)]
        top, bottom = int(head.max()), int(head.min())
        if top >= vocab_size:
            raise ValueError(f"{where}: token id {top} >= model.vocab_size {vocab_size}")
        if bottom < 0:
            raise ValueError(
                f"{where}: token id {bottom} is negative; ids must be in [0, {vocab_size})"
            )

    def __len__(self) -> int:
        return self._len

    def window(self, index: int) -> np.ndarray:
        start = index * self._seq_len
        return np.asarray(self._tokens[start : start + self._seq_len + 1], dtype=np.int64)


def open_source(cfg: DataConfig, *, vocab_size: int, seq_len: int) -> TokenSource:
    if cfg.path is None:
        return SyntheticCorpus(
            vocab_size=vocab_size, seq_len=seq_len, num_samples=cfg.num_samples, seed=cfg.seed
        )
    return TokenFile(cfg.path, dtype=cfg.dtype, seq_len=seq_len, vocab_size=vocab_size)


def heldout_path(cfg: DataConfig) -> str | None:
    """The held-out token file of ``cfg``: ``heldout``, else the ``heldout.bin`` beside a
    ``train.bin`` (``elaswave tokenize``'s pair), else None."""
    if cfg.heldout is not None or cfg.path is None:
        return cfg.heldout
    sibling = Path(cfg.path).with_name("heldout.bin")
    return str(sibling) if Path(cfg.path).name == "train.bin" and sibling.is_file() else None


def open_heldout(cfg: DataConfig, *, vocab_size: int, seq_len: int, windows: int) -> HeldOut:
    """The ``windows`` held-out windows ``--eval-every`` evaluates; ValueError naming what
    is missing."""
    path = heldout_path(cfg)
    source: TokenSource
    if path is not None:
        source = TokenFile(
            path, dtype=cfg.dtype, seq_len=seq_len, vocab_size=vocab_size, setting="data.heldout"
        )
    elif cfg.path is not None:
        raise ValueError(
            f"--eval-every needs held-out tokens beside data.path = {cfg.path!r}: give "
            "--eval-data FILE (data.heldout), e.g. elaswave tokenize's heldout.bin"
        )
    else:
        source = SyntheticCorpus(
            vocab_size=vocab_size, seq_len=seq_len, num_samples=max(windows, 1), seed=cfg.seed,
            heldout=True,
        )  # fmt: skip
    if len(source) < windows:
        raise ValueError(
            f"data.heldout = {path!r}: {len(source)} windows of seq_len {seq_len}, an "
            f"evaluation reads {windows} (eval_batches x global_batch); lower --eval-batches"
        )
    return HeldOut(source)


class HeldOut:
    """Held-out window ``i`` -> (inputs, targets), in the file's order: every evaluation
    reads the same windows, whatever the layout."""

    def __init__(self, source: TokenSource) -> None:
        self._source = source

    def __len__(self) -> int:
        return len(self._source)

    def batch(self, sample_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.from_numpy(np.stack([self._source.window(i) for i in sample_ids]))
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


class SampleLoader:
    """Global sample id -> (inputs, targets); the same ids give the same tensors anywhere."""

    def __init__(self, source: TokenSource, *, seed: int) -> None:
        self._source = source
        self._seed = seed

    def set_source(self, source: TokenSource) -> None:
        """Read samples from ``source`` from now on (a user's dataset, before training)."""
        self._source = source
        self._permutation.cache_clear()

    @lru_cache(maxsize=4)  # noqa: B019 - a loader lives as long as its worker
    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng((self._seed, epoch)).permutation(len(self._source))

    def corpus_index(self, sample_id: int) -> int:
        epoch, offset = divmod(sample_id, len(self._source))
        return int(self._permutation(epoch)[offset])

    def batch(self, sample_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        windows = np.stack([self._source.window(self.corpus_index(s)) for s in sample_ids])
        tokens = torch.from_numpy(windows)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
