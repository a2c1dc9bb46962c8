"""One accelerator per rank: NCCL and HCCL refuse two ranks of a group on one device.

On a one-GPU machine, ``--device cuda --dp 2 --pp 2`` used to start, put every rank on
cuda:0 and fail a minute later in the first send ("Duplicate GPU detected: rank 0 and
rank 1 both on CUDA device"). The launcher now refuses it before starting anything.
"""

from __future__ import annotations

import os

import pytest

from elaswave.comm.backend import (
    SHARE_DEVICE_ENV,
    GlooBackend,
    _one_each,
    check_capacity,
    sharing_devices,
)


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


def test_sharing_a_device_needs_the_explicit_opt_in(monkeypatch):
    """scripts/gpu_check puts several ranks on one GPU in NCCL's test-only mode; a job
    never does so by accident: without ELASWAVE_SHARE_DEVICE=1 the refusal stays."""
    monkeypatch.delenv(SHARE_DEVICE_ENV, raising=False)
    with pytest.raises(ValueError, match=f"{SHARE_DEVICE_ENV}=1 shares them"):
        check_capacity(_OneDevice(), 4, "cuda")
    monkeypatch.setenv(SHARE_DEVICE_ENV, "0")
    with pytest.raises(ValueError, match="one per rank needed"):
        check_capacity(_OneDevice(), 2, "cuda")
    with pytest.raises(ValueError, match="no CUDA device of its own"):
        _one_each(1, 1, "CUDA")


def test_with_the_opt_in_ranks_take_turns_and_each_is_its_own_nccl_host(monkeypatch):
    for name in ("NCCL_HOSTID", "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_NET"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(SHARE_DEVICE_ENV, "1")
    check_capacity(_OneDevice(), 4, "cuda")
    assert _one_each(3, 2, "CUDA") == 1
    # each process its own NCCL host, whatever its local rank (two job hosts on one
    # machine both have a local rank 0)
    assert os.environ["NCCL_HOSTID"].endswith(f"-elaswave-pid{os.getpid()}")
    assert _one_each(2, 2, "CUDA") == 0
    assert (os.environ["NCCL_P2P_DISABLE"], os.environ["NCCL_SHM_DISABLE"]) == ("1", "1")
    assert os.environ["NCCL_NET"] == "Socket"


def test_a_malformed_opt_in_is_named(monkeypatch):
    monkeypatch.setenv(SHARE_DEVICE_ENV, "yes")
    with pytest.raises(ValueError, match=r"ELASWAVE_SHARE_DEVICE='yes': expected 1"):
        sharing_devices()
