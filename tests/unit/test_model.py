import dataclasses
import json

import pytest
import torch

from elaswave.model.config import PRESETS, TINY, ModelConfig, parameter_count
from elaswave.model.llama import StepContext, build_layer, per_sample_loss
from elaswave.model.rng import CounterRng


def _run(layers, tokens, ids, step=0, seed=0):
    ctx = StepContext(step=step, sample_ids=tuple(ids), rng=CounterRng(seed))
    x = tokens
    for layer in layers:
        x = layer(x, ctx)
    return x


def test_parameter_count_matches_built_layers():
    layers = [build_layer(TINY, i, seed=0) for i in range(TINY.num_layers)]
    assert sum(p.numel() for layer in layers for p in layer.parameters()) == parameter_count(TINY)


def test_llama2_presets_have_published_sizes():
    # Llama 2: 6.7B, 13.0B, 33.7B parameters (untied embeddings).
    assert parameter_count(PRESETS["llama2-7b"]) == pytest.approx(6.74e9, rel=0.01)
    assert parameter_count(PRESETS["llama2-13b"]) == pytest.approx(13.0e9, rel=0.01)
    assert parameter_count(PRESETS["llama2-34b"]) == pytest.approx(33.7e9, rel=0.01)


def test_layer_init_depends_on_index_and_seed_only():
    a = build_layer(TINY, 2, seed=5)
    _ = build_layer(TINY, 1, seed=5)  # building other layers first changes nothing
    b = build_layer(TINY, 2, seed=5)
    c = build_layer(TINY, 2, seed=6)
    for (_, pa), (_, pb), (_, pc) in zip(
        a.named_parameters(), b.named_parameters(), c.named_parameters(), strict=True
    ):
        assert torch.equal(pa, pb)
        if pa.dim() >= 2:
            assert not torch.equal(pa, pc)


def test_sample_output_independent_of_batch_composition():
    """A sample's output (dropout included) depends on its id, not its batch or position."""
    torch.manual_seed(0)
    layers = [build_layer(TINY, i, seed=0) for i in range(TINY.num_layers)]
    tokens = torch.randint(0, TINY.vocab_size, (4, TINY.seq_len))
    full = _run(layers, tokens, [10, 11, 12, 13])
    alone = _run(layers, tokens[2:3], [12])
    swapped = _run(layers, tokens[[3, 2]], [13, 12])
    torch.testing.assert_close(full[2:3], alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(full[2:3], swapped[1:2], rtol=1e-5, atol=1e-5)
    # The dropout stream really depends on the sample id and the step.
    other_id = _run(layers, tokens[2:3], [99])
    other_step = _run(layers, tokens[2:3], [12], step=1)
    assert not torch.allclose(alone, other_id)
    assert not torch.allclose(alone, other_step)


def test_dropout_rate_and_scaling():
    rng = CounterRng(3)
    keep = rng.keep_mask(
        step=0,
        sample_ids=range(64),
        layer=1,
        site=0,
        sample_shape=(32, 64),
        p=0.1,
        device=torch.device("cpu"),
    )
    assert keep.shape == (64, 32, 64)
    assert keep.float().mean().item() == pytest.approx(0.9, abs=0.01)


def test_per_sample_loss_shape():
    logits = torch.randn(3, 5, 7)
    targets = torch.randint(0, 7, (3, 5))
    assert per_sample_loss(logits, targets).shape == (3,)


@pytest.mark.parametrize(
    ("field", "value"),
    [("hidden_size", 63), ("num_heads", 0), ("num_kv_heads", 3), ("dropout", 1.0)],
)
def test_model_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field.split("_")[0]):
        ModelConfig(**{field: value})


def test_per_block_counts_are_one_positive_count_a_block_and_survive_json() -> None:
    from elaswave.runtime.job.config import JobConfig

    shape = ModelConfig(num_blocks=2, layer_params=[900, 500], active_params=[600, 500])
    assert shape.layer_params == (900, 500) and shape.block_active(0) == 600
    assert [shape.block_params_of(b) for b in (0, 1)] == [900, 500]
    assert TINY.block_params_of(3) == TINY.block_active(3) == TINY.block_param_count()
    job = JobConfig.from_dict({"model": dataclasses.asdict(shape)})
    assert JobConfig.from_dict(json.loads(json.dumps(job.to_dict()))).model == shape
    for bad, message in [
        ({"layer_params": [900]}, r"model.layer_params has 1 entries: one per block"),
        ({"active_params": [0, 1]}, r"model.active_params = \[0, 1\]: must be a list of posi"),
        ({"layer_params": "900"}, r"model.layer_params = '900': must be a list"),
        ({"layer_params": [900, 500], "active_params": [600, 700]},
         r"block 1 passes a token through 700 parameters, more than its 500"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            ModelConfig(num_blocks=2, **bad)


def test_token_file_windows_and_loader_are_layout_free(tmp_path):
    import numpy as np

    from elaswave.data.corpus import SampleLoader, TokenFile

    path = tmp_path / "t.bin"
    np.arange(1000, dtype=np.int64).__mod__(100).astype(np.uint16).tofile(path)
    source = TokenFile(path, dtype="uint16", seq_len=8, vocab_size=100)
    assert len(source) == (1000 - 1) // 8
    assert list(source.window(2)) == list(range(16, 25))
    loader = SampleLoader(source, seed=1)
    x, y = loader.batch([5, 300])
    assert torch.equal(x[:, 1:], y[:, :-1])
    # A sample id names the same data alone or in any batch, across epochs too.
    x2, _ = loader.batch([300])
    assert torch.equal(x[1], x2[0])
    for epoch in range(2):
        ids = range(epoch * len(source), (epoch + 1) * len(source))
        assert sorted(loader.corpus_index(i) for i in ids) == list(range(len(source)))
    first = [loader.corpus_index(i) for i in range(len(source))]
    second = [loader.corpus_index(i + len(source)) for i in range(len(source))]
    assert first != second, "each epoch draws its own order"


def test_the_mixtral_preset_has_mixtrals_parameters_and_its_active_ones() -> None:
    from elaswave.model.config import MIXTRAL_8X7B as m

    assert round(parameter_count(m) / 1e9, 1) == 46.7
    active = sum(m.block_active(b) for b in range(m.num_blocks)) + 2 * m.vocab_size * 4096
    assert round(active / 1e9, 1) == 12.9
