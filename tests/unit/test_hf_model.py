"""The Hugging Face adapter: ElasWave's layer list against the model's own forward and
backward for every tested family (small configs written here, each family's own
quirks set: heads wider than hidden / heads, biases, other activations, Granite's
multipliers), weights from safetensors, and what it refuses."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from elaswave.cli.config_file import build_job
from elaswave.engine.cost import layer_costs
from elaswave.model.hf import HfModel, hf_shape, to_hf_state_dict
from elaswave.model.llama import StepContext, per_sample_loss
from elaswave.model.rng import make_rng
from elaswave.model.tensor_parallel import split_dim
from tests.hf_models import saved_with_router_bias

SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=80, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {}),
    "llama-biased-gelu": ("llama", {"attention_bias": True, "mlp_bias": True,
                                    "hidden_act": "gelu"}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 16}),  # wider than hidden / heads, with q and k norms
    "gemma": ("gemma", {"head_dim": 8}),  # scaled embedding, (1 + w) norms, GELU
    "phi3": ("phi3", {}),  # fused qkv and gate-up projections
    "olmo2": ("olmo2", {}),  # norms after attention and MLP, q and k norms
    "granite": ("granite", {"embedding_multiplier": 2.0, "logits_scaling": 4.0,
                            "residual_multiplier": 0.5, "attention_multiplier": 0.3}),
    "smollm3": ("smollm3", {}),  # rotary left out of every fourth layer
    "llama-tied": ("llama", {"tie_word_embeddings": True}),  # as Llama-3.2 1B/3B ship
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),  # as Qwen2.5 0.5B/1.5B
    "gemma-tied": ("gemma", {"head_dim": 8, "tie_word_embeddings": True}),  # as Gemma
    # mixtures of experts: each token routed to 2 of 4 experts
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2-moe": ("qwen2_moe", {"num_experts": 4, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 24,
                                "shared_expert_intermediate_size": 40,
                                "mlp_only_layers": [1]}),  # a shared expert, a dense layer
    "qwen2-moe-even": ("qwen2_moe", {"num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 24,
                                     "shared_expert_intermediate_size": 40}),
    "qwen3-moe": ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 24, "head_dim": 16}),
    "olmoe": ("olmoe", {"num_experts": 4, "num_experts_per_tok": 2}),
    "deepseek-v3": ("deepseek_v3", {"n_routed_experts": 4, "num_experts_per_tok": 2,
                                    "num_key_value_heads": 4,  # multi-head latent attention
                                    "moe_intermediate_size": 24, "first_k_dense_replace": 1,
                                    "q_lora_rank": 16, "kv_lora_rank": 16,
                                    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                                    "v_head_dim": 8, "n_group": 1, "topk_group": 1}),
    "glm4-moe": ("glm4_moe", {"n_routed_experts": 4, "num_experts_per_tok": 2,
                              "moe_intermediate_size": 24, "first_k_dense_replace": 1,
                              "head_dim": 8}),
    "granitemoe": ("granitemoe", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "starcoder2": ("starcoder2", {}),  # layer norms with biases, a GELU MLP of two
}  # fmt: skip
SEQ = 16


def _write(tmp_path, family: str, **extra) -> str:
    model_type, own = FAMILIES[family]
    directory = tmp_path / family
    settings = {**SHAPE, "tie_word_embeddings": False, **own, **extra}
    transformers.AutoConfig.for_model(model_type, **settings).save_pretrained(directory)
    return f"hf:{directory}"


def _layers(model: HfModel, seed: int = 3) -> list[torch.nn.Module]:
    return [model.build_layer(i, seed=seed) for i in range(model.config.num_layers)]


def _run(layers, tokens, targets) -> tuple[torch.Tensor, torch.Tensor]:
    ctx = StepContext(
        step=0, sample_ids=tuple(range(len(tokens))), rng=make_rng("counter", seed=0, rank=0)
    )
    x = tokens
    for layer in layers:
        x = layer(x, ctx)
    return x, per_sample_loss(x, targets).sum()


def _hf_model(source: str, layers):
    directory = source[3:]
    config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    hf = transformers.AutoModelForCausalLM.from_config(config)
    named = {i: layer.state_dict() for i, layer in enumerate(layers)}  # persistent buffers too
    hf.load_state_dict(to_hf_state_dict(named, len(layers)), strict=True)
    return hf


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_layers_match_the_models_own_forward_and_backward(tmp_path, family):
    source = _write(tmp_path, family)
    model = HfModel(hf_shape(source, seq_len=SEQ))
    layers = _layers(model)
    hf = _hf_model(source, layers)  # the same parameters, under the model's own forward
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, SHAPE["vocab_size"], (3, SEQ), generator=gen)
    targets = torch.randint(0, SHAPE["vocab_size"], (3, SEQ), generator=gen)
    ours, loss = _run(layers, tokens, targets)
    loss.backward()
    theirs = hf(tokens).logits
    per_sample_loss(theirs, targets).sum().backward()
    assert (ours - theirs).abs().max().item() < 1e-6
    grads = dict(hf.named_parameters())
    named = {i: {n: p.grad for n, p in layer.named_parameters()} for i, layer in enumerate(layers)}
    ours_by_name = to_hf_state_dict(named, len(layers))
    if model.config.tie_embeddings:  # the model's one weight: the sum of both copies'
        assert hf.lm_head.weight is hf.model.embed_tokens.weight
        tied = ours_by_name.pop("lm_head.weight")
        ours_by_name["model.embed_tokens.weight"] = ours_by_name["model.embed_tokens.weight"] + tied
    for name, grad in ours_by_name.items():
        assert (grad - grads[name].grad).abs().max().item() < 1e-6, name
    # The cost model counts exactly the parameters the layers have (shard layouts).
    counts = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    assert counts == [c.params for c in layer_costs(model.config)]
    assert [sum(n for n, _ in model.decay_flags(i)) for i in range(len(layers))] == counts


def test_layers_do_not_depend_on_who_builds_them(tmp_path):
    model = HfModel(hf_shape(_write(tmp_path, "llama"), seq_len=SEQ))
    a, b = model.build_layer(2, seed=5), model.build_layer(2, seed=5)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    c = model.build_layer(2, seed=6)
    assert not torch.equal(next(a.parameters()), next(c.parameters()))


@pytest.mark.parametrize("family", ["qwen2", "mixtral", "qwen2-moe", "granitemoe"])
def test_weights_come_from_safetensors(tmp_path, family):
    """As the model's save_pretrained writes them (a mixture of experts: one tensor per
    expert and projection, Mixtral's under other names), read into the model's own
    fused experts."""
    source = _write(tmp_path, family)
    config = transformers.AutoConfig.from_pretrained(source[3:], local_files_only=True)
    directory = tmp_path / "saved"
    torch.manual_seed(11)
    hf = transformers.AutoModelForCausalLM.from_config(config)
    hf.save_pretrained(directory, safe_serialization=True)
    assert list(directory.glob("*.safetensors"))
    model = HfModel(hf_shape(f"hf:{directory}", seq_len=SEQ))
    layers = _layers(model, seed=99)  # the seed does not matter: weights are read
    named = {i: dict(layer.named_parameters()) for i, layer in enumerate(layers)}
    theirs = dict(hf.named_parameters())
    for name, param in to_hf_state_dict(named, len(layers)).items():
        assert torch.equal(param, theirs[name]), name
    tokens = torch.randint(0, SHAPE["vocab_size"], (2, SEQ))
    ours, _ = _run(layers, tokens, tokens)
    assert (ours - hf(tokens).logits).abs().max().item() < 1e-6


def test_a_routers_bias_comes_from_safetensors_with_the_weights(tmp_path):
    """DeepSeek-V3 routes by scores plus a per-expert bias, a buffer the checkpoint
    holds (trained outside the gradient): read with the weights, not left at zero."""
    source = _write(tmp_path, "deepseek-v3")
    config = transformers.AutoConfig.from_pretrained(source[3:], local_files_only=True)
    directory = tmp_path / "saved"
    hf = saved_with_router_bias(config, directory, seed=12)
    layers = _layers(HfModel(hf_shape(f"hf:{directory}", seq_len=SEQ)))
    theirs = hf.state_dict()
    ours = to_hf_state_dict({i: layer.state_dict() for i, layer in enumerate(layers)}, 5)
    biases = [n for n in ours if n.endswith("e_score_correction_bias")]
    assert len(biases) == 2 and all(torch.equal(ours[n], theirs[n]) for n in biases)
    assert all(theirs[n].abs().sum() > 0 for n in biases)
    tokens = torch.randint(0, SHAPE["vocab_size"], (2, SEQ))
    logits, _ = _run(layers, tokens, tokens)
    assert (logits - hf(tokens).logits).abs().max().item() < 1e-6


def test_a_mixture_of_experts_is_priced_from_the_experts_a_token_passes_through(tmp_path):
    """Qwen2-MoE with a dense layer between two of experts: each block's parameters as
    its modules have them (the shards' layouts), its compute from the parameters a token
    passes through (2 of 4 routed experts, the shared expert, the router), its
    activations from the experts' widths it takes."""
    model = HfModel(hf_shape(_write(tmp_path, "qwen2-moe"), seq_len=SEQ))
    layers = _layers(model)[1:-1]
    shape = model.config
    assert list(shape.layer_params) == [sum(p.numel() for p in b.parameters()) for b in layers]
    assert shape.layer_params[0] == shape.layer_params[2] > shape.layer_params[1]  # dense
    routed = [
        sum(p.numel() for n, p in b.named_parameters() if ".experts." in f".{n}") for b in layers
    ]
    assert routed[1] == 0 and routed[0] > 0
    pairs = zip(shape.layer_params, routed, strict=True)
    assert list(shape.active_params) == [n - r // 2 for n, r in pairs]
    assert shape.ffn_hidden_size == max(2 * 24 + 40, 80)  # top_k x expert + shared; dense
    costs = layer_costs(shape)[1:-1]
    assert [c.params for c in costs] == list(shape.layer_params)
    s, q = SEQ, shape.num_heads * shape.head_dim
    kept = [  # kept whole on every TP member: the norms, an expert block's router and gate
        sum(p.numel() for n, p in b.named_parameters() if split_dim(n) is None) for b in layers
    ]
    assert list(shape.layer_whole) == kept and kept[1] == 2 * shape.hidden_size < kept[0]
    for b, (cost, active) in enumerate(zip(costs, shape.active_params, strict=True)):
        assert cost.fwd_flops_per_sample == 2.0 * (active - kept[b]) * s + 4.0 * s * s * q
    split = layer_costs(shape, tp=2)[1:-1]  # what each TP member holds of each block
    assert [c.params for c in split] == [w + (n - w) // 2 for n, w in zip(
        shape.layer_params, kept, strict=True)]  # fmt: skip
    dense = HfModel(hf_shape(_write(tmp_path, "mixtral"), seq_len=SEQ)).config
    assert not dense.layer_params and len(dense.active_params) == dense.num_blocks


def test_a_job_takes_the_models_shape_and_only_seq_len(tmp_path):
    source = _write(tmp_path, "qwen2")
    job = build_job({"model": {"source": source, "seq_len": 24}})
    assert (job.model.hidden_size, job.model.num_blocks, job.model.qkv_bias) == (32, 3, True)
    assert job.model.seq_len == 24 and job.model.source == source
    assert build_job(None, {"model": {"preset": source}}).model.source == source
    with pytest.raises(ValueError, match=r"hidden_size: the model hf:.* only seq_len"):
        build_job({"model": {"source": source, "hidden_size": 64}})


@pytest.mark.parametrize(
    ("family", "extra", "message"),
    [
        ("llama", {"attention_dropout": 0.1}, r"attention_dropout = 0.1: .*set it to 0"),
        ("llama", {"max_position_embeddings": 8}, r"max_position_embeddings = 8: seq_len = 16"),
        ("mixtral", {"output_router_logits": True},
         r"output_router_logits = true: the router's load-balancing loss .* set it to false"),
        ("mixtral", {"router_jitter_noise": 0.01},
         r"router_jitter_noise = 0.01: router noise .* set it to 0"),
    ],
)  # fmt: skip
def test_what_cannot_be_split_or_kept_invariant_is_refused(tmp_path, family, extra, message):
    source = _write(tmp_path, family, **extra)
    with pytest.raises(ValueError, match=message):
        hf_shape(source, seq_len=SEQ)


def test_a_directory_that_is_not_a_supported_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"has no config\.json"):
        hf_shape(f"hf:{tmp_path}", seq_len=SEQ)
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "tie_word_embeddings": False})
    )
    with pytest.raises(ValueError, match=r"model_type = 'gpt2' is not laid out as model\.embed"):
        hf_shape(f"hf:{tmp_path}", seq_len=SEQ)
    gemma2 = transformers.Gemma2Config(
        **SHAPE, head_dim=8, final_logit_softcapping=None, tie_word_embeddings=False
    )
    gemma2.save_pretrained(tmp_path / "gemma2")
    with pytest.raises(ValueError, match=r"model_type = 'gemma2': not a causal LM .* SDPA"):
        hf_shape(f"hf:{tmp_path / 'gemma2'}", seq_len=SEQ)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": 3}))
    with pytest.raises(ValueError, match=r"model_type = 3: expected a transformers model type"):
        hf_shape(f"hf:{tmp_path}", seq_len=SEQ)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a readable JSON file"):
        hf_shape(f"hf:{tmp_path}", seq_len=SEQ)
    source = _write(tmp_path, "mistral", sliding_window=8)
    with pytest.raises(ValueError, match=r"sliding_window = 8: .*seq_len <= 8"):
        hf_shape(source, seq_len=SEQ)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"model_type": "fancy-unknown"},
            r"model_type = 'fancy-unknown' is not a model type transformers .* knows; "
            "families tested: llama",
        ),
        ({"head_dim": 15}, r"is not a valid llama config: .*RoPE requires an even"),
        ({"vocab_size": "x"}, r"is not a valid llama config: .*'vocab_size' expected int"),
    ],
)
def test_a_config_transformers_refuses_is_one_line_naming_why(tmp_path, change, message):
    source = _write(tmp_path, "llama")
    path = tmp_path / "llama" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(ValueError, match=message) as refused:
        hf_shape(source, seq_len=SEQ)
    assert "\n" not in str(refused.value), str(refused.value)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gains_and_buffers_start_as_the_models_own_initialisation_has_them(tmp_path, family):
    """Norm gains (Gemma's are 0: its norms scale by 1 + w), rotary frequencies and
    embedding scales as transformers initialises the model; matrices are drawn from the
    layer's own stream (so are not compared)."""
    source = _write(tmp_path, family)
    model = HfModel(hf_shape(source, seq_len=SEQ))
    layers = _layers(model)
    config = transformers.AutoConfig.from_pretrained(source[3:], local_files_only=True)
    hf = transformers.AutoModelForCausalLM.from_config(config)
    theirs = dict(hf.named_parameters())
    named = {i: dict(layer.named_parameters()) for i, layer in enumerate(layers)}
    for name, param in to_hf_state_dict(named, len(layers)).items():
        if param.dim() == 1:
            assert torch.equal(param, theirs[name]), name
    buffers = dict(hf.named_buffers())
    for layer in layers:
        for name, buffer in layer.named_buffers():
            own = name.rsplit(".", 1)[-1]
            matches = [b for n, b in buffers.items() if n.rsplit(".", 1)[-1] == own]
            assert any(torch.equal(buffer, b) for b in matches), (layer.index, name)


def test_a_tied_weights_two_copies_start_equal_and_load_from_its_one_tensor(tmp_path):
    model = HfModel(hf_shape(_write(tmp_path, "llama-tied"), seq_len=SEQ))
    assert model.config.tie_embeddings
    embedding, head = model.build_layer(0, seed=4), model.build_layer(4, seed=4)
    assert torch.equal(embedding.embed_tokens.weight, head.lm_head.weight)
    assert embedding.embed_tokens.weight.data_ptr() != head.lm_head.weight.data_ptr()
    directory = tmp_path / "saved-tied"
    torch.manual_seed(12)
    config = transformers.LlamaConfig(**SHAPE, tie_word_embeddings=True)
    hf = transformers.LlamaForCausalLM(config)
    hf.save_pretrained(directory, safe_serialization=True)  # writes the weight once
    loaded = HfModel(hf_shape(f"hf:{directory}", seq_len=SEQ))
    head = loaded.build_layer(4, seed=0)
    assert torch.equal(head.lm_head.weight, hf.model.embed_tokens.weight)


@pytest.mark.parametrize(
    "family",
    ["llama", "qwen2", "qwen3", "olmo2", "phi3", "gemma", "granite", "llama-tied", "mixtral",
     "qwen2-moe-even", "qwen3-moe", "olmoe"],
)  # fmt: skip
def test_tensor_parallel_pieces_join_into_the_whole_layers(tmp_path, family):
    """Member r of 2 holds rows (q, k, v, gate, up, the vocabulary) or columns (o, down)
    of the whole layer's parameters, and joined they are the whole layer's."""
    from elaswave.model.tensor_parallel import TpShard, fused_parts, merge_param

    model = HfModel(hf_shape(_write(tmp_path, family), seq_len=SEQ))
    for index in range(model.config.num_layers):
        whole = dict(model.build_layer(index, seed=2).named_parameters())
        pieces = [dict(model.build_layer(index, seed=2, tp=TpShard(r, 2)).named_parameters())
                  for r in range(2)]  # fmt: skip
        for name, param in whole.items():
            parts = fused_parts(name, model.config)
            joined = merge_param(name, [p[name] for p in pieces], parts)
            assert torch.equal(joined, param), (index, name)
        sizes = [sum(p.numel() for p in piece.values()) for piece in pieces]
        assert sizes[0] == sum(n for n, _ in model.decay_flags(index, 2))


def test_fused_projections_of_an_unknown_layout_are_refused(tmp_path, monkeypatch):
    """Phi-3's fused q | k | v and gate | up are split by their known blocks; a fused
    weight whose layout is not known (here: Phi-3's, forgotten) is refused, naming it."""
    from elaswave.model import hf

    source = _write(tmp_path, "phi3")
    build_job({"model": {"source": source}, "layout": {"tp": 2}})
    monkeypatch.setattr(hf, "FUSED_TP", {})
    with pytest.raises(ValueError, match=r"--tp 2: .*self_attn\.q_proj.* unknown layout"):
        build_job({"model": {"source": source}, "layout": {"tp": 2}})


@pytest.mark.parametrize(
    ("family", "message"),
    [
        ("llama-biased-gelu", r"--tp 2: a bias after a row-parallel projection"),
        (
            "olmoe",
            r"--tp 2: tp = 2 does not divide dimension 1 of mlp\.experts\.gate_up_proj "
            r"\(50\): use a --tp that divides it",
        ),
    ],
)
def test_a_model_tensor_parallelism_cannot_split_is_refused_naming_why(tmp_path, family, message):
    source = _write(tmp_path, family, intermediate_size=25) if family == "olmoe" else None
    with pytest.raises(ValueError, match=message):
        build_job({"model": {"source": source or _write(tmp_path, family)}, "layout": {"tp": 2}})
    # Qwen2-MoE and GLM-4.5 mix dense and expert blocks; DeepSeek-V3 has latent attention
    for fine in ("llama", "qwen2-moe", "glm4-moe", "deepseek-v3"):
        build_job({"model": {"source": _write(tmp_path, fine)}, "layout": {"tp": 2}})


def test_a_checkpoint_conversion_of_another_kind_is_refused_naming_it(monkeypatch):
    from types import SimpleNamespace

    from elaswave.model import hf_checkpoint

    class Chunk(SimpleNamespace):  # a conversion step ElasWave does not read
        pass

    class WeightConverter(SimpleNamespace):
        pass

    rule = WeightConverter(
        source_patterns=[".experts.*.w1.weight"], target_patterns=[".experts.gate_up_proj"],
        operations=[Chunk(dim=0)],
    )  # fmt: skip
    monkeypatch.setattr(hf_checkpoint, "_conversions", lambda model_type: [rule])
    with pytest.raises(ValueError, match=r"model_type = 'moe': its checkpoint's .*\('Chunk', 0\)"):
        hf_checkpoint.CheckpointNames(["model.layers.0.mlp.experts.0.w1.weight"], "moe")
    names = hf_checkpoint.CheckpointNames(["model.norm.weight"], "moe")  # nothing to convert
    assert "model.norm.weight" in names and "model.layers.0.mlp.experts.gate_up_proj" not in names


@pytest.mark.parametrize("family", ["mixtral", "qwen2-moe", "granitemoe", "deepseek-v3", "llama"])
def test_the_models_tensors_go_back_to_the_layout_save_pretrained_writes(tmp_path, family):
    """What export writes: the model's fused experts split into one tensor per expert and
    projection, renamed back, exactly the names and tensors of the model's own files."""
    from safetensors.torch import load_file

    from elaswave.model.hf_checkpoint import CheckpointNames, to_hub_layout

    source = _write(tmp_path, family)
    config = transformers.AutoConfig.from_pretrained(source[3:], local_files_only=True)
    torch.manual_seed(5)
    hf = transformers.AutoModelForCausalLM.from_config(config)
    hf.save_pretrained(tmp_path / "saved", safe_serialization=True)
    files = load_file(str(tmp_path / "saved" / "model.safetensors"))
    ours = to_hub_layout(hf.state_dict(), config.model_type)
    assert ours.keys() == files.keys()
    assert all(torch.equal(ours[name], files[name]) for name in files)
    names = CheckpointNames(files, config.model_type)  # and read back, the model's again
    for name, tensor in hf.state_dict().items():
        assert torch.equal(names.read(name, files.__getitem__), tensor), name


@pytest.mark.parametrize("family", ["qwen2-moe", "starcoder2", "llama-tied", "deepseek-v3"])
def test_a_models_parameter_count_is_its_modules(tmp_path, family):
    """What the memory check counts: each block as the model has it, its head's norm."""
    from elaswave.model.config import parameter_count

    source = _write(tmp_path, family)
    config = transformers.AutoConfig.from_pretrained(source[3:], local_files_only=True)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config)
    own = sum(p.numel() for p in hf.parameters())  # a tied weight once
    shape = hf_shape(source, seq_len=SEQ)
    tied = shape.vocab_size * shape.hidden_size if shape.tie_embeddings else 0
    assert parameter_count(shape) == own + tied  # ElasWave holds a tied weight twice
