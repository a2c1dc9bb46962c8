"""Hugging Face decoder-only causal LMs as ElasWave pipeline models, recognised by
structure: any transformers causal LM laid out as ``model.embed_tokens``,
``model.layers[i]``, ``model.norm``, ``lm_head`` with the model's ``rotary_emb``
(tested: Llama, Mistral, Qwen2, Qwen3, Gemma, Phi-3, OLMo-2, Granite, SmolLM3).

A model is a local directory: ``config.json`` (as ``save_pretrained`` writes it) and,
optionally, its weights as ``*.safetensors`` (one file, or shards with
``model.safetensors.index.json``). Nothing is ever downloaded. The model splits into
ElasWave's layer list: layer 0 is the token embedding, layers 1..N the model's own
decoder layers (each with the model's rotary embedding, computed in the layer), layer
N+1 the final norm and LM head. Without weights, each layer is initialised as the
model's ``_init_weights`` does (its norms' gains and its buffers from the model's own
initialisation; normal(0, initializer_range) matrices from the layer's own (seed,
layer) stream), so parameters do not depend on which stage builds them; with weights,
each rank reads only its layers' tensors. Each layer is a copy of the model's own
module, built on the meta device from the model's class and materialised alone, so a
rank allocates only its layers. What the model does between its modules is applied by
name: the embedding's ``embedding_multiplier`` and the logits' ``logits_scaling``
(Granite) and ``logit_scale`` (Cohere).

Dropout: inside a model's modules dropout draws from torch's global generator and so
would differ between layouts; a
config with any dropout above 0 is refused (:data:`HfModel.dropout_sites` is empty).
Tied input and output embeddings (``tie_word_embeddings``) are held twice, by the
embedding layer and by the head layer, initialised and loaded alike and kept equal by
summing their gradients (:mod:`elaswave.fabric.tied`). Refused: families whose attention
needs an explicit mask (no SDPA: Gemma 2 and 3's soft-capping) and final-logit
soft-capping.

:func:`hf_shape` reads the config into a :class:`~elaswave.model.config.ModelConfig`
(the cost model's dimensions); :class:`HfModel` builds the layers;
:func:`to_hf_state_dict` names trained layers' parameters as the Hugging Face model
does, so ``from_pretrained`` can load them.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from elaswave.model.config import ModelConfig
from elaswave.model.hf_checkpoint import CheckpointNames
from elaswave.model.llama import PipelineLayer, StepContext
from elaswave.model.llama import per_sample_loss as _per_sample_loss
from elaswave.model.rng import stream_key
from elaswave.model.tensor_parallel import (
    NO_TP,
    TpShard,
    copy_to,
    fused_parts,
    gather_last,
    reduce_from,
    shard_param,
    split_dim,
    sum_both,
    summed_grad,
)

TESTED_FAMILIES = (
    "llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "olmo2", "granite", "smollm3",
    "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "glm4_moe", "granitemoe",
    "starcoder2",
)  # fmt: skip
"""``model_type`` values checked against transformers' own model (logits, gradients,
layouts, recovery): ``tests/unit/test_hf_model.py``. Others of the same structure
are accepted."""

TIED_PARAMS = ("embed_tokens.weight", "lm_head.weight")
"""A tied weight's two copies: in the embedding layer and in the head layer (in that
order; :mod:`elaswave.fabric.tied`)."""

STRUCTURE = ("model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head")
"""What a causal LM must have for ElasWave to split it into layers."""


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
    if not isinstance(kind, str):
        raise ValueError(f"{path}: model_type = {kind!r}: expected a transformers model type")
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if kind not in CONFIG_MAPPING:
        raise ValueError(
            f"{path}: model_type = {kind!r} is not a model type transformers "
            f"{transformers.__version__} knows; families tested: {', '.join(TESTED_FAMILIES)}"
        )
    try:
        cfg = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:  # transformers raises many kinds for a bad config
        why = " ".join(str(exc).split())  # one line: its messages span several
        raise ValueError(f"{path} is not a valid {kind} config: {why}") from None
    cfg._attn_implementation = "sdpa"
    return cfg


def skeleton(cfg: Any, where: str) -> Any:
    """The model on the meta device (no memory), checked for :data:`STRUCTURE`."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
    except Exception as exc:  # an encoder, a config transformers cannot build, no SDPA
        raise ValueError(
            f"{where}: model_type = {cfg.model_type!r}: not a causal LM ElasWave can build "
            f"with SDPA attention: {str(exc).splitlines()[0][:200]}"
        ) from None
    missing = [path for path in STRUCTURE if not _has(model, path)]
    if missing or not isinstance(model.model.layers, nn.ModuleList):
        raise ValueError(
            f"{where}: model_type = {cfg.model_type!r} is not laid out as "
            f"{', '.join(STRUCTURE)} (it lacks {', '.join(missing) or 'a list of layers'}); "
            f"families tested: {', '.join(TESTED_FAMILIES)}"
        )
    return model


def _has(model: nn.Module, path: str) -> bool:
    obj: Any = model
    for name in path.split("."):
        obj = getattr(obj, name, None)
        if obj is None:
            return False
    return True


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

    model = skeleton(cfg, where)
    for name, value in sorted(vars(cfg).items()):
        dropout = "dropout" in name or name.endswith("pdrop")
        if dropout and isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
            refuse(
                f"{name} = {value}",
                "dropout inside the model's modules draws from torch's global generator, "
                "which ElasWave cannot keep the same across layouts; set it to 0",
            )
    if getattr(cfg, "output_router_logits", False):
        refuse(
            "output_router_logits = true",
            "the router's load-balancing loss spans every layer of a sample, across "
            "pipeline stages, and is not in ElasWave's loss; set it to false (the "
            "model's own default: training on the language-model loss alone)",
        )
    for name, value in sorted(vars(cfg).items()):
        if "jitter" in name and isinstance(value, int | float) and value and value > 0:
            refuse(
                f"{name} = {value}",
                "router noise draws from torch's global generator, which ElasWave cannot "
                "keep the same across layouts; set it to 0",
            )
    if getattr(cfg, "final_logit_softcapping", None) is not None:
        refuse(
            f"final_logit_softcapping = {cfg.final_logit_softcapping}",
            "soft-capped attention needs eager attention with a mask; not supported",
        )
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // heads)
    window = getattr(cfg, "sliding_window", None)
    uses_window = getattr(cfg, "use_sliding_window", True)
    if uses_window and window is not None and seq_len > int(window):
        refuse(
            f"sliding_window = {window}",
            f"samples of seq_len = {seq_len} tokens would need the sliding-window mask; "
            f"use seq_len <= {window}",
        )
    limit = getattr(cfg, "max_position_embeddings", None)
    if limit is not None and seq_len > int(limit):
        refuse(f"max_position_embeddings = {limit}", f"seq_len = {seq_len} is longer")
    shape = ModelConfig(
        vocab_size=int(cfg.vocab_size),
        hidden_size=int(cfg.hidden_size),
        num_blocks=int(cfg.num_hidden_layers),
        num_heads=heads,
        num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
        ffn_hidden_size=int(cfg.intermediate_size),
        seq_len=seq_len,
        dropout=0.0,
        rope_theta=_rope_theta(cfg),
        norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
        init_std=float(cfg.initializer_range),
        qkv_bias=cfg.model_type == "qwen2",
        head_size=0 if head_dim * heads == int(cfg.hidden_size) else head_dim,
        tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        source=source,
    )
    shape = _counted(shape, cfg, model)
    whole = [
        sum(p.numel() for n, p in layer.named_parameters() if split_dim(n) is None)
        for layer in model.model.layers
    ]
    if whole[0] != 2 * shape.hidden_size:  # kept whole under TP: norms inside attention
        shape = dataclasses.replace(shape, block_whole=whole[0])
    if len(set(whole)) > 1:  # and routers of expert blocks among dense ones
        shape = dataclasses.replace(shape, layer_whole=tuple(whole))
    return shape


def _counted(shape: ModelConfig, cfg: Any, model: Any) -> ModelConfig:
    """``shape`` with the parameters the model's own modules have where they differ
    from the built-in block's: the head's (a final norm with a bias), each block's
    (dense and expert layers mixed), and what a token passes through (a mixture of
    experts: the cost model prices its compute from that)."""
    head = sum(p.numel() for m in (model.model.norm, model.lm_head) for p in m.parameters())
    if head != shape.hidden_size * (1 + shape.vocab_size):  # a final norm with a bias
        shape = dataclasses.replace(shape, head_params=head)
    experts = _experts(cfg)
    counts = [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    active = [_active(layer, experts) for layer in model.model.layers]
    counted = max(counts)
    if counted != shape.block_param_count():  # priced from the model's own modules
        shape = dataclasses.replace(shape, block_params=counted)
    if len(set(counts)) > 1:  # dense and mixture-of-experts layers
        shape = dataclasses.replace(shape, layer_params=tuple(counts))
    if active != counts:  # a token passes through top_k of the experts
        width = next(  # one expert's inner width, from the fused experts themselves
            (p.shape[-1] for n, p in model.model.named_parameters() if n.endswith(".down_proj")
             and ".experts." in n and p.dim() == 3),
            0,
        )  # fmt: skip
        ffn = _activated_ffn(cfg, experts, width, mixed=len(set(counts)) > 1)
        shape = dataclasses.replace(
            shape, active_params=tuple(active), ffn_hidden_size=ffn, expert_ffn_size=width
        )
    return shape


EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")
"""Config names of a mixture of experts' routed experts (Mixtral; Qwen-MoE, OLMoE;
DeepSeek), with ``num_experts_per_tok`` the experts each token is routed to."""


def _experts(cfg: Any) -> tuple[int, int] | None:
    """(routed experts, experts per token) of a mixture-of-experts config; None for a
    dense model."""
    total = next((getattr(cfg, n) for n in EXPERT_COUNTS if getattr(cfg, n, None)), None)
    top_k = getattr(cfg, "num_experts_per_tok", None)
    if not total or not top_k:
        return None
    return int(total), int(top_k)


def _active(layer: nn.Module, experts: tuple[int, int] | None) -> int:
    """Parameters a token passes through in ``layer``: every parameter, but of the
    routed experts' (named ``experts.``, fused along a leading expert dimension or one
    module each) only its ``top_k`` of ``E`` share; a shared expert and the router are
    on every token's path."""
    total = 0
    for name, param in layer.named_parameters():
        routed = experts is not None and (name.startswith("experts.") or ".experts." in name)
        total += param.numel() * experts[1] // experts[0] if routed and experts else param.numel()
    return total


def _activated_ffn(cfg: Any, experts: tuple[int, int] | None, width: int, *, mixed: bool) -> int:
    """The MLP width a token's activations take in a mixture-of-experts block of
    experts ``width`` wide: its ``top_k`` experts' and the shared experts' (a dense
    layer's where the model mixes them and it is wider)."""
    shared = int(getattr(cfg, "shared_expert_intermediate_size", None) or 0)
    shared += int(getattr(cfg, "n_shared_experts", None) or 0) * width
    activated = (experts[1] if experts else 1) * width + shared
    return max(activated, int(cfg.intermediate_size)) if mixed else activated


class HfEmbedding(PipelineLayer):
    """The model's token embedding (its own module: a scaled one where the model scales
    it), times the model's ``embedding_multiplier`` where it has one."""

    def __init__(self, index: int, embed_tokens: nn.Module, multiplier: float | None) -> None:
        super().__init__(index)
        self.embed_tokens = embed_tokens
        self.multiplier = multiplier
        self.tp = NO_TP
        self.lo = 0
        """The first token id of this member's rows (vocabulary-parallel)."""

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        if self.tp.active:  # this member's rows, the others' summed over the group
            local = x - self.lo
            rows: Any = self.embed_tokens.weight
            outside = (local < 0) | (local >= rows.shape[0])
            out = self.embed_tokens(local.masked_fill(outside, 0))
            out = reduce_from(out.masked_fill(outside.unsqueeze(-1), 0.0), self.tp)
        else:
            out = self.embed_tokens(x)
        return out if self.multiplier is None else out * self.multiplier


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
    """The model's final norm and LM head; the logits divided by ``logits_scaling`` and
    multiplied by ``logit_scale`` where the model does so."""

    def __init__(self, index: int, norm: nn.Module, lm_head: nn.Module, cfg: Any) -> None:
        super().__init__(index)
        self.norm = norm
        self.lm_head = lm_head
        self.divide = getattr(cfg, "logits_scaling", None)
        self.multiply = getattr(cfg, "logit_scale", None)
        self.tp = NO_TP

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        hidden = copy_to(self.norm(x), self.tp)
        logits = gather_last(self.lm_head(hidden), self.tp)  # vocabulary-parallel
        if self.divide is not None:
            logits = logits / self.divide
        if self.multiply is not None:
            logits = logits * self.multiply
        return logits


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


def _read_tensor(files: Mapping[str, Path], name: str) -> torch.Tensor:
    """Tensor ``name`` of the safetensors files (``files``: which file holds each)."""
    from safetensors import safe_open

    with safe_open(str(files[name]), framework="pt") as f:
        return f.get_tensor(name)


def source_buffers(directory: Path, model: Any) -> dict[str, torch.Tensor]:
    """The persistent buffers of ``model`` (the skeleton; a router's bias) that the
    model directory's weight files hold, under the model's names ({} without weights):
    they do not train, so an export writes them as the run read them."""
    files = _weight_files(directory)
    if not files:
        return {}
    names = CheckpointNames(files, model.config.model_type)
    params = {name for name, _ in model.named_parameters()}
    return {
        name: names.read(name, functools.partial(_read_tensor, files))
        for name in model.state_dict()
        if name not in params and name in names
    }


class HfModel:
    """A Hugging Face causal LM split into ElasWave's pipeline layers."""

    dropout_sites: tuple[str, ...] = ()
    backward_autocast = False

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
        self._skeleton = skeleton(self.hf_config, str(directory / "config.json"))
        self._weights = _weight_files(directory)
        self._names = CheckpointNames(self._weights, self.hf_config.model_type)
        """The model's tensor names in the files (renamed, experts fused)."""
        self._flags: dict[tuple[int, int], tuple[tuple[int, bool], ...]] = {}

    def _new(self, index: int) -> PipelineLayer:
        """Layer ``index`` on the meta device: copies of the model's own modules."""
        cfg, last = self.hf_config, self.config.num_layers - 1
        if not 0 <= index <= last:
            raise ValueError(f"layer index {index} out of range [0, {last + 1})")
        model, inner = self._skeleton, self._skeleton.model
        if index == 0:
            multiplier = getattr(cfg, "embedding_multiplier", None)
            return HfEmbedding(index, copy.deepcopy(inner.embed_tokens), multiplier)
        if index == last:
            norm, head = copy.deepcopy(inner.norm), copy.deepcopy(model.lm_head)
            return HfHead(index, norm, head, cfg)
        layer, rotary = copy.deepcopy(inner.layers[index - 1]), copy.deepcopy(inner.rotary_emb)
        return HfDecoder(index, layer, rotary)

    def build_layer(self, index: int, *, seed: int, tp: TpShard = NO_TP) -> PipelineLayer:
        layer = self._new(index).to_empty(device="cpu")
        self._model_init(layer, seed, index)  # buffers and norms as the model has them
        if self._weights:
            self._load(layer, index)
        else:
            self._initialise(layer, index, seed)
        if tp.active:
            refuse_hf_tp(self.config, tp.size)
            _shard(layer, tp, self.config)
        return layer

    def _model_init(self, layer: PipelineLayer, seed: int, index: int) -> None:
        """The model's own initialisation of every module of ``layer`` (its buffers:
        rotary frequencies, embedding scales; its norms' gains), under a generator
        seeded for the layer (what it draws at random is drawn again below)."""
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(stream_key(seed, 0x1A7E6, index) & ((1 << 63) - 1))
            for module in layer.modules():
                self._skeleton._init_weights(module)

    def _initialise(self, layer: PipelineLayer, index: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(stream_key(seed, 0x1A7E5, index) & ((1 << 63) - 1))
        tied = self.config.tie_embeddings and isinstance(layer, HfHead)
        with torch.no_grad():
            for name, param in layer.named_parameters():
                if tied and name == TIED_PARAMS[1]:  # the embedding's weight, as it starts
                    param.copy_(self._first_embedding(seed))
                elif param.dim() >= 2:
                    param.normal_(0.0, self.config.init_std, generator=gen)
                elif name.endswith("bias"):
                    param.zero_()
            if isinstance(layer, HfEmbedding):
                embedding: Any = layer.embed_tokens
                pad = getattr(embedding, "padding_idx", None)
                if pad is not None:
                    embedding.weight[pad].zero_()

    def _first_embedding(self, seed: int) -> torch.Tensor:
        """The embedding's weight as :meth:`build_layer` starts it (a tied head's)."""
        embedding = self.build_layer(0, seed=seed)
        return dict(embedding.named_parameters())[TIED_PARAMS[0]].detach()

    def _load(self, layer: PipelineLayer, index: int) -> None:
        wanted = {
            name: _hf_name(name, index, self.config.num_layers)
            for name, _ in layer.named_parameters()
        }
        head_copy = wanted.get(TIED_PARAMS[1])
        if self.config.tie_embeddings and head_copy is not None and head_copy not in self._names:
            wanted[TIED_PARAMS[1]] = "model.embed_tokens.weight"  # saved once, as tied
        params = set(wanted)
        for name in layer.state_dict():  # persistent buffers the files hold (a router's bias)
            if name not in params:
                with contextlib.suppress(KeyError):  # not the model's module (our rotary)
                    hf_name = _hf_name(name, index, self.config.num_layers)
                    if hf_name in self._names:
                        wanted[name] = hf_name
        missing = [hf for name, hf in wanted.items() if name in params and hf not in self._names]
        if missing:
            raise ValueError(
                f"{self.directory}: the safetensors files lack {', '.join(missing[:3])}"
                + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            )
        state = {name: self._names.read(hf, self._read).float() for name, hf in wanted.items()}
        try:  # every parameter (checked above); a buffer the files lack keeps its start
            layer.load_state_dict(state, strict=False)
        except RuntimeError as exc:
            raise ValueError(
                f"{self.directory}: layer {index}'s weights do not fit: {exc}"
            ) from None

    def _read(self, name: str) -> torch.Tensor:
        return _read_tensor(self._weights, name)

    def decay_flags(self, index: int, tp: int = 1) -> tuple[tuple[int, bool], ...]:
        if (index, tp) not in self._flags:
            with torch.device("meta"):
                layer = self._new(index)
            self._flags[(index, tp)] = tuple(
                (p.numel() // (tp if split_dim(n) is not None else 1), p.dim() >= 2)
                for n, p in layer.named_parameters()
            )
        return self._flags[(index, tp)]

    def per_sample_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return _per_sample_loss(logits, targets)


TP_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
TP_MLP = ("gate_proj", "up_proj", "down_proj")
"""The projections a decoder layer must have, by name, to be split for tensor
parallelism (Megatron's column- and row-parallel pairs)."""
FUSED_TP = {"Phi3Attention": ("qkv_proj", "o_proj"), "Phi3MLP": ("gate_up_proj", "down_proj")}
"""Modules whose fused projections are split by their known blocks of rows (Phi-3's
q | k | v and gate | up: :func:`~elaswave.model.tensor_parallel.fused_parts`), by class:
a fused weight's layout is not in its shape."""
TP_LATENT = ("kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
"""Multi-head latent attention's projections (DeepSeek's), beside its query's: the
latents' down-projections (``q_a_proj``, ``kv_a_proj_with_mqa``) and their norms whole
on every member, the up-projections to the heads (``q_b_proj`` or ``q_proj``,
``kv_b_proj``) column-parallel, ``o_proj`` row-parallel. Its rows are grouped by head,
so each member keeps whole heads."""


def _projections(module: Any, separate: tuple[str, ...]) -> tuple[str, ...]:
    """The projections ``module`` must have: its known fused ones, else ``separate``."""
    return FUSED_TP.get(type(module).__name__, separate)


def _attention_projections(attn: Any) -> tuple[str, ...]:
    """The projections attention ``attn`` must have for tensor parallelism: latent
    attention's (:data:`TP_LATENT`, the query low-rank or not), else q/k/v/o (or fused)."""
    if not hasattr(attn, "kv_b_proj"):
        return _projections(attn, TP_ATTENTION)
    low_rank = getattr(attn, "q_proj", None) is None
    return (("q_a_proj", "q_b_proj") if low_rank else ("q_proj",)) + TP_LATENT


def refuse_hf_tp(config: ModelConfig, tp: int) -> None:
    """ValueError naming why the Hugging Face model cannot be split ``tp`` ways: its
    attention and MLP must be the separate q/k/v/o and gate/up/down projections (or
    fused ones of a known layout: :data:`FUSED_TP`; or a mixture of experts: fused
    routed experts, shared experts of separate projections), with no bias after a
    row-parallel projection, and a q or k norm inside attention only of a shape
    :func:`_attention_norm` splits (Qwen3's, OLMo-2's); or DeepSeek's latent attention
    (:data:`TP_LATENT`). Each kind of block a model has
    is checked (dense and expert blocks mixed: Qwen2-MoE's, GLM-4.5's)."""
    directory = _directory(config.source)
    where = f"{directory / 'config.json'}: --tp {tp}"
    model = skeleton(load_hf_config(directory), where)
    kinds: dict[tuple[type, type], Any] = {}
    for layer in model.model.layers:
        parts = (type(getattr(layer, "self_attn", None)), type(getattr(layer, "mlp", None)))
        kinds.setdefault(parts, layer)
    for layer in kinds.values():
        _refuse_block(layer, where)
        _refuse_widths(layer, config, tp, where)


def _refuse_widths(layer: nn.Module, config: ModelConfig, tp: int, where: str) -> None:
    """ValueError naming the first width of ``layer`` that ``tp`` does not split evenly
    (each block of a fused weight on its own: an expert's inner width)."""
    for name, param in layer.named_parameters():
        dim = split_dim(name)
        if dim is not None and any(
            size % tp for size in fused_parts(name, config) or (param.shape[dim],)
        ):
            raise ValueError(
                f"{where}: tp = {tp} does not divide dimension {dim} of {name} "
                f"({param.shape[dim]}): use a --tp that divides it"
            )


def _refuse_block(layer: nn.Module, where: str) -> None:
    """ValueError naming what ``layer`` lacks for tensor parallelism (:func:`refuse_hf_tp`)."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    names = [
        f"self_attn.{leaf}"
        for leaf in _attention_projections(attn)
        if not isinstance(getattr(attn, leaf, None), nn.Linear)
    ] + [f"mlp.{name}" for name in _mlp_lacks(mlp)]
    if names:
        raise ValueError(
            f"{where}: the layers lack the separate projections tensor parallelism splits "
            f"({', '.join(names)}; fused projections of an unknown layout are not split): "
            "use --tp 1"
        )
    assert attn is not None  # it has its projections
    assert mlp is not None
    rows = [attn.o_proj, *(m for n, m in mlp.named_modules() if n.endswith("down_proj"))]
    if any(getattr(row, "bias", None) is not None for row in rows):
        raise ValueError(f"{where}: a bias after a row-parallel projection: use --tp 1")
    for leaf in ("q_norm", "k_norm"):
        norm = getattr(attn, leaf, None)
        if norm is not None and _attention_norm(norm, attn, leaf) is None:
            raise ValueError(
                f"{where}: self_attn.{leaf} ({type(norm).__name__}) is neither a gain per "
                "head nor an RMS norm over all heads with a gain only: use --tp 1"
            )


def _mlp_lacks(mlp: Any) -> list[str]:
    """What tensor parallelism needs of a block's MLP and ``mlp`` lacks (empty: it can
    be split): the separate (or known fused) projections; of a mixture of experts, its
    routed experts fused as transformers 5 holds them and each shared expert's separate
    projections (its router and gates are kept whole)."""
    experts = getattr(mlp, "experts", None)
    if experts is None:
        return [
            leaf
            for leaf in _projections(mlp, TP_MLP)
            if not isinstance(getattr(mlp, leaf, None), nn.Linear)
        ]
    lacks = [
        f"experts.{leaf}"
        for leaf in ("gate_up_proj", "down_proj")
        if not (isinstance(p := getattr(experts, leaf, None), nn.Parameter) and p.dim() == 3)
    ]
    for name, shared in mlp.named_children():
        if name.startswith("shared_expert") and not isinstance(shared, nn.Linear):
            lacks += [f"{name}.{leaf}" for leaf in _mlp_lacks(shared)]
    return lacks


def _attention_norm(norm: nn.Module, attn: nn.Module, leaf: str) -> str | None:
    """How tensor parallelism splits a q or k norm inside attention: ``head`` (one gain
    of head_dim shared by the heads, as Qwen3's: each member normalises its own heads),
    ``width`` (an RMS norm over every head's width, as OLMo-2's: the sum of squares is
    the group's), None if neither."""
    params = dict(norm.named_parameters())
    weight = params.get("weight")
    if weight is None or len(params) != 1 or weight.dim() != 1:
        return None
    proj = getattr(attn, "q_proj" if leaf == "q_norm" else "k_proj")
    if weight.numel() == getattr(attn, "head_dim", None):
        return "head"
    if weight.numel() == proj.out_features and hasattr(norm, "variance_epsilon"):
        return "width"
    return None


def _shard(layer: PipelineLayer, tp: TpShard, shape: ModelConfig) -> None:
    """``layer`` (whole) as member ``tp.rank``'s piece: its column- and row-parallel
    parameters cut (:func:`~elaswave.model.tensor_parallel.shard_param`), and the
    group's collectives around its attention and MLP (Megatron's conjugate pair: the
    input's gradient summed, the output summed), its vocabulary rows."""
    with torch.no_grad():
        for name, param in list(layer.named_parameters()):
            if split_dim(name) is None:
                continue
            owner_name, _, leaf = name.rpartition(".")
            owner = layer.get_submodule(owner_name)
            piece = shard_param(name, param, tp, fused_parts(name, shape))
            owner._parameters[leaf] = nn.Parameter(piece.clone())
    if isinstance(layer, HfEmbedding):
        embedding: Any = layer.embed_tokens
        rows = embedding.weight.shape[0]
        layer.tp, layer.lo = tp, tp.rank * rows
        pad = getattr(embedding, "padding_idx", None)
        if pad is not None:
            embedding.padding_idx = pad - layer.lo if 0 <= pad - layer.lo < rows else None
    elif isinstance(layer, HfHead):
        layer.tp = tp
    elif isinstance(layer, HfDecoder):
        decoder: Any = layer.layer
        for part in (decoder.self_attn, decoder.mlp):
            part.register_forward_pre_hook(_copy_input(tp), with_kwargs=True)
            part.register_forward_hook(_reduce_output(tp))
        for name, param in [*decoder.self_attn.named_parameters(), *decoder.mlp.named_parameters()]:
            # Whole inside attention (a q or k norm, latent attention's down-projections
            # and their norms) or an MLP of experts (a router, a shared expert's gate):
            # used for this member's heads or part of the output, so its gradient is
            # this member's part, summed over the group.
            if split_dim(name) is None:
                param.register_hook(summed_grad(tp))
        if type(decoder.self_attn).__name__ in FUSED_TP:  # it slices q | k | v by count
            _own_heads(decoder.self_attn, tp)
        for leaf in ("q_norm", "k_norm"):
            norm = getattr(decoder.self_attn, leaf, None)
            if norm is not None and _attention_norm(norm, decoder.self_attn, leaf) == "width":
                norm.forward = functools.partial(_norm_over_members, norm, tp)


def _own_heads(attn: Any, tp: TpShard) -> None:
    """Phi-3's attention counts the heads it slices its fused q | k | v output by: give
    it this member's counts (its own copy of the config)."""
    config = copy.copy(attn.config)
    config.num_attention_heads //= tp.size
    config.num_key_value_heads //= tp.size
    attn.config = config
    attn.num_key_value_heads //= tp.size


def _norm_over_members(norm: Any, tp: TpShard, hidden: torch.Tensor) -> torch.Tensor:
    """An RMS norm over a width the group splits (OLMo-2's q and k norms), on this
    member's part of it: the mean square is the group's, the gain this part's slice of
    the whole gain (its gradient summed over the group by :func:`summed_grad`). As
    transformers' own computes it, in float32."""
    dtype = hidden.dtype
    x = hidden.to(torch.float32)
    width = x.shape[-1]
    squares = sum_both(x.pow(2).sum(-1, keepdim=True), tp)
    x = x * torch.rsqrt(squares / (width * tp.size) + norm.variance_epsilon)
    gain = norm.weight[tp.rank * width : (tp.rank + 1) * width]
    return (gain * x).to(dtype)


def _copy_input(tp: TpShard) -> Any:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (copy_to(args[0], tp), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": copy_to(kwargs["hidden_states"], tp)}

    return hook


def _reduce_output(tp: TpShard) -> Any:
    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        if isinstance(output, tuple):
            return (reduce_from(output[0], tp), *output[1:])
        return reduce_from(output, tp)

    return hook
