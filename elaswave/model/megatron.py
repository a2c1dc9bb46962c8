"""megatron-core GPT pieces as an ElasWave pipeline model (``--model megatron:FILE``).

FILE is a JSON object of the GPT's shape (:data:`KEYS`): a Llama-style megatron GPT with
RMSNorm, a SwiGLU MLP, rotary positions and no linear biases, the local (non Transformer
Engine) layer spec of ``get_gpt_layer_local_spec``. It splits into ElasWave's layer list:
layer 0 is ``LanguageModelEmbedding``, layers 1..N each one ``TransformerLayer``, layer
N+1 the final norm and the ``ColumnParallelLinear`` output layer.

Tensor parallelism (``--tp N``) runs megatron's own tensor-parallel layers: each member
builds them for its TP group (:mod:`elaswave.model.megatron_tp`: megatron's collectives
run on ElasWave's TP group) and gives them its piece of the whole layer's parameters
(:meth:`MegatronModel.build_layer`), so the pieces of every TP degree join into the same
layer; the head's vocabulary slices of the logits are joined by ElasWave.
ElasWave's layers carry hidden states as ``[batch, seq, hidden]``; megatron's as
``[seq, batch, hidden]``, so each piece transposes at its edges. Each piece is built
from its own (seed, layer) stream of torch's generator (megatron's CPU initialisation
draws from it), so parameters do not depend on which stage builds them.

megatron's pieces need a torch.distributed world, which ElasWave does not otherwise
create: a process-local one of size 1 is made (gloo over an in-memory store) and every
parallel group but the TP group is it. ElasWave does not call megatron's
``initialize_model_parallel``, so it installs the global objects megatron's layers read
(memory buffer, RNG tracker). Three megatron paths assume CUDA; they are given versions
of megatron's own objects that follow the job's device (no ``torch.cuda`` is patched):

* ``GlobalMemoryBuffer.get_tensor`` allocates on ``torch.cuda.current_device()``
  (megatron/core/utils.py:631, used by ``DotProductAttention``): the buffer installed
  allocates on the device of the activations of the layer running, so a job on the CPU
  of a machine that has GPUs keeps its attention on the CPU.
* The RNG tracker seeds CUDA generators (tensor_parallel/random.py:235) and attention
  forks it even without dropout (dot_product_attention.py:217): a tracker of CPU
  generators with the same API is installed.
* ``RotaryEmbedding.forward`` moves its frequencies to CUDA (rotary_pos_embedding.py:162):
  each layer builds its rotary table from ``get_freqs_non_repeated``, which does not.

Dropout: megatron draws hidden dropout from torch's global generator and attention
dropout from its tracker, neither of which is the same under another layout; configs
with ``hidden_dropout`` or ``attention_dropout`` above 0 are refused
(:data:`MegatronModel.dropout_sites` is empty). Attention takes an explicit causal mask.
"""

from __future__ import annotations

import contextlib
import functools
import json
import operator
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from elaswave.model.config import ModelConfig
from elaswave.model.llama import PipelineLayer, StepContext
from elaswave.model.llama import per_sample_loss as _per_sample_loss
from elaswave.model.rng import stream_key
from elaswave.model.tensor_parallel import (
    NO_TP,
    TpShard,
    fused_parts,
    gather_last,
    shard_param,
    split_dim,
)

KEYS = {
    "num_layers": int,
    "hidden_size": int,
    "num_attention_heads": int,
    "num_query_groups": int,
    "ffn_hidden_size": int,
    "vocab_size": int,
    "init_method_std": float,
    "layernorm_epsilon": float,
    "rotary_base": int,
    "hidden_dropout": float,
    "attention_dropout": float,
}
"""What a megatron model file may set (``num_query_groups`` defaults to the heads;
the rest but the dropouts are required, the dropouts must be 0)."""
REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size")


def _path(source: str) -> Path:
    if not source.startswith("megatron:"):
        raise ValueError(f"model.source = {source!r} is not a megatron model (megatron:FILE)")
    return Path(source[len("megatron:") :])


def read_spec(source: str) -> dict[str, Any]:
    """The model file's values, checked (one message naming the value)."""
    path = _path(source)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"megatron model file {str(path)!r} does not exist") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is not a readable JSON file: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object of {', '.join(KEYS)}")
    for key, value in raw.items():
        want = KEYS.get(key)
        if want is None:
            raise ValueError(f"{path}: unknown key {key!r}; valid keys: {', '.join(KEYS)}")
        if isinstance(value, bool) or not isinstance(value, want | int):
            raise ValueError(f"{path}: {key} = {value!r}: expected {want.__name__}")
    missing = [k for k in REQUIRED if k not in raw]
    if missing:
        raise ValueError(f"{path}: missing {', '.join(missing)}")
    for key in ("hidden_dropout", "attention_dropout"):
        if raw.get(key, 0.0) != 0.0:
            raise ValueError(
                f"{path}: {key} = {raw[key]}: megatron draws it from generators ElasWave "
                "cannot keep the same across layouts; set it to 0"
            )
    return raw


def megatron_shape(source: str, *, seq_len: int) -> ModelConfig:
    """The cost model's :class:`ModelConfig` of the megatron GPT in ``source``."""
    raw = read_spec(source)
    return ModelConfig(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        num_blocks=raw["num_layers"],
        num_heads=raw["num_attention_heads"],
        num_kv_heads=raw.get("num_query_groups", raw["num_attention_heads"]),
        ffn_hidden_size=raw["ffn_hidden_size"],
        seq_len=seq_len,
        dropout=0.0,
        rope_theta=float(raw.get("rotary_base", 10000)),
        norm_eps=float(raw.get("layernorm_epsilon", 1e-5)),
        init_std=float(raw.get("init_method_std", 0.02)),
        source=source,
    )


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """megatron warns, as its modules load, that Apex and Transformer Engine are missing
    and that it falls back to torch's own kernels: expected here, not news to a user."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
        yield


class _Activations:
    """The device of the activations of the megatron layer running (the memory buffer's)."""

    device = torch.device("cpu")


_ACTIVATIONS = _Activations()


@functools.cache
def _world() -> Any:
    """A process-local torch.distributed world of size 1 (megatron's groups need one)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD


def process_groups(tp: Any = None) -> Any:
    """megatron's ``ProcessGroupCollection``: the groups over the tensor-parallel axis
    ``tp`` (a :class:`~elaswave.model.megatron_tp.MegatronTpGroup`; None: no TP), every
    other the size-1 world (ElasWave runs data and pipeline parallelism itself)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    world = _world()
    groups = ProcessGroupCollection()
    for name in ("pp", "cp", "ep", "embd", "dp", "dp_cp", "intra_dp_cp", "pos_embd"):
        setattr(groups, name, world)
    for name in ("tp", "tp_cp", "expt_tp", "tp_ep", "tp_ep_pp", "mp", "tp_dp_cp"):
        setattr(groups, name, world if tp is None else tp)
    return groups


def _tp_group(tp: TpShard) -> Any:
    """The group megatron's layers of member ``tp`` are built with."""
    if not tp.active:
        return _world()
    from elaswave.model.megatron_tp import megatron_tp_group

    _world()  # megatron reads a group's size only once torch.distributed is initialised
    return megatron_tp_group(tp)


@functools.cache
def _megatron_objects() -> None:
    """Give megatron the global objects ``initialize_model_parallel`` would have made,
    which ElasWave does not call: its memory buffer (on the activations' device) and an
    RNG tracker (of CPU generators: dropout is refused, so it draws nothing on any
    device). See the module docstring."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.utils import GlobalMemoryBuffer

    class DeviceMemoryBuffer(GlobalMemoryBuffer):
        """megatron's buffer on :data:`_ACTIVATIONS`' device (set by each layer's forward)."""

        def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
            n, device = functools.reduce(operator.mul, tensor_shape, 1), _ACTIVATIONS.device
            buf = self.buffer.get((name, dtype, device))
            if buf is None or buf.numel() < n:
                buf = self.buffer[(name, dtype, device)] = torch.empty(
                    n, dtype=dtype, device=device
                )
            return buf[:n].view(*tensor_shape)

    class CpuRngTracker:
        """megatron's tracker API over CPU generators."""

        def __init__(self) -> None:
            self.states_: dict[str, torch.Tensor] = {}

        def is_initialized(self) -> bool:
            return bool(self.states_)

        def reset(self) -> None:
            self.states_ = {}

        def get_states(self) -> dict[str, torch.Tensor]:
            return {k: v.clone() for k, v in self.states_.items()}

        def set_states(self, states: Mapping[str, torch.Tensor]) -> None:
            self.states_ = {k: v.clone() for k, v in states.items()}

        def add(self, name: str, seed: int) -> None:
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    # split linears ask, in every forward, for a CUDA setting that speeds up their
    # asynchronous all-reduce; ElasWave's TP group runs it before returning
    warnings.filterwarnings("ignore", "When using async grad allreduce", UserWarning)
    parallel_state._GLOBAL_MEMORY_BUFFER = DeviceMemoryBuffer()
    tracker = CpuRngTracker()
    for name in (
        mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME,
        mrandom._DATA_PARALLEL_RNG_TRACKER_NAME,
        mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME,
    ):
        tracker.add(name, 0)  # dropout is refused: these streams draw nothing
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


class MegatronEmbedding(PipelineLayer):
    def __init__(self, index: int, embedding: nn.Module) -> None:
        super().__init__(index)
        self.embedding = embedding

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0).expand_as(x)
        return self.embedding(input_ids=x, position_ids=positions).transpose(0, 1).contiguous()


class MegatronLayer(PipelineLayer):
    """One ``TransformerLayer`` with its rotary table and a causal mask."""

    def __init__(self, index: int, layer: nn.Module, rotary: Any) -> None:
        super().__init__(index)
        self.layer = layer
        self.rotary = rotary
        self._tables: tuple[tuple, torch.Tensor, torch.Tensor] | None = None
        """Rotary table and causal mask of the last sequence length: computed once."""

    def _rope_and_mask(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = x.shape[1]
        if self._tables is None or self._tables[0] != (s, x.device):
            freqs = self.rotary.get_freqs_non_repeated(s).to(x.device)
            rope = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
            mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=x.device), 1)[None, None]
            self._tables = ((s, x.device), rope, mask)
        return self._tables[1], self._tables[2]

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        rope, mask = self._rope_and_mask(x)
        _ACTIVATIONS.device = x.device  # where attention's scores buffer is allocated
        out = self.layer(x.transpose(0, 1), attention_mask=mask, rotary_pos_emb=rope)
        out = out[0] if isinstance(out, tuple) else out
        return out.transpose(0, 1).contiguous()


class MegatronHead(PipelineLayer):
    """The final norm and the output layer; split over TP, the members' vocabulary
    slices of the logits are joined by ElasWave (megatron's own gather allocates on
    CUDA: mappings.py ``_gather_along_last_dim``)."""

    def __init__(
        self, index: int, final_layernorm: nn.Module, output_layer: nn.Module, tp: TpShard
    ) -> None:
        super().__init__(index)
        self.final_layernorm = final_layernorm
        self.output_layer = output_layer
        self.tp = tp

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        return gather_last(self.output_layer(self.final_layernorm(x))[0], self.tp)


def to_gpt_state_dict(
    layers: Mapping[int, Mapping[str, torch.Tensor]], num_layers: int
) -> dict[str, torch.Tensor]:
    """ElasWave's ``{layer: {name: tensor}}`` named as megatron's ``GPTModel`` names them."""
    out = {}
    for index, params in layers.items():
        for name, tensor in params.items():
            if index == 0:
                key = name
            elif index == num_layers - 1:
                key = "decoder." + name if name.startswith("final_layernorm.") else name
            else:
                key = f"decoder.layers.{index - 1}." + name.removeprefix("layer.")
            out[key] = tensor
    return out


class MegatronModel:
    """A megatron-core GPT split into ElasWave's pipeline layers."""

    dropout_sites: tuple[str, ...] = ()
    backward_autocast = True
    """megatron's linears save their fp32 weights and multiply them by the bf16 gradient
    in backward under the forward's autocast, which they restore for CUDA only
    (``custom_bwd``): ElasWave runs their backward under it on every device."""

    def __init__(self, config: ModelConfig) -> None:
        shape = megatron_shape(config.source, seq_len=config.seq_len)
        if shape != config:
            raise ValueError(
                f"{_path(config.source)} no longer describes this job's model "
                f"(it gives {shape}, the job was planned for {config})"
            )
        self.config = config
        self.raw = read_spec(config.source)
        self._flags: dict[int, tuple[tuple[str, int, bool], ...]] = {}

    @functools.cache  # noqa: B019 (one model object per process, a few TP degrees)
    def transformer_config(self, tp: int = 1) -> Any:
        """megatron's config of this GPT split ``tp`` ways: a split layer is given the
        whole layer's parameters (:meth:`build_layer`), so it initialises none."""
        with _quiet():
            return self._transformer_config(tp)

    def _transformer_config(self, tp: int) -> Any:
        from megatron.core.transformer.enums import AttnBackend
        from megatron.core.transformer.transformer_config import TransformerConfig

        c = self.config
        return TransformerConfig(
            tensor_model_parallel_size=tp, perform_initialization=tp == 1,
            num_layers=c.num_blocks, hidden_size=c.hidden_size, num_attention_heads=c.num_heads,
            num_query_groups=c.num_kv_heads, ffn_hidden_size=c.ffn_hidden_size,
            kv_channels=c.head_dim, normalization="RMSNorm", layernorm_epsilon=c.norm_eps,
            gated_linear_unit=True, activation_func=torch.nn.functional.silu,
            add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
            init_method_std=c.init_std, use_cpu_initialization=True,
            params_dtype=torch.float32, bf16=False, fp16=False,
            gradient_accumulation_fusion=False, bias_dropout_fusion=False,
            apply_rope_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
            attention_backend=AttnBackend.local,
        )  # fmt: skip

    def _new(self, index: int, tp: TpShard) -> PipelineLayer:
        from megatron.core import tensor_parallel
        from megatron.core.models.backends import LocalSpecProvider
        from megatron.core.models.common.embeddings.language_model_embedding import (
            LanguageModelEmbedding,
        )
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.spec_utils import build_module

        group = _tp_group(tp)
        _megatron_objects()
        cfg, c, last = self.transformer_config(tp.size), self.config, self.config.num_layers - 1
        if not 0 <= index <= last:
            raise ValueError(f"layer index {index} out of range [0, {last + 1})")
        if index == 0:
            embedding = LanguageModelEmbedding(
                cfg, c.vocab_size, c.seq_len, position_embedding_type="rope", tp_group=group
            )
            return MegatronEmbedding(index, embedding)
        if index == last:
            norm = build_module(
                LocalSpecProvider().layer_norm(rms_norm=True, for_qk=False),
                config=cfg, hidden_size=c.hidden_size, eps=c.norm_eps,
            )  # fmt: skip
            output = tensor_parallel.ColumnParallelLinear(
                c.hidden_size, c.vocab_size, config=cfg, init_method=cfg.init_method,
                bias=False, gather_output=False, tp_group=group,
            )  # fmt: skip
            return MegatronHead(index, norm, output, tp)
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
        groups = process_groups(group if tp.active else None)
        layer = build_module(spec, config=cfg, layer_number=index, pg_collection=groups)
        rotary = RotaryEmbedding(
            kv_channels=c.head_dim, rotary_percent=1.0, rotary_base=int(c.rope_theta),
            use_cpu_initialization=True, cp_group=_world(),
        )  # fmt: skip
        return MegatronLayer(index, layer, rotary)

    def build_layer(self, index: int, *, seed: int, tp: TpShard = NO_TP) -> PipelineLayer:
        """Layer ``index`` from its own stream of ``seed``; split over ``tp``, megatron's
        tensor-parallel layer holding member ``tp.rank``'s piece of the whole layer's
        parameters, so the pieces of every TP degree join into the same layer."""
        with torch.random.fork_rng(devices=[]), _quiet():
            torch.manual_seed(stream_key(seed, 0x3E6A, index) & ((1 << 63) - 1))
            whole = self._new(index, NO_TP)
            if not tp.active:
                return whole
            layer = self._new(index, tp)
        pieces = dict(whole.named_parameters())
        with torch.no_grad():
            for name, param in layer.named_parameters():
                param.copy_(shard_param(name, pieces[name], tp, fused_parts(name, self.config)))
        return layer

    def decay_flags(self, index: int, tp: int = 1) -> tuple[tuple[int, bool], ...]:
        if index not in self._flags:  # small pieces; megatron builds no meta
            layer = self.build_layer(index, seed=0)
            self._flags[index] = tuple(
                (n, p.numel(), p.dim() >= 2) for n, p in layer.named_parameters()
            )
        return tuple(
            (numel // (tp if split_dim(n) is not None else 1), matrix)
            for n, numel, matrix in self._flags[index]
        )

    def per_sample_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return _per_sample_loss(logits, targets)
