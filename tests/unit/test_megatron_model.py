"""The megatron-core adapter: ElasWave's layer list against megatron's own GPTModel, and
what it refuses."""

from __future__ import annotations

import json

import pytest
import torch

from elaswave.cli.config_file import build_job
from elaswave.engine.cost import layer_costs
from elaswave.model.llama import StepContext, per_sample_loss
from elaswave.model.megatron import (
    MegatronModel,
    megatron_shape,
    process_groups,
    to_gpt_state_dict,
)
from elaswave.model.rng import make_rng

SHAPE = {"num_layers": 3, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2,
         "ffn_hidden_size": 80, "vocab_size": 96}  # fmt: skip
SEQ = 16


def _source(tmp_path, **extra) -> str:
    path = tmp_path / "gpt.json"
    path.write_text(json.dumps({**SHAPE, **extra}))
    return f"megatron:{path}"


def _gpt_model(model: MegatronModel):
    """megatron's own GPTModel of the same config. Test harness only: its rotary module
    moves its table to CUDA in forward (rotary_pos_embedding.py:162), so it is given one
    that builds the same table on the CPU."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    class CpuRotary(RotaryEmbedding):
        def forward(self, max_seq_len, offset=0, packed_seq=False, cp_group=None):
            f = self.get_freqs_non_repeated(max_seq_len, offset)
            return torch.cat((f, f), dim=-1)[:, None, None, :]

    c = model.config
    model.build_layer(1, seed=0)  # the process-local world and megatron's CPU objects
    gpt = GPTModel(
        model.transformer_config(), get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=c.vocab_size, max_sequence_length=c.seq_len, position_embedding_type="rope",
        rotary_base=int(c.rope_theta), pg_collection=process_groups(),
    )  # fmt: skip
    gpt.rotary_pos_emb = CpuRotary(
        kv_channels=c.head_dim, rotary_percent=1.0, rotary_base=int(c.rope_theta),
        use_cpu_initialization=True,
    )  # fmt: skip
    return gpt


def test_layers_match_megatrons_own_gpt_forward_and_backward(tmp_path):
    model = MegatronModel(megatron_shape(_source(tmp_path), seq_len=SEQ))
    layers = [model.build_layer(i, seed=7) for i in range(model.config.num_layers)]
    gpt = _gpt_model(model)
    named = {i: dict(layer.named_parameters()) for i, layer in enumerate(layers)}
    state = {k: v.detach().clone() for k, v in to_gpt_state_dict(named, len(layers)).items()}
    missing, unexpected = gpt.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (
        missing,
        unexpected,
    )
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, SHAPE["vocab_size"], (3, SEQ), generator=gen)
    targets = torch.randint(0, SHAPE["vocab_size"], (3, SEQ), generator=gen)
    ctx = StepContext(step=0, sample_ids=(0, 1, 2), rng=make_rng("counter", seed=0, rank=0))
    x = tokens
    for layer in layers:
        x = layer(x, ctx)
    per_sample_loss(x, targets).sum().backward()
    positions = torch.arange(SEQ).unsqueeze(0).expand(3, -1)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]
    theirs = gpt(tokens, positions, mask)
    per_sample_loss(theirs, targets).sum().backward()
    assert (x - theirs).abs().max().item() < 1e-6
    grads = {k: p.grad for k, p in gpt.named_parameters()}
    ours = {i: {n: p.grad for n, p in layer.named_parameters()} for i, layer in enumerate(layers)}
    for name, grad in to_gpt_state_dict(ours, len(layers)).items():
        assert (grad - grads[name]).abs().max().item() < 1e-6, name
    counts = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    assert counts == [c.params for c in layer_costs(model.config)]


def test_layers_do_not_depend_on_who_builds_them(tmp_path):
    model = MegatronModel(megatron_shape(_source(tmp_path), seq_len=SEQ))
    torch.manual_seed(123)  # the global generator's state must not matter
    a = model.build_layer(2, seed=5)
    torch.rand(1000)
    b = model.build_layer(2, seed=5)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    other = model.build_layer(2, seed=6)
    assert not all(
        torch.equal(p, q) for p, q in zip(a.parameters(), other.parameters(), strict=True)
    )


def test_a_job_takes_the_models_shape(tmp_path):
    source = _source(tmp_path)
    job = build_job(None, {"model": {"preset": source}})
    assert (job.model.num_blocks, job.model.num_kv_heads, job.model.source) == (3, 2, source)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"hidden_dropout": 0.1}, r"hidden_dropout = 0.1: .*set it to 0"),
        ({"swiglu": True}, r"unknown key 'swiglu'; valid keys: num_layers"),
        ({"num_layers": "4"}, r"num_layers = '4': expected int"),
    ],
)
def test_what_cannot_be_split_or_kept_invariant_is_refused(tmp_path, extra, message):
    with pytest.raises(ValueError, match=message):
        megatron_shape(_source(tmp_path, **extra), seq_len=SEQ)
    with pytest.raises(ValueError, match="does not exist"):
        megatron_shape(f"megatron:{tmp_path / 'none.json'}", seq_len=SEQ)


def test_bf16_backward_runs_under_the_forwards_autocast(tmp_path):
    """megatron's linears multiply the bf16 gradient by their saved fp32 weights, which
    works only under the forward's autocast (restored by megatron for CUDA alone): the
    model asks ElasWave's pipeline to run its backward under autocast (found by
    --precision bf16 with a megatron model: "expected m1 and m2 to have the same
    dtype")."""
    model = MegatronModel(megatron_shape(_source(tmp_path), seq_len=SEQ))
    assert model.backward_autocast
    ctx = StepContext(step=0, sample_ids=(0, 1), rng=make_rng("counter", seed=0, rank=0))
    tokens = torch.randint(0, SHAPE["vocab_size"], (2, SEQ), generator=torch.Generator())
    layers = [model.build_layer(i, seed=7) for i in range(model.config.num_layers)]

    def loss() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            x = tokens
            for layer in layers:
                x = layer(x, ctx)
        return per_sample_loss(x, tokens).sum()

    with pytest.raises(RuntimeError, match="same dtype"):
        loss().backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss().backward()
    grads = [p.grad for layer in layers for p in layer.parameters()]
    assert all(g is not None and g.dtype == torch.float32 and g.isfinite().all() for g in grads)


def test_a_cpu_job_on_a_machine_with_gpus_keeps_attention_on_the_cpu(tmp_path, monkeypatch):
    """megatron's global memory buffer allocates on ``torch.cuda.current_device()``: a
    job on the CPU of a GPU machine failed in attention ("batch1 is on cpu, different
    from other tensors on cuda:0"). The buffer ElasWave installs follows the activations."""
    from elaswave.model import megatron

    def no_cuda_device() -> int:
        raise AssertionError("a CPU job asked torch.cuda for its device")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", no_cuda_device)
    megatron._megatron_objects.cache_clear()  # installed as on a machine with GPUs
    try:
        model = MegatronModel(megatron_shape(_source(tmp_path), seq_len=SEQ))
        layer = model.build_layer(1, seed=0)
        ctx = StepContext(step=0, sample_ids=(0, 1), rng=make_rng("counter", seed=0, rank=0))
        out = layer(torch.randn(2, SEQ, SHAPE["hidden_size"]), ctx)
        assert out.device.type == "cpu" and out.shape == (2, SEQ, SHAPE["hidden_size"])
    finally:
        megatron._megatron_objects.cache_clear()
