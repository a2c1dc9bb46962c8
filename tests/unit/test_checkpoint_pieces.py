"""Checkpoint pieces by generation: a step written twice (redone, or re-trained after a
restore inside the job) is complete when one generation's pieces cover every layer."""

from __future__ import annotations

import torch

from elaswave.fabric.adamw import ShardState
from elaswave.fabric.checkpoint import (
    complete_generation,
    latest_complete,
    load_layers,
    shard_of_layers,
    shard_pieces,
    write_pieces,
)
from elaswave.fabric.layout import InterleavedLayout
from elaswave.rundir import step_dir

NUMELS = [(0, 10), (1, 7)]


def _layers(offset: float) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    return {
        layer: tuple(torch.arange(n, dtype=torch.float32) + offset + 100 * i for i in range(3))
        for layer, n in NUMELS
    }  # type: ignore[misc]


def _write(run_dir, step, generation, dp, offset, replicas=None):
    layout = InterleavedLayout.build(NUMELS, dp)
    whole = _layers(offset)
    for replica in range(dp) if replicas is None else replicas:
        shard = shard_of_layers(layout, replica, whole)
        state = ShardState(shard.master, shard.exp_avg, shard.exp_avg_sq, torch.zeros(0))
        write_pieces(run_dir, step, 10 * generation + replica, shard_pieces(layout, replica, state),
                     generation)  # fmt: skip


def test_one_generation_covering_every_layer_is_a_complete_checkpoint(tmp_path):
    _write(tmp_path, 3, generation=0, dp=2, offset=0.0)
    assert latest_complete(tmp_path, num_layers=2) == 3
    loaded = load_layers(step_dir(tmp_path, 3), [0, 1])
    for layer, whole in _layers(0.0).items():
        for got, want in zip(loaded[layer], whole, strict=True):
            assert torch.equal(got, want)


def test_pieces_of_two_generations_never_mix(tmp_path):
    _write(tmp_path, 5, generation=1, dp=2, offset=0.0)  # complete
    _write(tmp_path, 5, generation=4, dp=3, offset=0.5, replicas=[0, 2])  # one piece missing
    directory = step_dir(tmp_path, 5)
    assert complete_generation(directory, [0, 1]) == 1
    assert torch.equal(load_layers(directory, [0])[0][0], _layers(0.0)[0][0])
    _write(tmp_path, 5, generation=4, dp=3, offset=0.5, replicas=[1])  # now complete
    assert complete_generation(directory, [0, 1]) == 4
    assert torch.equal(load_layers(directory, [0])[0][0], _layers(0.5)[0][0])


def test_a_piece_without_its_manifest_is_not_counted(tmp_path):
    _write(tmp_path, 2, generation=0, dp=2, offset=0.0)
    (step_dir(tmp_path, 2) / "rank1.g0.json").unlink()
    assert latest_complete(tmp_path, num_layers=2) is None


def test_the_newest_complete_step_is_found(tmp_path):
    _write(tmp_path, 2, generation=0, dp=2, offset=0.0)
    _write(tmp_path, 5, generation=0, dp=2, offset=0.0, replicas=[0])  # in progress
    assert latest_complete(tmp_path, num_layers=2) == 2


def test_pieces_named_without_a_generation_are_read(tmp_path):
    _write(tmp_path, 1, generation=0, dp=2, offset=0.0)
    directory = step_dir(tmp_path, 1)
    for replica in range(2):  # the form written before pieces had manifests
        (directory / f"rank{replica}.g0.json").unlink()
        (directory / f"rank{replica}.g0.pt").rename(directory / f"rank{replica}.pt")
    assert latest_complete(tmp_path, num_layers=2) == 1
    assert torch.equal(load_layers(directory, [1])[1][2], _layers(0.0)[1][2])
