"""One accelerator per rank: NCCL and HCCL refuse two ranks of a group on one device.

On a one-GPU machine, ``--device cuda --dp 2 --pp 2`` used to start, put every rank on
cuda:0 and fail a minute later in the first send ("Duplicate GPU detected: rank 0 and
rank 1 both on CUDA device"). The launcher now refuses it before starting anything.
"""

from __future__ import annotations

import pytest

from elaswave.comm.backend import GlooBackend, _one_each, check_capacity


class _OneDevice(GlooBackend):
    name = "fake"

    def devices(self) -> int | None:
        return 1


def test_cpu_ranks_are_unlimited():
    assert GlooBackend().devices() is None
    check_capacity(GlooBackend(), 64, "cpu")


def test_more_ranks_than_devices_are_refused_with_both_counts():
    check_capacity(_OneDevice(), 1, "cuda")
    with pytest.raises(ValueError, match="one per rank needed") as info:
        check_capacity(_OneDevice(), 4, "cuda")
    message = str(info.value)
    assert "--device cuda: 4 ranks" in message and "it has 1 cuda device" in message
    assert "dp x pp <= 1" in message


def test_a_rank_never_wraps_onto_another_ranks_device():
    assert _one_each(1, 2, "CUDA") == 1
    with pytest.raises(ValueError, match="local rank 2 has no CUDA device of its own"):
        _one_each(2, 2, "CUDA")
