"""The device backends set torch's watchdog so that it cannot end a survivor during a
recovery, whatever the user's environment says."""

from __future__ import annotations

import os

import pytest

from elaswave.comm.backend import NCCL_ENV, GlooBackend, NcclBackend, backend_for
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
