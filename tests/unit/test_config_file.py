import pytest

from elaswave.cli.config_file import build_job, load_toml


def test_toml_and_overrides_merge(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(
        '[model]\npreset = "tiny"\nnum_blocks = 2\n[train]\ndp = 4\npp = 2\nsteps = 3\n'
    )
    job = build_job(load_toml(path), {"train": {"dp": 2, "steps": None}})
    assert (job.layout.dp, job.layout.pp, job.schedule.steps) == (2, 2, 3)
    assert job.model.num_layers == 4


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[train\ndp = 2", "not valid TOML"),
        ("[trian]\ndp = 2", r"unknown section \[trian\]"),
        ("[train]\ndpp = 2", "unknown key .*'dpp'.*valid keys"),
        ('[train]\ndp = "two"', "dp = 'two': expected int"),
        ("[train]\ndp = 2\npp = 7", "pp = 7 stages but the model has only 6 layers"),
        ('[train]\ndevice = "tpu"', "unknown device 'tpu'; valid devices: cpu, cpu-strict"),
        ('[model]\npreset = "gpt5"', "unknown model preset 'gpt5'"),
        ("[train]\nwait_for_nodes_s = -5", "wait_for_nodes_s = -5: must be from 0 to 86400"),
        ("[data]\nseed = -5", r"data.seed = -5: must be >= 0"),
        ("[optim]\nlr = inf", r"optim.lr = inf: must be a positive finite number"),
    ],
)
def test_bad_config_files_name_the_value(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        build_job(load_toml(path))


def test_world_size_must_match_layout():
    with pytest.raises(ValueError, match="world size 6 != dp x pp x tp = 2 x 2 x 1 = 4"):
        build_job(None, {"train": {"dp": 2, "pp": 2, "world_size": 6}})


def test_heartbeat_and_rng_settings_are_validated():
    with pytest.raises(ValueError, match=r"heartbeat interval 2\.0 s must be positive and below"):
        build_job(None, {"train": {"heartbeat_interval_s": 2.0, "heartbeat_timeout_s": 1.0}})
    with pytest.raises(ValueError, match="rng = 'mersenne': valid values are counter, stateful"):
        build_job(None, {"train": {"rng": "mersenne"}})
