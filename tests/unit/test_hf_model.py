"""The Hugging Face adapter: ElasWave's layer list against the model's own forward and
backward, weights from safetensors, and what it refuses."""

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

SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=80, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
}
SEQ = 16


def _write(tmp_path, family: str, **extra) -> str:
    config_cls, _ = FAMILIES[family]
    directory = tmp_path / family
    config_cls(**{**SHAPE, "tie_word_embeddings": False, **extra}).save_pretrained(directory)
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
    named = {i: dict(layer.named_parameters()) for i, layer in enumerate(layers)}
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
    for name, grad in to_hf_state_dict(named, len(layers)).items():
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


def test_weights_come_from_safetensors(tmp_path):
    config_cls, model_cls = FAMILIES["qwen2"]
    directory = tmp_path / "saved"
    torch.manual_seed(11)
    hf = model_cls(config_cls(**SHAPE, tie_word_embeddings=False))
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


def test_a_job_takes_the_models_shape_and_only_seq_len(tmp_path):
    source = _write(tmp_path, "qwen2")
    job = build_job({"model": {"source": source, "seq_len": 24}})
    assert (job.model.hidden_size, job.model.num_blocks, job.model.qkv_bias) == (32, 3, True)
    assert job.model.seq_len == 24 and job.model.source == source
    assert build_job(None, {"model": {"preset": source}}).model.source == source
    with pytest.raises(ValueError, match=r"hidden_size: the model hf:.* only seq_len"):
        build_job({"model": {"source": source, "hidden_size": 64}})


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"tie_word_embeddings": True}, r"tie_word_embeddings = true: .* different pipeline"),
        ({"attention_dropout": 0.1}, r"attention_dropout = 0.1: .*set it to 0"),
        ({"attention_bias": True}, r"attention_bias = true"),
        ({"hidden_act": "gelu"}, r"hidden_act = 'gelu'"),
        ({"max_position_embeddings": 8}, r"max_position_embeddings = 8: seq_len = 16"),
    ],
)
def test_what_cannot_be_split_or_kept_invariant_is_refused(tmp_path, extra, message):
    source = _write(tmp_path, "llama", **extra)
    with pytest.raises(ValueError, match=message):
        hf_shape(source, seq_len=SEQ)


def test_a_directory_that_is_not_a_supported_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"has no config\.json"):
        hf_shape(f"hf:{tmp_path}", seq_len=SEQ)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match=r"model_type = 'gpt2' is not supported; supported: llama"):
        hf_shape(f"hf:{tmp_path}", seq_len=SEQ)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a readable JSON file"):
        hf_shape(f"hf:{tmp_path}", seq_len=SEQ)
    source = _write(tmp_path, "mistral", sliding_window=8)
    with pytest.raises(ValueError, match=r"sliding_window = 8: .*seq_len <= 8"):
        hf_shape(source, seq_len=SEQ)
