"""Measured layer costs through the real CLI: ``--profile`` on a tiny Hugging Face Llama
profiles the layers before the job, plans with them (job.json, RUN_DIR/profile.json,
summary.json's predicted_step_s), and a kill's recovery plan is priced on them: replay
reproduces it from job.json, and would not from the FLOP formulas."""

from __future__ import annotations

import json
import shutil

import pytest
import transformers

from elaswave.engine.cost import device
from elaswave.runtime.core.replay import replay_run
from elaswave.runtime.host.profile import LayerProfile
from elaswave.runtime.job.config import JobSpec
from tests.fault.recovery import JOB, check_recovered
from tests.fault.test_model_adapters import SHAPE
from tests.runs import Run, elaswave, train

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def hf_llama(runs_dir) -> str:
    directory = runs_dir / "profile_hf_llama"
    transformers.LlamaConfig(**SHAPE).save_pretrained(directory)
    return f"hf:{directory}"


@pytest.fixture(scope="module")
def profiled(runs_dir, hf_llama) -> Run:
    return train(runs_dir / "profile_on", "--model", hf_llama, "--dp", "2", "--pp", "2",
                 "--profile", "on", *JOB)  # fmt: skip


def test_profile_on_plans_a_hugging_face_model_with_its_measured_layers(profiled):
    assert "elaswave: profiled 6 layers in " in profiled.proc.stdout
    cfg = JobSpec.read(profiled.out).config
    measured = LayerProfile.from_dict(json.loads((profiled.out / "profile.json").read_text()))
    assert len(cfg.profile) == 6
    assert cfg.profile == measured.costs(device("emulated"))
    assert cfg.layer_costs == list(cfg.profile)
    predicted = profiled.summary.predicted_step_s
    assert isinstance(predicted, float) and predicted > 0


# long: measured layers: test_profile_on_plans_a_hugging_face_model_with_its_measured_layers
@pytest.mark.long
def test_a_kill_is_recovered_with_a_plan_priced_on_the_measured_layers(
    runs_dir, hf_llama, profiled
):
    """Rank 1 (stage 0) is SIGKILLed mid-backward; --rebalance migrate prices the layers
    (the plan's reason quotes predicted mini-steps). The run matches the fault-free one,
    replay reproduces the plan from job.json (train checks), and replaying it with the
    profile removed from job.json, on the FLOP formulas, diverges."""
    run = train(runs_dir / "profile_kill", "--model", hf_llama, "--dp", "2", "--pp", "2",
                *JOB, "--fault", "kill:1@3:backward", "--rebalance", "migrate")  # fmt: skip
    assert "elaswave: profiled 6 layers in " in run.proc.stdout  # auto: a Hugging Face model
    check_recovered(run, profiled, world=4, failed=[[1]])
    formulas = runs_dir / "profile_kill_formulas"
    shutil.copytree(run.out, formulas)
    doc = json.loads((formulas / "job.json").read_text())
    assert doc["config"]["profile"]
    doc["config"]["profile"] = []
    (formulas / "job.json").write_text(json.dumps(doc))
    diverged = replay_run(formulas).diverged
    assert diverged is not None and diverged.generation == 1


def test_profile_takes_auto_on_or_off(hf_llama):
    proc = elaswave("train", "--model", hf_llama, "--profile", "always", timeout=60)
    assert proc.returncode == 2
    assert proc.stderr == "elaswave: error: --profile 'always': valid values are auto, on, off\n"
