import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from elaswave.engine.schedule import Op, max_in_flight, one_f_one_b
from elaswave.fabric.adamw import OptimizerConfig, ShardState, adamw_update
from elaswave.fabric.layout import InterleavedLayout


@given(st.lists(st.integers(1, 40), min_size=1, max_size=5), st.integers(1, 6))
def test_interleaved_round_trip_and_shards(numels, dp):
    layout = InterleavedLayout.build(list(enumerate(numels)), dp)
    flats = [torch.arange(n, dtype=torch.float32) + 100 * i for i, n in enumerate(numels)]
    bucket = layout.to_rank_major(flats)
    assert bucket.numel() == dp * layout.shard_numel
    for got, want in zip(layout.from_rank_major(bucket), flats, strict=True):
        assert torch.equal(got, want)
    # Rank j owns shard j of every layer, and nothing else.
    for replica in range(dp):
        shard = layout.shard_of(flats, replica)
        for (layer, lo, hi), flat in zip(layout.shard_slices(), flats, strict=True):
            k = hi - lo
            want = torch.zeros(k)
            piece = flat[replica * k : (replica + 1) * k]
            want[: piece.numel()] = piece
            assert torch.equal(shard[lo:hi], want), layer
    assert layout.shard_numel == sum(-(-n // dp) for n in numels)


@given(st.integers(1, 8), st.integers(1, 12), st.data())
def test_one_f_one_b_bounds_in_flight(num_stages, num_mb, data):
    stage = data.draw(st.integers(0, num_stages - 1))
    actions = one_f_one_b(num_stages=num_stages, stage=stage, num_micro_batches=num_mb)
    assert sorted(a for a in actions if a[0] is Op.FORWARD) == [
        (Op.FORWARD, m) for m in range(num_mb)
    ]
    assert [m for op, m in actions if op is Op.BACKWARD] == list(range(num_mb))
    seen = set()
    for op, mb in actions:
        if op is Op.BACKWARD:
            assert mb in seen, "backward before forward"
        seen.add(mb)
    assert max_in_flight(actions) == min(num_stages - stage, num_mb)


def test_adamw_update_matches_torch_adamw():
    torch.manual_seed(0)
    w = torch.randn(50)
    cfg = OptimizerConfig(lr=1e-2, warmup_steps=0, weight_decay=0.1)
    ref = torch.nn.Parameter(w.clone())
    opt = torch.optim.AdamW(
        [ref], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay
    )
    state = ShardState(w.clone(), torch.zeros(50), torch.zeros(50), torch.ones(50))
    for step in range(5):
        g = torch.randn(50)
        ref.grad = g.clone()
        opt.step()
        adamw_update(state, g, step=step, cfg=cfg)
    torch.testing.assert_close(state.master, ref.detach(), rtol=1e-6, atol=1e-7)


def test_optimizer_config_rejects_bad_lr():
    with pytest.raises(ValueError, match=r"optim\.lr"):
        OptimizerConfig(lr=0.0)
