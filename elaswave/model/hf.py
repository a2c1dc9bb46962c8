"""Hugging Face decoder-only causal LMs as ElasWave pipeline models (Llama, Mistral,
Qwen2).

A model is a local directory: ``config.json`` (as ``save_pretrained`` writes it) and,
optionally, its weights as ``*.safetensors`` (one file, or shards with
``model.safetensors.index.json``). Nothing is ever downloaded. The model splits into
ElasWave's layer list: layer 0 is the token embedding, layers 1..N the model's own
decoder layers (each with the model's rotary embedding, computed in the layer), layer
N+1 the final norm and LM head. Without weights, each layer is initialised as the
model's ``_init_weights`` does (normal(0, initializer_range) matrices, zero biases,
unit norms) from its own (seed, layer) stream, so parameters do not depend on which
stage builds them; with weights, each rank reads only its layers' tensors.

Dropout: these families have none but the attention kernel's ``attention_dropout``,
which draws from torch's global generator and so would differ between layouts; a
config with ``attention_dropout > 0`` is refused (:data:`HfModel.dropout_sites` is
empty). Tied input and output embeddings are refused too: the embedding and the head
live on different stages.

:func:`hf_shape` reads the config into a :class:`~elaswave.model.config.ModelConfig`
(the cost model's dimensions); :class:`HfModel` builds the layers;
:func:`to_hf_state_dict` names trained layers' parameters as the Hugging Face model
does, so ``from_pretrained`` can load them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from elaswave.model.config import ModelConfig
from elaswave.model.llama import PipelineLayer, StepContext
from elaswave.model.llama import per_sample_loss as _per_sample_loss
from elaswave.model.rng import stream_key
from elaswave.model.tensor_parallel import NO_TP, TpShard, refuse_tp

FAMILIES = ("llama", "mistral", "qwen2")
"""``model_type`` values whose layers ElasWave splits and prices (Llama-style blocks)."""


def _directory(source: str) -> Path:
    if not source.startswith("hf:"):
        raise ValueError(f"model.source = {source!r} is not a Hugging Face model (hf:DIR)")
    return Path(source[3:])


def load_hf_config(directory: Path) -> Any:
    """The model's transformers config from ``directory/config.json`` (never a
    download), set to run attention through SDPA (causal without a mask)."""
    path = directory / "config.json"
    if not path.is_file():
        raise ValueError(
            f"model directory {str(directory)!r} has no config.json: give a directory "
            "that save_pretrained wrote (config.json, optionally *.safetensors)"
        )
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is not a readable JSON file: {exc}") from None
    kind = raw.get("model_type") if isinstance(raw, dict) else None
    if kind not in FAMILIES:
        raise ValueError(
            f"{path}: model_type = {kind!r} is not supported; supported: {', '.join(FAMILIES)}"
        )
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:  # transformers raises many kinds for a bad config
        raise ValueError(f"{path} is not a valid {kind} config: {exc}") from None
    cfg._attn_implementation = "sdpa"
    return cfg


def _rope_theta(cfg: Any) -> float:
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, Mapping) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(getattr(cfg, "rope_theta", 10000.0))


def hf_shape(source: str, *, seq_len: int) -> ModelConfig:
    """The cost model's :class:`ModelConfig` of the model at ``source`` (``hf:DIR``),
    trained on samples of ``seq_len`` tokens; refuses what ElasWave cannot split or
    keep layout-invariant, naming the value."""
    directory = _directory(source)
    cfg = load_hf_config(directory)
    where = f"{directory / 'config.json'}"

    def refuse(what: str, why: str) -> None:
        raise ValueError(f"{where}: {what}: {why}")

    if getattr(cfg, "tie_word_embeddings", False):
        refuse(
            "tie_word_embeddings = true",
            "the embedding and the LM head sit on different pipeline stages; "
            "untie them (tie_word_embeddings = false)",
        )
    if float(getattr(cfg, "attention_dropout", 0.0) or 0.0) > 0.0:
        refuse(
            f"attention_dropout = {cfg.attention_dropout}",
            "the attention kernel draws dropout from torch's global generator, which "
            "ElasWave cannot keep the same across layouts; set it to 0",
        )
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(cfg, flag, False):
            refuse(f"{flag} = true", "not supported (the cost model counts no such biases)")
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        refuse(f"hidden_act = {act!r}", "only the SwiGLU MLP of these families ('silu')")
    heads = int(cfg.num_attention_heads)
    head_dim = getattr(cfg, "head_dim", None)
    if head_dim is not None and int(head_dim) * heads != int(cfg.hidden_size):
        refuse(
            f"head_dim = {head_dim}",
            f"must be hidden_size / num_attention_heads = {cfg.hidden_size // heads}",
        )
    window = getattr(cfg, "sliding_window", None)
    uses_window = getattr(cfg, "use_sliding_window", cfg.model_type == "mistral")
    if uses_window and window is not None and seq_len > int(window):
        refuse(
            f"sliding_window = {window}",
            f"samples of seq_len = {seq_len} tokens would need the sliding-window mask; "
            f"use seq_len <= {window}",
        )
    limit = getattr(cfg, "max_position_embeddings", None)
    if limit is not None and seq_len > int(limit):
        refuse(f"max_position_embeddings = {limit}", f"seq_len = {seq_len} is longer")
    return ModelConfig(
        vocab_size=int(cfg.vocab_size),
        hidden_size=int(cfg.hidden_size),
        num_blocks=int(cfg.num_hidden_layers),
        num_heads=heads,
        num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
        ffn_hidden_size=int(cfg.intermediate_size),
        seq_len=seq_len,
        dropout=0.0,
        rope_theta=_rope_theta(cfg),
        norm_eps=float(cfg.rms_norm_eps),
        init_std=float(cfg.initializer_range),
        qkv_bias=cfg.model_type == "qwen2",
        source=source,
    )


class HfEmbedding(PipelineLayer):
    def __init__(self, index: int, cfg: Any) -> None:
        super().__init__(index)
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, padding_idx=getattr(cfg, "pad_token_id", None)
        )

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        return self.embed_tokens(x)


class HfDecoder(PipelineLayer):
    """One of the model's decoder layers, with the rotary embedding it is given."""

    def __init__(self, index: int, layer: nn.Module, rotary: nn.Module) -> None:
        super().__init__(index)
        self.layer = layer
        self.rotary = rotary
        self._rope: tuple[tuple, torch.Tensor, Any] | None = None
        """Positions and rotary tables of the last micro-batch shape (they depend on
        nothing else): computed once, not at every micro-batch."""

    def _positions(self, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        key = (x.shape[:2], x.dtype, x.device)
        if self._rope is None or self._rope[0] != key:
            b, s = x.shape[:2]
            positions = torch.arange(s, device=x.device).unsqueeze(0).expand(b, -1)
            with torch.no_grad():
                self._rope = (key, positions, self.rotary(x, positions))
        return self._rope[1], self._rope[2]

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        positions, rope = self._positions(x)
        out = self.layer(x, attention_mask=None, position_ids=positions, position_embeddings=rope)
        return out[0] if isinstance(out, tuple) else out


class HfHead(PipelineLayer):
    def __init__(self, index: int, norm: nn.Module, cfg: Any) -> None:
        super().__init__(index)
        self.norm = norm
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        return self.lm_head(self.norm(x))


def _hf_prefix(index: int, num_layers: int) -> dict[str, str]:
    """ElasWave's parameter-name prefix of layer ``index`` -> the Hugging Face one."""
    if index == 0:
        return {"embed_tokens.": "model.embed_tokens."}
    if index == num_layers - 1:
        return {"norm.": "model.norm.", "lm_head.": "lm_head."}
    return {"layer.": f"model.layers.{index - 1}."}


def _hf_name(name: str, index: int, num_layers: int) -> str:
    for ours, theirs in _hf_prefix(index, num_layers).items():
        if name.startswith(ours):
            return theirs + name[len(ours) :]
    raise KeyError(f"layer {index} has no parameter named {name!r}")


def to_hf_state_dict(
    layers: Mapping[int, Mapping[str, torch.Tensor]], num_layers: int
) -> dict[str, torch.Tensor]:
    """``{layer index: {parameter name: tensor}}`` (what a run saves per stage) named as
    the Hugging Face model names them."""
    return {
        _hf_name(name, index, num_layers): tensor
        for index, params in layers.items()
        for name, tensor in params.items()
    }


def _weight_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it ({} when the directory has none)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{index} is not a safetensors index: {exc}") from None
        return {name: directory / file for name, file in weight_map.items()}
    from safetensors import safe_open

    out: dict[str, Path] = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out.update(dict.fromkeys(f.keys(), path))
    return out


class HfModel:
    """A Hugging Face causal LM split into ElasWave's pipeline layers."""

    dropout_sites: tuple[str, ...] = ()

    def __init__(self, config: ModelConfig) -> None:
        directory = _directory(config.source)
        shape = hf_shape(config.source, seq_len=config.seq_len)
        if shape != config:
            raise ValueError(
                f"{directory / 'config.json'} no longer describes this job's model "
                f"(it gives {shape}, the job was planned for {config})"
            )
        self.config = config
        self.directory = directory
        self.hf_config = load_hf_config(directory)
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(self.hf_config)
        inner = skeleton.model
        self._layer_cls = type(inner.layers[0])
        self._norm_cls = type(inner.norm)
        self._rotary_cls = type(inner.rotary_emb)
        self._weights = _weight_files(directory)
        self._flags: dict[int, tuple[tuple[int, bool], ...]] = {}

    def _new(self, index: int) -> PipelineLayer:
        cfg, last = self.hf_config, self.config.num_layers - 1
        if not 0 <= index <= last:
            raise ValueError(f"layer index {index} out of range [0, {last + 1})")
        if index == 0:
            return HfEmbedding(index, cfg)
        if index == last:
            return HfHead(index, self._norm_cls(cfg.hidden_size, eps=cfg.rms_norm_eps), cfg)
        return HfDecoder(index, self._layer_cls(cfg, layer_idx=index - 1), self._rotary_cls(cfg))

    def build_layer(self, index: int, *, seed: int, tp: TpShard = NO_TP) -> PipelineLayer:
        refuse_tp(tp, self.config)
        layer = self._new(index)
        if self._weights:
            self._load(layer, index)
        else:
            self._initialise(layer, index, seed)
        return layer

    def _initialise(self, layer: PipelineLayer, index: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(stream_key(seed, 0x1A7E5, index) & ((1 << 63) - 1))
        with torch.no_grad():
            for name, param in layer.named_parameters():
                if param.dim() >= 2:
                    param.normal_(0.0, self.config.init_std, generator=gen)
                elif name.endswith("bias"):
                    param.zero_()
                else:
                    param.fill_(1.0)
            if isinstance(layer, HfEmbedding) and layer.embed_tokens.padding_idx is not None:
                layer.embed_tokens.weight[layer.embed_tokens.padding_idx].zero_()

    def _load(self, layer: PipelineLayer, index: int) -> None:
        from safetensors import safe_open

        wanted = {
            name: _hf_name(name, index, self.config.num_layers)
            for name, _ in layer.named_parameters()
        }
        missing = [hf for hf in wanted.values() if hf not in self._weights]
        if missing:
            raise ValueError(
                f"{self.directory}: the safetensors files lack {', '.join(missing[:3])}"
                + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            )
        state: dict[str, torch.Tensor] = {}
        for name, hf in wanted.items():
            with safe_open(str(self._weights[hf]), framework="pt") as f:
                state[name] = f.get_tensor(hf).float()
        try:
            layer.load_state_dict(state)
        except RuntimeError as exc:
            raise ValueError(
                f"{self.directory}: layer {index}'s weights do not fit: {exc}"
            ) from None

    def decay_flags(self, index: int, tp: int = 1) -> tuple[tuple[int, bool], ...]:
        refuse_tp(TpShard(0, tp), self.config)
        if index not in self._flags:
            with torch.device("meta"):
                layer = self._new(index)
            self._flags[index] = tuple((p.numel(), p.dim() >= 2) for p in layer.parameters())
        return self._flags[index]

    def per_sample_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return _per_sample_loss(logits, targets)
