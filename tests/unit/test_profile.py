"""Measured layer costs: profile_layers on the tiny model, the job's profile field (its
round trip through job.json and its validation)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from elaswave.engine.cost import LayerKind, compute_time, layer_costs
from elaswave.engine.steptime import plan_step_time
from elaswave.fabric.remap import FP32_BYTES
from elaswave.runtime.host.profile import LayerProfile, profile_layers
from elaswave.runtime.job.config import Endpoints, JobConfig, JobSpec

pytestmark = pytest.mark.timeout(60)

JOB = JobConfig()  # the tiny built-in model, dp2 x pp2, micro-batch 2


@pytest.fixture(scope="module")
def profile() -> LayerProfile:
    return profile_layers(JOB, device=torch.device("cpu"), repeats=3)


@pytest.fixture(scope="module")
def profiled(profile: LayerProfile) -> JobConfig:
    return dataclasses.replace(JOB, profile=profile.costs(JOB.cost_device))


def test_profile_layers_measures_every_layer_of_the_tiny_model(profile):
    formulas = layer_costs(JOB.model, dtype_bytes=FP32_BYTES)
    assert [m.index for m in profile.layers] == list(range(JOB.model.num_layers))
    assert [m.kind for m in profile.layers] == [f.kind for f in formulas]
    assert [m.params for m in profile.layers] == [f.params for f in formulas]
    for m in profile.layers:
        assert m.fwd_s_per_sample > 0 and m.bwd_s_per_sample > 0, m
        assert m.activation_bytes_per_sample > 0, m
    hidden = JOB.model.seq_len * JOB.model.hidden_size * FP32_BYTES
    assert [m.output_bytes_per_sample for m in profile.layers] == [hidden] * 5 + [0.0]
    # A block saves at least its input and its two norm outputs, less than a MiB.
    assert all(3 * hidden <= m.activation_bytes_per_sample < 2**20 for m in profile.layers[1:-1])
    assert profile.total_s > 0 and profile.micro_batch == 2 and profile.repeats == 3
    assert profile.device == "cpu"


def test_the_costs_reproduce_the_measured_seconds_on_the_cost_device(profile):
    dev = JOB.cost_device
    for m, c in zip(profile.layers, profile.costs(dev), strict=True):
        assert c.index == m.index and c.kind == m.kind and c.params == m.params
        assert math.isclose(compute_time(c.fwd_flops_per_sample, dev, dev.base_mhz),
                            m.fwd_s_per_sample, rel_tol=1e-12)  # fmt: skip
        assert math.isclose(compute_time(c.bwd_flops_per_sample, dev, dev.base_mhz),
                            m.bwd_s_per_sample, rel_tol=1e-12)  # fmt: skip


def test_profile_layers_refuses_no_repeats():
    with pytest.raises(ValueError, match="repeats = 0: must be at least 1"):
        profile_layers(JOB, device=torch.device("cpu"), repeats=0)


def test_the_job_plans_with_its_profile_and_keeps_it_through_job_json(tmp_path, profiled):
    assert profiled.layer_costs == list(profiled.profile)
    assert JOB.layer_costs == layer_costs(JOB.model, dtype_bytes=FP32_BYTES)
    again = JobConfig.from_dict(json.loads(json.dumps(profiled.to_dict())))
    assert again == profiled
    assert again.layer_costs == profiled.layer_costs  # the same bits: replay agrees
    assert all(isinstance(c.kind, LayerKind) for c in again.profile)
    JobSpec(
        run_id="r",
        config=profiled,
        endpoints=Endpoints(store_host="h", store_port=1, bus_publish="", bus_subscribe=""),
    ).write(tmp_path)
    assert JobSpec.read(tmp_path).config == profiled
    assert JobConfig.from_dict(json.loads(json.dumps(JOB.to_dict()))) == JOB  # none: formulas


def test_a_balanced_partition_follows_the_profile(profiled):
    # Make layer 1 as slow as all the others together: it gets a stage nearly to itself.
    costs = list(profiled.profile)
    costs[1] = dataclasses.replace(costs[1], fwd_flops_per_sample=1e9, bwd_flops_per_sample=2e9)
    layout = dataclasses.replace(JOB.layout, partition="balanced")
    job = dataclasses.replace(profiled, layout=layout, profile=tuple(costs))
    assert [len(s.layers) for s in job.plan().stages] == [2, 4]


def test_the_predicted_step_time_is_the_profile_priced(profiled):
    plan = profiled.plan()
    measured = plan_step_time(plan, profiled.layer_costs, profiled.cost_device).step_s
    formulas = plan_step_time(plan, JOB.layer_costs, JOB.cost_device).step_s
    assert measured != formulas and measured > 0


def _bad(profiled: JobConfig, position: int, **changes) -> tuple:
    costs = list(profiled.profile)
    costs[position] = dataclasses.replace(costs[position], **changes)
    return tuple(costs)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda p: p[:-1], "profile has 5 layers; the model has 6: profile this model again"),
        (lambda p: (p[1], p[0], *p[2:]), r"profile\[0\].index = 1: must be 0"),
        (
            lambda p: (*p[:5], dataclasses.replace(p[5], kind=LayerKind.BLOCK)),
            r"profile\[5\].kind = 'block': layer 5 is the model's head",
        ),
        (
            lambda p: (*p[:2], dataclasses.replace(p[2], params=1), *p[3:]),
            r"profile\[2\].params = 1: layer 2 has 47232 parameters",
        ),
        (
            lambda p: (*p[:3], dataclasses.replace(p[3], fwd_flops_per_sample=-1.0), *p[4:]),
            r"profile\[3\].fwd_flops_per_sample = -1.0: must be a finite number >= 0",
        ),
        (
            lambda p: (dataclasses.replace(p[0], activation_bytes_per_sample=math.nan), *p[1:]),
            r"profile\[0\].activation_bytes_per_sample = nan: must be a finite number >= 0",
        ),
    ],
)
def test_a_bad_profile_is_refused_naming_the_value(profiled, change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(profiled, profile=change(profiled.profile))


def test_a_malformed_profile_in_job_json_is_refused(profiled):
    raw = profiled.to_dict()
    raw["profile"][0]["kind"] = "mlp"
    with pytest.raises(ValueError, match=r"profile\[0\].kind = 'mlp': valid kinds are embedding"):
        JobConfig.from_dict(raw)
    raw["profile"][0] = {"index": 0}
    with pytest.raises(ValueError, match=r"profile\[0\] = \{'index': 0\}: expected an object"):
        JobConfig.from_dict(raw)


def test_profile_json_round_trips_and_a_foreign_file_is_refused(profile):
    assert LayerProfile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile
    with pytest.raises(ValueError, match="profile schema_version None: expected 1"):
        LayerProfile.from_dict({"layers": []})
