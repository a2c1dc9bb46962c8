"""The training recipe's arithmetic: learning-rate schedules, their settings, and
gradient clipping by a global norm whose parts sit on several ranks and TP members."""

from __future__ import annotations

import itertools
import math
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from elaswave.cli.config_file import build_job, load_toml
from elaswave.fabric.adamw import LrSchedule, OptimizerConfig
from elaswave.fabric.clip import GradClip
from elaswave.fabric.zero import ZeroAdamW
from elaswave.model.tensor_parallel import split_dim


def test_cosine_and_linear_decay_from_the_peak_to_min_lr_after_the_warm_up() -> None:
    cfg = OptimizerConfig(lr=1.0, warmup_steps=2, lr_schedule="cosine", min_lr=0.1, decay_steps=4)
    assert cfg.lr_schedule is LrSchedule.COSINE
    lrs = [cfg.lr_at(s) for s in range(8)]
    assert lrs[:2] == [0.5, 1.0]  # warm-up, its last step at the peak
    assert lrs[3] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert lrs[5:] == [0.1, 0.1, 0.1]
    assert all(a > b for a, b in itertools.pairwise(lrs[1:6]))
    linear = OptimizerConfig(lr=1.0, warmup_steps=0, lr_schedule="linear", decay_steps=4)
    assert [linear.lr_at(s) for s in range(6)] == [1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    constant = OptimizerConfig(lr=1.0, warmup_steps=4)
    assert [constant.lr_at(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_a_decaying_schedule_without_decay_steps_decays_over_the_rest_of_the_job() -> None:
    cfg = OptimizerConfig(lr=1.0, warmup_steps=5, lr_schedule="linear").for_steps(25)
    assert cfg.decay_steps == 20
    assert cfg.lr_at(24) == 0.0 and cfg.lr_at(4) == 1.0
    assert OptimizerConfig().for_steps(25).decay_steps is None  # constant: nothing to fill


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"lr_schedule": "cos"}, "optim.lr_schedule = 'cos': valid values are 'constant', "),
        ({"min_lr": 0.5, "lr": 0.1}, "optim.min_lr = 0.5: must be in [0, lr = 0.1]"),
        ({"decay_steps": 0}, "optim.decay_steps = 0: must be at least 1"),
        ({"max_grad_norm": 0.0}, "optim.max_grad_norm = 0.0: must be positive"),
        ({"lr": float("inf")}, "optim.lr = inf: must be a positive finite number"),
        ({"weight_decay": float("nan")}, "optim.weight_decay = nan: must be a finite number >= 0"),
        ({"eps": 0.0}, "optim.eps = 0.0: must be a positive finite number"),
        (
            {"grad_reduce_dtype": "bfloat16"},
            "optim.grad_reduce_dtype = 'bfloat16': valid values are 'float32', 'float64'",
        ),
    ],
)
def test_a_bad_recipe_setting_is_refused_naming_it(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        OptimizerConfig(**settings)


def test_the_recipe_comes_from_the_job_file_and_decays_over_its_steps(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text(
        '[optim]\nlr_schedule = "cosine"\nmin_lr = 1e-4\nmax_grad_norm = 1.0\n[train]\nsteps = 30\n'
    )
    job = build_job(load_toml(path))
    assert job.optim.lr_schedule is LrSchedule.COSINE
    assert job.optim.max_grad_norm == 1.0 and job.optim.decay_steps == 25
    path.write_text('[optim]\nlr_schedule = "step"\n')
    with pytest.raises(ValueError, match=re.escape("optim.lr_schedule = 'step': valid values are")):
        build_job(load_toml(path))


class _Sum:
    """A group of members that have all handed in their parts (in a list shared by
    them): the sum of the parts, in place."""

    def __init__(self, parts: list[torch.Tensor]) -> None:
        self.parts = parts

    def all_reduce(self, tensor: torch.Tensor) -> None:
        tensor.copy_(torch.stack(self.parts).sum(0))


def test_the_norm_of_shards_on_several_ranks_is_the_whole_gradients_norm() -> None:
    torch.manual_seed(0)
    whole = torch.randn(1000) * 3
    shards = list(whole.split([300, 300, 400]))
    parts = [torch.zeros(3, dtype=torch.float64) for _ in shards]
    for part, shard in zip(parts, shards, strict=True):
        part[0] = shard.double().square().sum()
    clips = [GradClip(max_norm=1.0, world=_Sum(parts), world_size=3) for _ in shards]
    reference = [whole.clone().requires_grad_()]
    reference[0].grad = whole.clone()
    expected = float(torch.nn.utils.clip_grad_norm_(reference, 1.0))
    clipped = [s.clone() for s in shards]
    norms = [clip.apply(s) for clip, s in zip(clips, clipped, strict=True)]
    assert norms == pytest.approx([expected] * 3, rel=1e-6)  # torch sums in float32
    torch.testing.assert_close(torch.cat(clipped), reference[0].grad, rtol=1e-6, atol=0)
    untouched = whole.clone()
    alone = torch.zeros(1, dtype=torch.float64)
    alone[0] = untouched.double().square().sum()
    assert GradClip(max_norm=1e6, world=_Sum([alone]), world_size=1).apply(untouched) < 1e6
    assert torch.equal(untouched, whole)  # under the threshold: not scaled


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.Parameter(torch.ones(4))  # kept whole on every TP member
        self.wq = nn.Linear(4, 4, bias=False)  # split (column-parallel)


def test_a_tp_member_other_than_the_first_does_not_count_what_every_member_holds() -> None:
    class _Group:
        size = 1

        def all_reduce(self, tensor: torch.Tensor) -> None:
            return None

    layer = nn.Module()
    layer.attn = _Block()
    assert split_dim("attn.wq.weight") == 0 and split_dim("attn.norm") is None
    opt = ZeroAdamW([layer], layer_ids=[0], dp_group=_Group(), replica=0, cfg=OptimizerConfig())
    mask = opt.shard_mask(lambda name: split_dim(name) is not None)
    names = [n for n, _ in layer.named_parameters()]
    sizes = [p.numel() for p in layer.parameters()]
    counted = dict(zip(names, mask[: sum(sizes)].split(sizes), strict=True))
    assert counted["attn.norm"].sum() == 0
    assert counted["attn.wq.weight"].sum() == 16
