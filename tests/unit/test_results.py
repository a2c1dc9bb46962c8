"""What a run leaves behind, typed: summary.json and the workers' results written and read
back through one module, byte for byte; older summaries read, newer ones refused, a
malformed one named."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from elaswave.engine.migration import MigrationDecision, MigrationMode
from elaswave.engine.record import MigrationRecord, Streamed
from elaswave.runtime.job.results import (
    BusCounts,
    Layout,
    Summary,
    Trace,
    WorkerResult,
    read_summary,
    read_worker_results,
    write_summary,
    write_worker_result,
)
from tests.unit.test_record import sample_record

RECORD = sample_record(
    migration=MigrationRecord(
        decision=MigrationDecision(
            mode=MigrationMode.NONBLOCKING, layers=(2,), early_micro_batches=2
        ),
        streamed=Streamed(bytes_streamed=1024, waited_s=0.01),
    ),
    phases=dataclasses.replace(sample_record().phases, redo=0.1),
)
SUMMARY = Summary(
    layout=Layout(dp=2, pp=2, tp=1),
    global_batch=16,
    steps_completed=8,
    loss=(4.8, 4.7),
    step_time_s=(0.5, 0.25),
    samples_per_s=42.0,
    param_digest="ab" * 32,
    events=120,
    recoveries=(RECORD,),
    device="cpu",
    timing="measured",
    first_step=6,
    predicted_step_s=None,
    bus=BusCounts(core={"asked": 1}, workers={"asked": 2}),
    core_incarnations=1,
)
RESULT = WorkerResult(
    rank=3,
    stage=1,
    replica=1,
    step_time_s=(0.5, 0.25),
    loss=(4.8, 4.7),
    loss_steps=(6, 7),
    traces=(Trace(step=6, actions=(("F", 0), ("B", 0))),),
    optimizer_shard_numel=10,
    stage_param_numel=40,
    optimizer_digests=("x", "y"),
    snapshot_digests={0: ("x", "y")},
    generation=1,
    first_step=6,
    bus={"asked": 0},
    cpu_s=1.5,
    snapshot_cpu_s=0.1,
)


def test_a_summary_reads_back_equal_and_is_written_as_the_contract_says(tmp_path: Path) -> None:
    write_summary(tmp_path, SUMMARY)
    assert read_summary(tmp_path) == SUMMARY
    doc = json.loads((tmp_path / "summary.json").read_text())
    assert list(doc)[:3] == ["layout", "global_batch", "steps_completed"]
    assert doc["schema_version"] == Summary.SCHEMA
    assert doc["recoveries"][0]["migration"] == {
        "mode": "nonblocking", "layers": [2], "early_micro_batches": 2,
        "bytes_streamed": 1024, "waited_s": 0.01,
    }  # fmt: skip
    assert doc["recoveries"][0]["phases"]["redo"] == 0.1 and doc["layout"] == {
        "dp": 2,
        "pp": 2,
        "tp": 1,
    }


def test_a_summary_of_an_older_file_reads(tmp_path: Path) -> None:
    write_summary(tmp_path, SUMMARY)
    doc = json.loads((tmp_path / "summary.json").read_text())
    del doc["schema_version"], doc["core_incarnations"]  # as a host wrote it, before versions
    (tmp_path / "summary.json").write_text(json.dumps(doc))
    old = read_summary(tmp_path)
    assert old.core_incarnations is None and old.recoveries == SUMMARY.recoveries


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda d: d.update(schema_version=2),
            "a summary of schema 2; this ElasWave reads schema 1",
        ),
        (lambda d: d.pop("loss"), "missing fields ['loss']"),
        (lambda d: d.update(global_batch="16"), "global_batch: expected int"),
    ],
)
def test_a_newer_or_malformed_summary_is_named(tmp_path: Path, edit, message: str) -> None:
    write_summary(tmp_path, SUMMARY)
    doc = json.loads((tmp_path / "summary.json").read_text())
    edit(doc)
    (tmp_path / "summary.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"summary\.json") as info:
        read_summary(tmp_path)
    assert message in str(info.value)


def test_a_missing_summary_says_so(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist: the run has no summary"):
        read_summary(tmp_path)


def test_worker_results_read_back_equal(tmp_path: Path) -> None:
    write_worker_result(tmp_path, RESULT)
    assert read_worker_results(tmp_path) == [RESULT]
    doc = json.loads((tmp_path / "workers" / "rank3.json").read_text())
    assert doc["snapshot_digests"] == {"0": ["x", "y"]}
    assert doc["traces"] == [{"step": 6, "actions": [["F", 0], ["B", 0]], "times": []}]
    del doc["traces"][0]["times"], doc["pipeline_s"]  # as results before them were written
    (tmp_path / "workers" / "rank3.json").write_text(json.dumps(doc))
    assert read_worker_results(tmp_path) == [RESULT]
