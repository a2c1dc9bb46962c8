"""A small synthetic dataset for the examples: the same in every process, learnable."""

from __future__ import annotations

import numpy as np


class CountingCorpus:
    """Windows of ``seq_len + 1`` tokens counting up from a start with a stride, modulo
    the vocabulary: learnable, and the same in every process."""

    def __init__(self, size: int, seq_len: int, vocab: int) -> None:
        rng = np.random.default_rng(1234)
        self.starts = rng.integers(0, vocab, size)
        self.strides = rng.integers(1, 4, size)
        self.seq_len, self.vocab = seq_len, vocab

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> np.ndarray:
        steps = np.arange(self.seq_len + 1) * self.strides[i]
        return (self.starts[i] + steps) % self.vocab
