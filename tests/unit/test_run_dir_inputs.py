"""``elaswave evaluate``, ``export`` and ``train --resume`` on a damaged run directory
(parameter files that are not a run's, a job.json that is not a job) and on bad token
files: one line naming the file or the value, status 2, nothing written. A stopped
tensor-parallel run resumes from the latest step every member's pieces complete, with
its tp."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from elaswave.cli.main import _refuse_unfinished, _resume_sources, main
from elaswave.fabric.checkpoint import write_pieces
from elaswave.model.hf import HfModel, hf_shape
from elaswave.rundir import JOB, PARAMS
from elaswave.runtime.host.launcher import JobHost
from elaswave.runtime.job.config import Endpoints, JobConfig, JobSpec
from elaswave.runtime.job.sections import LayoutConfig

pytestmark = pytest.mark.timeout(120)

MODEL = Path(__file__).parents[2] / "examples" / "models" / "tiny-llama"
SEQ = 16
ENDPOINTS = Endpoints(store_host="127.0.0.1", store_port=1, bus_publish="", bus_subscribe="")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run directory of the tiny Llama: its job.json and its parameters, as
    training saves them (one stage), without training."""
    run = tmp_path_factory.mktemp("run")
    model = hf_shape(f"hf:{MODEL}", seq_len=SEQ)
    JobSpec(run_id="test", config=JobConfig(model=model), endpoints=ENDPOINTS).write(run)
    layers = HfModel(model)
    params = {i: dict(layers.build_layer(i, seed=0).state_dict()) for i in range(model.num_layers)}
    (run / PARAMS).mkdir()
    torch.save(params, run / PARAMS / "stage0.pt")
    return run


@pytest.fixture
def run_dir(trained: Path, tmp_path: Path) -> Path:
    """A copy of :func:`trained` a test may damage."""
    run = tmp_path / "run"
    (run / PARAMS).mkdir(parents=True)
    (run / JOB).write_bytes((trained / JOB).read_bytes())
    (run / PARAMS / "stage0.pt").write_bytes((trained / PARAMS / "stage0.pt").read_bytes())
    return run


def _tokens(path: Path, values: np.ndarray) -> Path:
    values.tofile(path)
    return path


def _edit_params(edit: Callable[[dict], object]) -> Callable[[Path], None]:
    """A damage: the stage file holding what ``edit`` makes of its parameters."""

    def damage(run: Path) -> None:
        path = run / PARAMS / "stage0.pt"
        params = torch.load(path, weights_only=True)
        torch.save(edit(params), path)

    return damage


def _without_layer(params: dict) -> dict:
    del params[3]
    return params


def _wrong_shape(params: dict) -> dict:
    params[0] = {name: torch.zeros(3) for name in params[0]}
    return params


def _extra_parameter(params: dict) -> dict:
    params[1]["extra.weight"] = torch.zeros(2)
    return params


def _write(name: str, data: bytes) -> Callable[[Path], object]:
    return lambda run: (run / name).write_bytes(data)


def _job(doc: object) -> Callable[[Path], object]:
    return lambda run: (run / JOB).write_text(json.dumps(doc))


DAMAGES = [
    pytest.param(
        _write(f"{PARAMS}/stage0.pt", b"garbage\n"),
        r"stage0.pt' is not a parameter file that a run saved \(torch.load: UnpicklingError\)",
        id="params-not-a-torch-file",
    ),
    pytest.param(
        _write(f"{PARAMS}/stage0.pt", b""),
        r"stage0.pt' is not a parameter file that a run saved \(torch.load: EOFError\)",
        id="params-empty",
    ),
    pytest.param(
        _edit_params(lambda params: [1, 2]),
        r"stage0.pt' is not a parameter file that a run saved: expected \{layer index",
        id="params-a-list",
    ),
    pytest.param(
        _edit_params(lambda params: {"x": 1}),
        r"stage0.pt' is not a parameter file that a run saved: expected \{layer index",
        id="params-not-layers",
    ),
    pytest.param(_edit_params(_without_layer), r"lacks the parameters of layers \[3\]", id="layer"),
    pytest.param(_job([1, 2]), r"job.json' does not describe a job \(TypeError", id="job-list"),
    pytest.param(
        _job({"run_id": "x", "endpoints": {}}),
        r"job.json' does not describe a job \(KeyError: 'config'\)",
        id="job-without-config",
    ),
    pytest.param(
        _job({"run_id": "x", "config": {"model": {"bogus": 1}}, "endpoints": {}}),
        r"job.json' does not describe a job \(TypeError: .*'bogus'",
        id="job-unknown-key",
    ),
    pytest.param(
        _job({"run_id": "x", "config": {"model": {"source": 5}}, "endpoints": {}}),
        r"job.json' does not describe a job \(AttributeError",
        id="job-source-not-a-string",
    ),
]


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    """``elaswave ARGV`` exits 2 with one line matching ``message``."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("elaswave: error: ") and "\n" not in err, err
    assert re.search(message, err), err


@pytest.mark.parametrize(("damage", "message"), DAMAGES)
def test_evaluate_refuses_a_damaged_run_naming_what_is_wrong(
    run_dir: Path, tmp_path: Path, capsys, damage, message
) -> None:
    data = _tokens(tmp_path / "held.bin", np.arange(200, dtype=np.uint16) % 128)
    damage(run_dir)
    _refused(capsys, ["evaluate", str(run_dir), "--data", str(data)], message)


@pytest.mark.parametrize(("damage", "message"), DAMAGES)
def test_export_refuses_a_damaged_run_naming_what_is_wrong(
    run_dir: Path, tmp_path: Path, capsys, damage, message
) -> None:
    damage(run_dir)
    out = tmp_path / "out"
    _refused(capsys, ["export", str(run_dir), str(out)], message)
    assert not out.exists(), "nothing is written for a refused run"


@pytest.mark.parametrize(
    ("damage", "message", "command"),
    [
        pytest.param(
            _edit_params(_wrong_shape),
            r"the parameters of layer 0 do not fit its model \(size mismatch for embed_tokens",
            "evaluate",
            id="evaluate-wrong-shape",
        ),
        pytest.param(
            _edit_params(_wrong_shape),
            r"parameter model.embed_tokens.weight has shape \(3,\), the model's is \(128, 64\)",
            "export",
            id="export-wrong-shape",
        ),
        pytest.param(
            _edit_params(_extra_parameter),
            r"the parameters of layer 1 do not fit its model \(Unexpected key\(s\)",
            "evaluate",
            id="evaluate-extra-parameter",
        ),
        pytest.param(
            _edit_params(_extra_parameter),
            r"layer 1 has no parameter named 'extra.weight'",
            "export",
            id="export-extra-parameter",
        ),
    ],
)
def test_parameters_not_of_the_runs_model_are_refused(
    run_dir: Path, tmp_path: Path, capsys, damage, message, command
) -> None:
    data = _tokens(tmp_path / "held.bin", np.arange(200, dtype=np.uint16) % 128)
    damage(run_dir)
    out = tmp_path / "out"
    argv = {
        "evaluate": ["evaluate", str(run_dir), "--data", str(data)],
        "export": ["export", str(run_dir), str(out)],
    }[command]
    _refused(capsys, argv, message)
    assert not out.exists()


@pytest.mark.parametrize(
    ("values", "flags", "message"),
    [
        pytest.param(
            np.zeros(0, dtype=np.uint16), [], r"held.bin': 0 tokens, need at least 17", id="empty"
        ),
        pytest.param(
            np.full(200, -1, dtype=np.int32),
            ["--data-dtype", "int32"],
            r"held.bin': token id -1 is negative; ids must be in \[0, 128\)",
            id="negative-id",
        ),
        pytest.param(
            np.zeros(200, dtype=np.uint16),
            ["--data-dtype", "float32"],
            r"data.dtype = 'float32': valid values are uint16, int32, int64",
            id="dtype-float32",
        ),
        pytest.param(
            np.zeros(200, dtype=np.uint16),
            ["--data-dtype", "foo"],
            r"data.dtype = 'foo': valid values are uint16, int32, int64",
            id="dtype-unknown",
        ),
    ],
)
def test_evaluate_refuses_a_bad_token_file_naming_it(
    run_dir: Path, tmp_path: Path, capsys, values, flags, message
) -> None:
    data = _tokens(tmp_path / "held.bin", values)
    _refused(capsys, ["evaluate", str(run_dir), "--data", str(data), *flags], message)


@pytest.mark.parametrize("below", ["file", "file/deeper"])
def test_export_into_a_path_a_file_blocks_is_refused(
    run_dir: Path, tmp_path: Path, capsys, below: str
) -> None:
    (tmp_path / "file").write_text("")
    out = tmp_path / below / "out"
    _refused(capsys, ["export", str(run_dir), str(out)], r"/file' is not a directory")


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        pytest.param(_job([1, 2]), r"job.json' does not describe a job \(TypeError", id="list"),
        pytest.param(
            _job({"run_id": "x", "endpoints": {}}),
            r"job.json' does not describe a job \(KeyError: 'config'\)",
            id="without-config",
        ),
    ],
)
def test_resume_refuses_a_run_whose_job_json_is_not_a_job(
    run_dir: Path, capsys, damage, message
) -> None:
    damage(run_dir)
    _refused(capsys, ["train", "--resume", str(run_dir), "--profile", "off"], message)


@pytest.fixture
def tp_run(tmp_path: Path) -> Path:
    """A dp1 x pp2 x tp2 run that stopped: both members wrote their pieces of steps 1 and
    3, only member 0 of step 5 (pieces of no training: --resume reads their manifests)."""
    run = tmp_path / "tp_run"
    run.mkdir()
    job = JobConfig(layout=LayoutConfig(dp=1, pp=2, tp=2))
    JobSpec(run_id="tp", config=job, endpoints=ENDPOINTS).write(run)
    layers = range(job.model.num_layers)
    pieces = {i: {"numel": 4, "lo": 0, "hi": 4, "state": torch.zeros(3, 4)} for i in layers}
    for step, members in ((1, 2), (3, 2), (5, 1)):
        for member in range(members):
            write_pieces(run, step, 0, pieces, member=member, tp=2)
    return run


def test_resume_of_a_tp_run_starts_from_the_latest_step_every_member_wrote(tp_run: Path):
    *_, resume = _resume_sources(tp_run, None)
    assert resume == {
        "state": {"resume_dir": str(tp_run.resolve()), "resume_step": 3, "resume_tp": 2}
    }


def test_a_tp_job_whose_core_is_lost_names_the_resume_of_its_latest_checkpoint(tp_run: Path):
    host = JobHost(JobSpec.read(tp_run).config, tp_run, None)
    assert host._resume() == f"resume from the checkpoint of step 3 with --resume {tp_run}"


def test_resume_of_a_tp_run_with_another_tp_is_refused_naming_both(tp_run: Path, capsys):
    before = sorted(tp_run.rglob("*"))
    message = (
        r"--resume '.*tp_run': its checkpoint of step 3 was written with tp = 2, not 1; "
        r"resume it with --tp 2 \(any --dp/--pp\)$"
    )
    _refused(capsys, ["train", "--resume", str(tp_run), "--tp", "1"], message)
    assert sorted(tp_run.rglob("*")) == before


def test_training_into_a_stopped_tp_run_is_refused_naming_its_checkpoint(tp_run: Path):
    with pytest.raises(ValueError, match=r"with a complete checkpoint of step 3: continue it"):
        _refuse_unfinished(tp_run, resuming=None)
