"""The job's settings in sections: each setting has its flag and its TOML key, and a
job reads the same from flags, a flat [train] table, the section tables and job.json
(its own shape, and the flat one of runs from before the sections)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing

import pytest

from elaswave.cli.config_file import build_job, load_toml
from elaswave.cli.flags import add_job_flags, job_values
from elaswave.cli.main import main
from elaswave.comm.spec import Device
from elaswave.engine.migration import MigrationMode
from elaswave.engine.rebalance import Policy
from elaswave.model.config import RngKind
from elaswave.runtime.job.config import Endpoints, JobConfig, JobSpec
from elaswave.runtime.job.sections import SECTION_OF, SECTIONS, Partition, Precision
from elaswave.runtime.job.setting import flag_of, settings_of

SAMPLE = {
    "layout": {
        "dp": 2,
        "pp": 3,
        "tp": 1,
        "world_size": 6,
        "ranks_per_node": 3,
        "nnodes": 2,
        "rdzv_endpoint": "127.0.0.1:29599",
        "device": "emulated",
        "partition": "balanced",
        "worker_prefix": "nice -n 1",
    },
    "schedule": {
        "steps": 12,
        "global_batch": 12,
        "micro_batch": 2,
        "seed": 7,
        "precision": "bf16",
        "rng": "stateful",
        "pipeline_schedule": "zb-h1",
        "trace_steps": 3,
        "eval_every": 4,
        "eval_batches": 2,
        "script": ["train.py", "--lr", "0.1"],
    },
    "elastic": {
        "recovery": False,
        "rebalance": "migrate",
        "migration": "blocking",
        "migration_early": 1,
        "straggler_detection": True,
        "straggler_window": 4,
        "straggler_threshold": 1.5,
        "straggler_min_steps": 3,
        "wait_for_nodes_s": 5.0,
        "shorten_after_wait": False,
        "max_restarts": 3,
        "reform": True,
    },
    "liveness": {
        "heartbeat_interval_s": 0.5,
        "heartbeat_timeout_s": 4.0,
        "plan_ack_timeout_s": 6.0,
        "comm_timeout_s": 30.0,
        "core_restarts": 2,
        "core_restart_delay_s": 1.0,
        "core_outage_s": 20.0,
        "health_log_mib": 64,
    },
    "state": {
        "snapshots": False,
        "snapshot_copies": 2,
        "verify_snapshots": True,
        "checkpoint_every": 2,
        "restore_in_job": False,
        "resume_dir": "/runs/before",
        "resume_step": 3,
        "resume_tp": 1,
    },
    "network": {"bus_host": "192.0.2.2", "bus_keys": "/keys"},
    "injection": {"faults": ["kill:1@4", "join@6"], "bus_faults": "drop=0.1,seed=3"},
}
"""A value other than the default for every setting, valid together."""

FLAGS = [
    *("--dp", "2", "--pp", "3", "--tp", "1", "--world-size", "6", "--nproc-per-node", "3"),
    *("--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29599", "--device", "emulated"),
    *("--partition", "balanced", "--worker-prefix", "nice -n 1"),
    *("--steps", "12", "--global-batch", "12", "--micro-batch", "2", "--seed", "7"),
    *("--precision", "bf16", "--rng", "stateful", "--schedule", "zb-h1", "--trace-steps", "3"),
    *("--eval-every", "4", "--eval-batches", "2"),
    *("--no-recovery", "--rebalance", "migrate", "--migration", "blocking"),
    *("--migration-early", "1", "--straggler-detection", "--straggler-window", "4"),
    *("--straggler-threshold", "1.5", "--straggler-min-steps", "3", "--wait-for-nodes", "5"),
    "--no-shorten-after-wait",
    *("--max-restarts", "3"),
    "--reform",
    *("--heartbeat-interval", "0.5", "--heartbeat-timeout", "4", "--plan-ack-timeout", "6"),
    *("--comm-timeout", "30", "--core-restarts", "2", "--core-restart-delay", "1"),
    *("--core-outage", "20", "--health-log-mib", "64", "--no-snapshots", "--snapshot-copies", "2"),
    *("--verify-snapshots", "--checkpoint-every", "2", "--no-restore-in-job"),
    *("--bus-host", "192.0.2.2", "--bus-keys", "/keys"),
    *("--fault", "kill:1@4", "--fault", "join@6", "--bus-faults", "drop=0.1,seed=3"),
]
"""SAMPLE as flags, but for the settings other arguments set (SET_BY)."""

SET_BY = {
    "schedule": {"script": ["train.py", "--lr", "0.1"]},
    "state": {"resume_dir": "/runs/before", "resume_step": 3, "resume_tp": 1},
}
"""What ``elaswave run SCRIPT`` and ``--resume`` set."""


def _toml(tables: dict[str, dict[str, object]]) -> str:
    return "".join(
        f"[{name}]\n" + "".join(f"{key} = {json.dumps(value)}\n" for key, value in body.items())
        for name, body in tables.items()
    )


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_job_flags(parser)
    return parser.parse_args(list(argv))


SETTERS = {"--resume RUN_DIR": "--resume", "elaswave run SCRIPT [ARGS]": "run"}
"""The arguments that set the settings without a flag of their own, and the word of
each that ``--help`` lists."""


def _help_words(*argv: str, capsys: pytest.CaptureFixture[str]) -> set[str]:
    with pytest.raises(SystemExit):
        main(list(argv))
    return {word.strip("[],{}") for word in capsys.readouterr().out.split()}


def test_every_setting_has_a_flag_or_the_argument_that_sets_it(capsys):
    listed = _help_words("train", "--help", capsys=capsys)
    commands = _help_words("--help", capsys=capsys)
    for section in SECTIONS.values():
        for f, spec in settings_of(section):
            assert spec.help, f.name
            flag = flag_of(f)
            if flag is None:
                setter = SETTERS[spec.set_by or ""]
                assert setter in listed or setter in commands, f.name
                continue
            assert flag in listed, flag
            assert all(alias.flag in listed for alias in spec.aliases), flag
    given = {key for body in SAMPLE.values() for key in body}
    assert given == set(SECTION_OF), "SAMPLE sets every setting"


def test_elaswave_run_lists_the_same_flags(capsys):
    train = _help_words("train", "--help", capsys=capsys)
    run = _help_words("run", "--help", capsys=capsys)
    assert {w for w in train if w.startswith("--")} <= run


def test_setting_names_are_unique_across_sections():
    names = [f.name for s in SECTIONS.values() for f in dataclasses.fields(s)]
    assert len(names) == len(set(names)) == len(SECTION_OF)
    assert set(SECTIONS) == {f.name for f in dataclasses.fields(JobConfig)} - {
        "model",
        "data",
        "optim",
        "profile",
    }


def test_flat_train_table_sections_and_flags_make_the_same_job(tmp_path):
    flat = tmp_path / "flat.toml"
    flat.write_text(_toml({"train": {k: v for body in SAMPLE.values() for k, v in body.items()}}))
    tables = tmp_path / "sections.toml"
    tables.write_text(_toml(SAMPLE))
    from_flat = build_job(load_toml(flat))
    from_tables = build_job(load_toml(tables))
    from_flags = build_job(job_values(_parse(*FLAGS)), SET_BY)
    assert from_flat == from_tables == from_flags
    assert from_flags != JobConfig()
    for name, body in SAMPLE.items():
        section = getattr(from_flags, name)
        for key, value in body.items():
            want = tuple(value) if isinstance(value, list) else value
            assert getattr(section, key) == want, (name, key)


def test_flags_not_given_leave_the_file_values(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(_toml({"train": {"dp": 4, "steps": 3}, "liveness": {"core_restarts": 1}}))
    job = build_job(load_toml(path), job_values(_parse("--pp", "3")))
    assert (job.layout.dp, job.layout.pp, job.schedule.steps) == (4, 3, 3)
    assert job.liveness.core_restarts == 1
    assert job.state.snapshots and not job.state.verify_snapshots
    assert job.elastic.recovery and job.elastic.straggler_detection is None


def test_choices_become_their_vocabularies():
    job = build_job({"train": {"device": "emulated", "rng": "stateful", "precision": "bf16"}})
    assert job.layout.device is Device.EMULATED and job.schedule.rng is RngKind.STATEFUL
    assert job.schedule.precision is Precision.BF16 and job.layout.partition is Partition.EVEN
    assert job.elastic.rebalance is Policy.RESIZE
    assert job.elastic.migration is MigrationMode.NONBLOCKING
    with pytest.raises(ValueError, match=r"\[train\] rebalance = 3: expected str"):
        build_job({"train": {"rebalance": 3}})
    with pytest.raises(ValueError, match="partition = 'random': valid values are even, balanced"):
        build_job({"layout": {"partition": "random"}})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[train]\ndp = 2\n[layout]\ndp = 3", r"\[train\] dp and \[layout\] dp: give the setting"),
        ("[layout]\nsteps = 2", r"unknown key \[layout\] 'steps'; valid keys: dp, pp, tp"),
        ("[schedule]\nsteps = 2.5", r"\[schedule\] steps = 2.5: expected int"),
        ("[injection]\nfaults = 'kill:1@2'", "expected an array of strings"),
    ],
)
def test_section_tables_are_checked(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        build_job(load_toml(path))


def _spec(config: JobConfig) -> JobSpec:
    return JobSpec(
        run_id="r1",
        config=config,
        endpoints=Endpoints(store_host="127.0.0.1", store_port=1, bus_publish="", bus_subscribe=""),
    )


def test_job_json_round_trips_in_sections(tmp_path):
    config = build_job(SAMPLE)
    _spec(config).write(tmp_path)
    doc = json.loads((tmp_path / "job.json").read_text())
    assert "train" not in doc["config"]
    assert doc["config"]["layout"]["device"] == "emulated"
    assert doc["config"]["elastic"]["rebalance"] == "migrate"
    assert JobSpec.read(tmp_path) == _spec(config)


def test_job_json_of_a_run_before_sections_still_reads(tmp_path):
    """A run directory written before the sections: every setting flat in ``train``."""
    config = build_job(SAMPLE)
    doc = json.loads(json.dumps({"run_id": "r1", "config": config.to_dict()}))
    doc["config"]["train"] = {
        key: value for name in SECTIONS for key, value in doc["config"].pop(name).items()
    }
    doc["endpoints"] = dataclasses.asdict(_spec(config).endpoints)
    (tmp_path / "job.json").write_text(json.dumps(doc))
    assert JobSpec.read(tmp_path).config == config
    doc["config"]["train"]["dpp"] = 2
    (tmp_path / "job.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"unknown key \[train\] 'dpp'"):
        JobSpec.read(tmp_path)


def test_section_fields_are_typed():
    """Every setting's type is one the flags and the TOML loader read."""
    readable = {int, float, bool, str, int | None, float | None, bool | None, str | None}
    for section in SECTIONS.values():
        for name, hint in typing.get_type_hints(section).items():
            choice = isinstance(hint, type) and issubclass(hint, str)
            assert hint in readable or choice or hint == tuple[str, ...], (section, name)
