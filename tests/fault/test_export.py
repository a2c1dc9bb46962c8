"""``elaswave export``: a finished Hugging Face run (dp2 x pp2, through a kill) written
as a model directory that transformers' ``from_pretrained`` loads, whose logits on a
held-out batch equal ElasWave's own layers' on the trained parameters; tied weights
saved once; ``elaswave evaluate``'s held-out loss equal to the exported model's; what
export refuses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from elaswave.cli.evaluate import evaluate
from elaswave.model.hf import HfModel, hf_shape
from elaswave.model.llama import StepContext
from elaswave.model.rng import make_rng
from elaswave.runtime.core.compare import load_params
from tests.hf_models import saved_with_router_bias
from tests.runs import elaswave, train

pytestmark = pytest.mark.timeout(300)

SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
JOB = ("--dp", "2", "--pp", "2", "--steps", "6", "--global-batch", "8", "--micro-batch", "1")


def _ours(source: str, run_dir, tokens: torch.Tensor) -> torch.Tensor:
    """ElasWave's layers with the run's trained parameters, on ``tokens``."""
    return _forward(HfModel(hf_shape(source, seq_len=tokens.shape[1])), run_dir, tokens)


def _forward(model, run_dir, tokens: torch.Tensor) -> torch.Tensor:
    """``model``'s layers with the run's trained parameters, on ``tokens``."""
    params = load_params(run_dir)
    ctx = StepContext(step=0, sample_ids=(0,), rng=make_rng("counter", seed=0, rank=0))
    x = tokens
    with torch.no_grad():
        for index in range(model.config.num_layers):
            layer = model.build_layer(index, seed=0)  # its buffers as the model reads them
            missing = layer.load_state_dict(params[index], strict=False).missing_keys
            assert not set(missing) & {n for n, _ in layer.named_parameters()}, missing
            x = layer(x, ctx)
    return x


@pytest.mark.parametrize(
    "tied", [False, pytest.param(True, marks=pytest.mark.long)]
)  # long: the tied weight saved once and loaded: tests/unit/test_hf_model.py
def test_an_exported_run_loads_in_transformers_with_the_same_logits(runs_dir, tied):
    directory = runs_dir / f"export_model_{tied}"
    transformers.LlamaConfig(**SHAPE, tie_word_embeddings=tied).save_pretrained(directory)
    source = f"hf:{directory}"
    run = train(runs_dir / f"export_run_{tied}", "--model", source, *JOB,
                "--fault", "kill:2@3:backward")  # fmt: skip
    out = runs_dir / f"exported_{tied}"
    proc = elaswave("export", str(run.out), str(out))
    assert proc.returncode == 0, proc.stderr
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert (hf.lm_head.weight is hf.model.embed_tokens.weight) == tied
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(3, SHAPE["vocab_size"], (2, 16), generator=gen)
    with torch.no_grad():
        theirs = hf(tokens).logits
    ours = _ours(source, run.out, tokens)
    assert (ours - theirs).abs().max().item() <= 1e-5
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert ("lm_head.weight" in names) != tied  # a tied weight once
    held = runs_dir / f"export_heldout_{tied}.bin"
    ids = torch.randint(3, SHAPE["vocab_size"], (4 * 32 + 1,), generator=gen)
    held.write_bytes(ids.numpy().astype(np.uint16).tobytes())
    result = evaluate(run.out, held, dtype="uint16", batch=3)
    windows = torch.stack([ids[i * 32 : i * 32 + 33] for i in range(4)])
    with torch.no_grad():
        logits = hf(windows[:, :-1]).logits
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())
    assert result.samples == 4 and abs(result.loss - float(expected)) <= 1e-5


def test_export_refuses_what_it_cannot_write(runs_dir, tmp_path):
    proc = elaswave("export", str(tmp_path), str(tmp_path / "out"))
    assert proc.returncode == 2 and "is not a run directory" in proc.stderr
    built_in = train(runs_dir / "export_builtin", "--dp", "1", "--pp", "1", "--steps", "1")
    proc = elaswave("export", str(built_in.out), str(tmp_path / "out"))
    assert proc.returncode == 2 and "export writes Hugging Face models" in proc.stderr
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    proc = elaswave("export", str(built_in.out), str(tmp_path / "full"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1


@pytest.mark.long  # megatron's own GPTModel against the layers: tests/unit/test_megatron_model.py
def test_an_exported_megatron_run_loads_in_megatrons_gpt_with_the_same_logits(runs_dir):
    """A megatron-core run (dp2 x pp2, through a kill) exported as a Megatron torch-format
    checkpoint: megatron's own GPTModel loads its ``model`` and gives the logits of
    ElasWave's layers on the run's parameters."""
    import json

    from elaswave.model.megatron import MegatronModel, megatron_shape
    from tests.unit.test_megatron_model import _gpt_model

    spec = runs_dir / "export_gpt.json"
    spec.write_text(json.dumps({"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
                                "num_query_groups": 2, "ffn_hidden_size": 80,
                                "vocab_size": 96}))  # fmt: skip
    source = f"megatron:{spec}"
    run = train(runs_dir / "export_megatron", "--model", source, *JOB,
                "--fault", "kill:2@3:backward")  # fmt: skip
    out = runs_dir / "exported_megatron"
    proc = elaswave("export", str(run.out), str(out))
    assert proc.returncode == 0, proc.stderr
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "6\n"
    checkpoint = torch.load(out / "iter_0000006" / "mp_rank_00" / "model_optim_rng.pt")
    assert checkpoint["iteration"] == 6 and json.loads((out / "gpt.json").read_text())
    model = MegatronModel(megatron_shape(source, seq_len=16))
    gpt = _gpt_model(model)
    gpt.load_state_dict(checkpoint["model"], strict=True)
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 96, (2, 16), generator=gen)
    x = _forward(model, run.out, tokens)
    with torch.no_grad():
        positions = torch.arange(16).unsqueeze(0).expand(2, -1)
        mask = torch.triu(torch.ones(16, 16, dtype=torch.bool), 1)[None, None]
        theirs = gpt(tokens, positions, mask)
    assert (x - theirs).abs().max().item() <= 1e-5


MOE_CONFIGS = {
    "deepseek-v3": dict(
        num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=48, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1,
    ),
    "glm4-moe": dict(
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
        first_k_dense_replace=1, n_shared_experts=1, head_dim=16,
    ),
}  # fmt: skip


@pytest.mark.parametrize(
    ("family", "tp"),
    [
        ("deepseek-v3", 1),
        pytest.param("deepseek-v3", 2, marks=pytest.mark.long),
        pytest.param("glm4-moe", 2, marks=pytest.mark.long),
    ],
)  # long: TP of latent attention, of dense and expert blocks: test_hf_tensor_parallel.py
def test_an_exported_mixture_of_experts_is_written_as_its_checkpoints_are(runs_dir, family, tp):
    """DeepSeek-V3 whole and split two ways (TP), and GLM-4.5 split two ways, from a
    directory with weights (one tensor per expert, as their checkpoints are; their
    routers' bias set), each with a dense first block: the run reads them into fused
    experts (each member its piece), and export writes the trained model back in its
    checkpoints' layout, the bias as read, which transformers loads to ElasWave's
    logits."""
    model_type = family.replace("-", "_")
    config = transformers.AutoConfig.for_model(
        model_type, **{**SHAPE, **MOE_CONFIGS[family]}, tie_word_embeddings=False
    )
    directory = runs_dir / f"export_moe_model_{family}_tp{tp}"
    saved_with_router_bias(config, directory, seed=3)
    source = f"hf:{directory}"
    run = train(runs_dir / f"export_moe_run_{family}_tp{tp}", "--model", source, "--dp", "1",
                "--pp", "2", "--tp", str(tp), "--steps", "3", "--global-batch", "4",
                "--micro-batch", "2")  # fmt: skip
    out = runs_dir / f"exported_moe_{family}_tp{tp}"
    proc = elaswave("export", str(run.out), str(out))
    assert proc.returncode == 0, proc.stderr
    from safetensors.torch import load_file

    before = load_file(str(directory / "model.safetensors"))
    after = load_file(str(out / "model.safetensors"))
    assert after.keys() == before.keys()  # one tensor per expert and projection
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in after
    biases = [n for n in after if n.endswith("e_score_correction_bias")]
    assert biases and all(torch.equal(after[n], before[n]) for n in biases)
    assert not torch.equal(
        after["model.layers.1.mlp.experts.0.up_proj.weight"],
        before["model.layers.1.mlp.experts.0.up_proj.weight"],
    )  # trained
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    tokens = torch.randint(
        3, SHAPE["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(7)
    )
    with torch.no_grad():
        theirs = hf(tokens).logits
    assert (_ours(source, run.out, tokens) - theirs).abs().max().item() <= 1e-5
