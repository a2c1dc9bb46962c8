"""The device backends set torch's watchdog so that it cannot end a survivor during a
recovery, whatever the user's environment says."""

from __future__ import annotations

import os

import pytest

from elaswave.comm.backend import (
    LAUNCH_TIMEOUT_ENV,
    NCCL_DEFAULT_ENV,
    NCCL_ENV,
    GlooBackend,
    NcclBackend,
    backend_for,
    launch_timeout_s,
)
from elaswave.comm.strict import StrictBackend


def test_nccl_watchdog_settings_are_set_and_a_users_value_overridden(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in NCCL_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")  # torch's default: tear down
    NcclBackend()  # constructing it touches no GPU
    assert {name: os.environ[name] for name in NCCL_ENV} == NCCL_ENV
    assert NCCL_ENV["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"


def test_which_backends_park_work_in_flight() -> None:
    assert not GlooBackend().parks_in_flight
    assert NcclBackend.parks_in_flight and StrictBackend.parks_in_flight
    assert isinstance(backend_for("cpu-strict"), StrictBackend)
    assert isinstance(backend_for("cpu"), GlooBackend)


def test_a_launch_waits_at_most_half_the_comm_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch spins on the issuing thread while a non-blocking NCCL launch connects (30
    minutes by default): bounded so that a rank stuck there still stops at a step
    boundary before the Core's stop deadline (max(30 s, comm timeout))."""
    monkeypatch.setenv(LAUNCH_TIMEOUT_ENV, "1800")
    NcclBackend(comm_timeout_s=40.0)
    assert os.environ[LAUNCH_TIMEOUT_ENV] == "20"
    assert [launch_timeout_s(t) for t in (0.5, 3.0, 60.0, 600.0)] == [1, 1, 30, 300]


def test_nccl_names_its_threads_unless_the_user_said_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("NCCL_SET_THREAD_NAME", "x")  # registered, so restored afterwards
    monkeypatch.delenv("NCCL_SET_THREAD_NAME")
    NcclBackend()
    assert os.environ["NCCL_SET_THREAD_NAME"] == NCCL_DEFAULT_ENV["NCCL_SET_THREAD_NAME"] == "1"
    monkeypatch.setenv("NCCL_SET_THREAD_NAME", "0")
    NcclBackend()
    assert os.environ["NCCL_SET_THREAD_NAME"] == "0"
