"""Model shapes: a tiny default that trains in seconds on CPU, and Llama 2 shapes.

The Llama 2 shapes feed the cost model and the simulator; they are never instantiated here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A Llama-style decoder: embedding, ``num_blocks`` transformer blocks, norm + LM head."""

    vocab_size: int = 128
    """Number of token ids."""
    hidden_size: int = 64
    """Width of the residual stream."""
    num_blocks: int = 4
    """Transformer blocks (RMSNorm, rotary causal self-attention, SwiGLU MLP)."""
    num_heads: int = 4
    """Attention query heads."""
    num_kv_heads: int = 4
    """Key/value heads (grouped-query attention when fewer than ``num_heads``)."""
    ffn_hidden_size: int = 160
    """Inner width of the SwiGLU MLP."""
    seq_len: int = 32
    """Tokens per sample."""
    dropout: float = 0.1
    """Hidden dropout after the embedding, the attention output and the MLP output."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of weight matrices."""
    qkv_bias: bool = False
    """The query, key and value projections have biases (Qwen2)."""
    head_size: int = 0
    """Width of one attention head; 0: ``hidden_size / num_heads``."""
    block_params: int = 0
    """Parameters of one block as a Hugging Face model defines it (projections of any
    width, biases, norms inside attention, fused projections), counted from its
    modules; 0: counted from the fields above (the built-in block)."""
    block_whole: int = 0
    """Parameters of one block kept whole on every tensor-parallel member (norm gains,
    norms inside attention); 0: the two norms' (``2 * hidden_size``)."""
    expert_ffn_size: int = 0
    """Inner width of one routed expert's MLP (a mixture of experts: what tensor
    parallelism splits each expert's gate and up rows by); 0: none."""
    head_params: int = 0
    """Parameters of the head (the final norm and the LM head) where the model's are not
    ``hidden_size + hidden_size * vocab_size`` (a final layer norm with a bias); 0:
    those."""
    layer_params: tuple[int, ...] = ()
    """Parameters of each block where the blocks differ (a Hugging Face model mixing
    dense and mixture-of-experts layers, counted from its modules); empty: every block
    has :meth:`block_param_count`."""
    layer_whole: tuple[int, ...] = ()
    """Parameters of each block kept whole on every tensor-parallel member, where the
    blocks differ in them (dense and expert blocks mixed: an expert block's router is
    whole); empty: every block has :attr:`block_whole`'s."""
    active_params: tuple[int, ...] = ()
    """Parameters each token passes through in each block, where that is fewer than the
    block's (a mixture of experts routes a token through ``top_k`` of its experts): what
    the block's compute is priced from; empty: all of them."""
    tie_embeddings: bool = False
    """The LM head's weight is the token embedding's (a Hugging Face model's
    ``tie_word_embeddings``; :mod:`elaswave.fabric.tied`)."""
    source: str = ""
    """Where the layers come from: "" for ElasWave's built-in decoder, or
    ``hf:DIR`` for a Hugging Face decoder-only causal LM described by
    DIR/config.json, with its weights from DIR's safetensors files when there are any
    (:mod:`elaswave.model.hf`), or ``megatron:FILE`` for megatron-core's GPT pieces
    (:mod:`elaswave.model.megatron`); the shape fields above then mirror that model."""

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_blocks",
            "num_heads",
            "num_kv_heads",
            "ffn_hidden_size",
            "seq_len",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model.{name} = {value!r}: must be a positive integer")
        sizes = (self.head_size, self.block_params, self.block_whole, self.head_params)
        if min(*sizes, self.expert_ffn_size) < 0:
            raise ValueError(
                "model.head_size, block_params, block_whole, head_params and "
                "expert_ffn_size must be >= 0"
            )
        self._check_per_block()
        if not self.head_size and self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.hidden_size = {self.hidden_size} is not divisible by "
                f"model.num_heads = {self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.num_heads = {self.num_heads} is not a multiple of "
                f"model.num_kv_heads = {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head size {self.head_dim} must be even for rotary embedding")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout = {self.dropout!r}: must be in [0, 1)")
        if self.tie_embeddings and not self.source.startswith("hf:"):
            raise ValueError(
                "model.tie_embeddings = true: only for Hugging Face models (hf:DIR), whose "
                "config says tie_word_embeddings"
            )
        kinds = ("hf:", "megatron:")
        if self.source and not any(
            self.source.startswith(k) and len(self.source) > len(k) for k in kinds
        ):
            raise ValueError(
                f"model.source = {self.source!r}: must be empty (the built-in model), "
                "hf:DIR (a Hugging Face model directory) or megatron:FILE (a megatron-core "
                "GPT's shape as JSON)"
            )

    def _check_per_block(self) -> None:
        """:attr:`layer_params`, :attr:`layer_whole` and :attr:`active_params`: tuples
        (from JSON's lists) of one positive count per block, none active beyond its
        block's."""
        for name in ("layer_params", "layer_whole", "active_params"):
            value = getattr(self, name)
            if not isinstance(value, list | tuple) or not all(
                isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in value
            ):
                raise ValueError(f"model.{name} = {value!r}: must be a list of positive integers")
            if value and len(value) != self.num_blocks:
                raise ValueError(
                    f"model.{name} has {len(value)} entries: one per block "
                    f"(model.num_blocks = {self.num_blocks}), or none"
                )
            object.__setattr__(self, name, tuple(value))
        over = [b for b in range(self.num_blocks) if self.block_active(b) > self.block_params_of(b)]
        if over:
            raise ValueError(
                f"model.active_params: block {over[0]} passes a token through "
                f"{self.block_active(over[0])} parameters, more than its "
                f"{self.block_params_of(over[0])}"
            )

    def block_params_of(self, block: int) -> int:
        """Parameters of block ``block`` (0-based among the blocks)."""
        return self.layer_params[block] if self.layer_params else self.block_param_count()

    def block_whole_of(self, block: int) -> int:
        """Parameters of block ``block`` (0-based) kept whole on every tensor-parallel
        member."""
        if self.layer_whole:
            return self.layer_whole[block]
        return self.block_whole or 2 * self.hidden_size

    def block_active(self, block: int) -> int:
        """Parameters a token passes through in block ``block`` (0-based)."""
        return self.active_params[block] if self.active_params else self.block_params_of(block)

    @property
    def num_layers(self) -> int:
        """Pipeline-placeable layers: embedding + blocks + head."""
        return self.num_blocks + 2

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden_size // self.num_heads

    def block_param_count(self) -> int:
        """Parameters of one block (:attr:`block_params` where the model gave them)."""
        if self.block_params:
            return self.block_params
        h, f = self.hidden_size, self.ffn_hidden_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = (q + 2 * kv) if self.qkv_bias else 0
        return 2 * h + 2 * h * q + 2 * h * kv + 3 * h * f + bias

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


TINY = ModelConfig()
LLAMA2_7B = ModelConfig(
    vocab_size=32000,
    hidden_size=4096,
    num_blocks=32,
    num_heads=32,
    num_kv_heads=32,
    ffn_hidden_size=11008,
    seq_len=4096,
    dropout=0.0,
)
LLAMA2_13B = ModelConfig(
    vocab_size=32000,
    hidden_size=5120,
    num_blocks=40,
    num_heads=40,
    num_kv_heads=40,
    ffn_hidden_size=13824,
    seq_len=4096,
    dropout=0.0,
)
LLAMA2_34B = ModelConfig(
    vocab_size=32000,
    hidden_size=8192,
    num_blocks=48,
    num_heads=64,
    num_kv_heads=8,
    ffn_hidden_size=22016,
    seq_len=4096,
    dropout=0.0,
)

MIXTRAL_WIDTH = 14336
"""Mixtral 8x7B's expert width; its blocks: 8 experts, 2 a token."""
MIXTRAL_8X7B = ModelConfig(
    vocab_size=32000,
    hidden_size=4096,
    num_blocks=32,
    num_heads=32,
    num_kv_heads=8,
    ffn_hidden_size=2 * MIXTRAL_WIDTH,  # a token's two experts
    seq_len=4096,
    dropout=0.0,
    rope_theta=1e6,
    # attention 41,943,040 + router 32,768 + norms 8,192, and 8 (or 2) experts of
    # 3 x 4096 x 14336: 46.7B parameters in all, 12.9B a token passes through
    block_params=41_943_040 + 32_768 + 8_192 + 8 * 3 * 4096 * MIXTRAL_WIDTH,
    active_params=(41_943_040 + 32_768 + 8_192 + 2 * 3 * 4096 * MIXTRAL_WIDTH,) * 32,
    block_whole=32_768 + 8_192,  # the router and the norms, whole on every TP member
    expert_ffn_size=MIXTRAL_WIDTH,
)
PRESETS: dict[str, ModelConfig] = {
    "tiny": TINY,
    "llama2-7b": LLAMA2_7B,
    "llama2-13b": LLAMA2_13B,
    "llama2-34b": LLAMA2_34B,
    "mixtral-8x7b": MIXTRAL_8X7B,
}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown model preset {name!r}; valid presets: {', '.join(PRESETS)}"
        ) from None


def parameter_count(cfg: ModelConfig) -> int:
    """Parameters of the whole model, computed from shapes (no allocation): each
    block's as the model has them (:meth:`ModelConfig.block_params_of`), its head's."""
    h, v = cfg.hidden_size, cfg.vocab_size
    blocks = sum(cfg.block_params_of(b) for b in range(cfg.num_blocks))
    return v * h + blocks + (cfg.head_params or h + h * v)


class RngKind(enum.StrEnum):
    """Where dropout's randomness comes from (``--rng``)."""

    COUNTER = "counter"
    """Keyed by sample and layer: the same on every layout."""
    STATEFUL = "stateful"
    """One generator per rank, drawn in execution order: the baseline."""


RNG_KINDS = tuple(k.value for k in RngKind)
