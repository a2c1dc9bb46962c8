"""What ElasWave needs of a model: an ordered list of pipeline-placeable layers, a loss,
and a batch format.

* **Layers.** Global layer ``i`` of ``num_layers`` is built by ``build_layer(i, seed=)``
  with the same parameters whichever stage builds it (a rank that takes over a stage,
  a snapshot holder that rebuilds an owner's initial state, a joiner). Every layer's
  ``forward(x, ctx)`` takes the previous layer's output and the micro-batch's
  :class:`~elaswave.model.llama.StepContext` (step, global sample ids, the counter-based
  dropout streams); layer 0 takes token ids ``[batch, seq_len]``, the last returns
  logits ``[batch, seq_len, vocab_size]``.
* **Loss.** ``per_sample_loss(logits, targets)``: the mean token cross-entropy of each
  sample. The pipeline sums it over the global batch, so any layout computes the same
  loss.
* **Batch format.** Token ids of ``seq_len`` tokens and next-token targets, addressed
  by global sample id (:mod:`elaswave.data`).
* **Shape.** ``config`` (:class:`~elaswave.model.config.ModelConfig`) gives the cost
  model its dimensions; ``decay_flags(i)`` lists layer ``i``'s parameters in
  registration order (elements, takes weight decay), which the optimizer's shard
  layouts are built from.
* **Tensor parallelism**: ``build_layer(i, seed=, tp=)`` builds member ``tp.rank``'s
  piece of layer ``i`` (:mod:`elaswave.model.tensor_parallel`), ``decay_flags(i, tp)``
  lists a piece's parameters.
* **bf16.** The forward runs under torch autocast; ``backward_autocast``: the backward
  runs under it too, for layers whose own autograd functions expect the forward's
  autocast state back in their backward (megatron's linears restore it themselves on
  CUDA only).

:func:`pipeline_model` returns the implementation for a model config, once per process:
ElasWave's built-in decoder (:mod:`elaswave.model.llama`), a Hugging Face causal LM
(:mod:`elaswave.model.hf`) or megatron-core's GPT pieces (:mod:`elaswave.model.megatron`).
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch

from elaswave.model import llama
from elaswave.model.config import ModelConfig
from elaswave.model.tensor_parallel import NO_TP, TpShard


class PipelineModel(Protocol):
    config: ModelConfig
    dropout_sites: tuple[str, ...]
    """Where dropout draws from ElasWave's counter-based streams (the same masks under
    any layout); sites not listed have none, or are refused at load."""
    backward_autocast: bool
    """Whether the backward runs under the forward's autocast (bf16)."""

    def build_layer(self, index: int, *, seed: int, tp: TpShard = NO_TP) -> llama.PipelineLayer: ...

    def decay_flags(self, index: int, tp: int = 1) -> tuple[tuple[int, bool], ...]: ...

    def per_sample_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor: ...


class BuiltinModel:
    """ElasWave's Llama-style decoder (:mod:`elaswave.model.llama`)."""

    backward_autocast = False

    dropout_sites: tuple[str, ...] = (
        "embedding output",
        "attention output (before the residual add)",
        "MLP output (before the residual add)",
    )

    def __init__(self, config: ModelConfig) -> None:
        self.config = config

    def build_layer(self, index: int, *, seed: int, tp: TpShard = NO_TP) -> llama.PipelineLayer:
        return llama.build_layer(self.config, index, seed=seed, tp=tp)

    def decay_flags(self, index: int, tp: int = 1) -> tuple[tuple[int, bool], ...]:
        return llama.layer_decay_flags(self.config, index, tp)

    def per_sample_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return llama.per_sample_loss(logits, targets)


@functools.cache
def pipeline_model(config: ModelConfig) -> PipelineModel:
    """The implementation of ``config``'s model (cached per process: a Hugging Face
    model reads its directory once)."""
    if config.source.startswith("hf:"):
        from elaswave.model.hf import HfModel  # imports transformers: only when asked for

        return HfModel(config)
    if config.source.startswith("megatron:"):
        from elaswave.model.megatron import MegatronModel  # imports megatron-core

        return MegatronModel(config)
    return BuiltinModel(config)
