"""The report's pure part: a summary.json document to plan rows, changes, throughput and
printed lines; malformed documents named by file and field. Drawing is checked once,
when matplotlib is installed."""

from __future__ import annotations

import copy
import json
import math
import sys
from types import SimpleNamespace

import pytest

from elaswave.bus.schema import StepCompleted, StragglerDetected
from elaswave.cli.report import (
    PLOT_EXTRA,
    StageRow,
    build_report,
    change_words,
    load_report,
    render,
    straggler_verdicts,
    throughput,
    timeline,
)
from elaswave.runtime.job.config import JobConfig
from elaswave.runtime.job.results import Trace
from tests.png import read_png

INITIAL = {
    "generation": 0,
    "stages": [
        {"layers": [0, 3], "ranks": [0, 1], "sizes": [2, 2], "mhz": None},
        {"layers": [3, 6], "ranks": [2, 3], "sizes": [2, 2], "mhz": None},
    ],
}


def _summary(**changes) -> dict:
    doc = {
        "layout": {"dp": 2, "pp": 2, "tp": 1},
        "global_batch": 16,
        "steps_completed": 4,
        "step_time_s": [0.5, 0.25, 0.4, 0.2],
        "recoveries": [
            {
                "step": 2,
                "kind": "fail-stop",
                "ranks": [1],
                "mttr_s": 0.5,
                "bytes_moved": 1024,
                "plan": {
                    "generation": 1,
                    "stages": [
                        {"layers": [0, 2], "ranks": [0], "sizes": [4], "mhz": None},
                        {"layers": [2, 6], "ranks": [2, 3], "sizes": [2, 2], "mhz": None},
                    ],
                },
            },
            {
                "step": 3,
                "kind": "join",
                "ranks": [4],
                "plan": {
                    "generation": 2,
                    "stages": [
                        {"layers": [0, 3], "ranks": [0, 4], "sizes": [2, 2], "mhz": 1650.0},
                        {"layers": [3, 6], "ranks": [2, 3], "sizes": [2, 2], "mhz": None},
                    ],
                },
            },
        ],
        "device": "emulated",
        "timing": "emulated",
        "first_step": 0,
    }
    doc.update(changes)
    return doc


def test_plans_before_and_after_each_change():
    report = build_report(_summary(), INITIAL, run_name="r")
    assert [p.label for p in report.plans] == ["initial", "step 2: fail-stop r1", "step 3: join r4"]
    assert [p.layer_text for p in report.plans] == [
        "[0,3) [3,6)",
        "[0,2) [2,6)",
        "[0,3) [3,6)",
    ]
    stop, join = report.changes
    assert stop.before is report.plans[0] and stop.after is report.plans[1]
    assert join.before is report.plans[1] and join.after is report.plans[2]
    assert stop.label == "fail-stop r1 → shrink + resize + migrate"
    assert join.label == "join r4 → grow + resize + migrate + dvfs"
    assert report.plans[2].stages[0].dp == 2 and report.plans[2].stages[0].mhz == 1650.0


def test_printed_lines_name_step_kind_ranks_and_layers():
    lines = build_report(_summary(), INITIAL, run_name="r").lines()
    assert lines[0].startswith("elaswave: report of r: 4 steps (steps 0-3), ")
    assert "EMULATED timings, 2 plan change(s)" in lines[0]
    assert lines[1] == "initial plan: layers [0,3) [3,6); dp 2 2"
    assert lines[2] == (
        "step 2: fail-stop ranks [1]: layers [0,3) [3,6) → [0,2) [2,6); dp 2 2 → 1 2 "
        "(shrink + resize + migrate; 1024 bytes moved; MTTR 0.50 s)"
    )
    assert lines[3] == (
        "step 3: join ranks [4]: layers [0,2) [2,6) → [0,3) [3,6); dp 1 2 → 2 2; "
        "MHz base base → 1650 base (grow + resize + migrate + dvfs)"
    )
    assert len(lines) == 4


def _scheduled() -> tuple[dict, dict]:
    summary = _summary()
    summary["recoveries"][0]["plan"]["schedule"] = "zb-cost"
    summary["recoveries"][1]["plan"]["schedule"] = "zb-cost"
    return summary, {**INITIAL, "schedule": "1f1b"}


def test_printed_lines_name_each_plans_schedule_and_its_changes():
    report = build_report(*_scheduled(), run_name="r")
    assert [p.schedule for p in report.plans] == ["1f1b", "zb-cost", "zb-cost"]
    lines = report.lines()
    assert lines[1] == "initial plan: layers [0,3) [3,6); dp 2 2; schedule 1f1b"
    assert "dp 2 2 → 1 2; schedule 1f1b → zb-cost (shrink" in lines[2]
    assert "MHz base base → 1650 base; schedule zb-cost (grow" in lines[3]


def test_throughput_is_global_batch_over_step_time_from_the_first_step():
    steps, rates = throughput([0.5, 0.25, 0.0], 16, first_step=10)
    assert steps == (10, 11, 12)
    assert rates[:2] == (32.0, 64.0) and math.isnan(rates[2])
    report = build_report(_summary(first_step=7), INITIAL, run_name="r")
    assert report.steps == (7, 8, 9, 10)
    assert report.samples_per_s == (32.0, 64.0, 40.0, 80.0)
    assert report.mean_samples_per_s == pytest.approx(16 * 4 / (0.5 + 0.25 + 0.4 + 0.2))


def test_measured_runs_are_not_labelled_emulated():
    emulated = build_report(_summary(), INITIAL, run_name="r")
    measured = build_report(_summary(device="cpu", timing="measured"), INITIAL, run_name="r")
    assert emulated.title.endswith("EMULATED timings")
    assert "EMULATED" not in measured.title and "EMULATED" not in "\n".join(measured.lines())
    legacy = _summary()
    del legacy["timing"]  # a summary without the key: the device decides
    assert build_report(legacy, INITIAL, run_name="r").emulated


@pytest.mark.parametrize(
    ("before", "after", "words"),
    [
        ([((0, 3), (0, 1), (2, 2))], [((0, 3), (0, 1), (2, 2))], []),
        ([((0, 3), (0, 1), (2, 2))], [((0, 3), (0, 1), (1, 3))], ["resize"]),
        ([((0, 3), (0,), (4,)), ((3, 6), (1,), (4,))], [((0, 2), (0,), (4,)), ((2, 6), (1,), (4,))],
         ["migrate"]),
        ([((0, 3), (0, 1), (2, 2))], [((0, 3), (0,), (4,))], ["shrink", "resize"]),
        ([((0, 3), (0,), (4,))], [((0, 3), (0, 5), (2, 2))], ["grow", "resize"]),
    ],
)  # fmt: skip
def test_change_words(before, after, words):
    rows = [[StageRow(*s) for s in plan] for plan in (before, after)]
    assert change_words(*rows) == words
    clocked = [StageRow(s.layers, s.ranks, s.sizes, 1200.0) for s in rows[1]]
    assert change_words(rows[1], clocked) == ["dvfs"]


def test_straggler_verdicts_come_from_the_event_log_only():
    events = [
        StepCompleted(sender="r0", rank=0, step=6, loss=1.0, step_time_s=0.1, samples=16),
        StragglerDetected(sender="core", step=7, ranks=[2], factors=[2.0]),
        StragglerDetected(sender="core", step=15, ranks=[], factors=[], recovered=[2]),
    ]
    first, second = straggler_verdicts(events)
    assert (first.step, first.label) == (7, "straggler r2 ×2")
    assert (second.step, second.label) == (15, "straggler r2 normal again")
    report = build_report(_summary(), INITIAL, run_name="r", events=events)
    assert [v.step for v in report.verdicts] == [7, 15]


def _without(path: list) -> dict:
    doc = _summary()
    *parents, last = path
    node = doc
    for key in parents:
        node = node[key]
    del node[last]
    return doc


def _with(path: list, value) -> dict:
    doc = _summary()
    *parents, last = path
    node = doc
    for key in parents:
        node = node[key]
    node[last] = value
    return doc


@pytest.mark.parametrize(
    ("summary", "message"),
    [
        ([1, 2], "the document is not a JSON object"),
        (_without(["step_time_s"]), "step_time_s is missing"),
        (_with(["step_time_s"], [0.1, "x"]), "step_time_s should be a list of numbers"),
        (_with(["global_batch"], "16"), "global_batch should be int, not str"),
        (_with(["global_batch"], 0), "global_batch = 0: must be positive"),
        (_with(["recoveries"], {}), "recoveries should be list, not dict"),
        (_without(["recoveries", 0, "plan"]), "recoveries[0].plan is missing"),
        (_without(["recoveries", 1, "step"]), "recoveries[1].step is missing"),
        (_with(["recoveries", 0, "ranks"], [1.5]), "recoveries[0].ranks should be a list of"),
        (
            _with(["recoveries", 0, "plan", "stages", 1, "layers"], [4, 2]),
            "recoveries[0].plan.stages[1].layers [4, 2] is not a layer range",
        ),
        (
            _with(["recoveries", 0, "plan", "stages", 0, "layers"], [0]),
            "recoveries[0].plan.stages[0].layers should be a list of 2 integers",
        ),
        (_with(["recoveries", 0, "plan", "stages"], []), "recoveries[0].plan.stages is empty"),
        (
            _with(["recoveries", 1, "plan", "stages", 0, "mhz"], "fast"),
            "recoveries[1].plan.stages[0].mhz should be int or float",
        ),
        (
            _with(["recoveries", 0, "plan", "schedule"], "fast"),
            "recoveries[0].plan.schedule 'fast' (known: 1f1b, zb-h1, zb-cost)",
        ),
        (
            _with(["recoveries", 1, "plan", "schedule"], 2),
            "recoveries[1].plan.schedule should be str, not int 2",
        ),
    ],
)
def test_malformed_summary_is_named_by_file_and_field(summary, message):
    with pytest.raises(ValueError, match=r"^'x/summary\.json': ") as info:
        build_report(copy.deepcopy(summary), INITIAL, run_name="r", source="'x/summary.json'")
    assert message in str(info.value)


def _run_dir(tmp_path, summary: dict | None = None):
    run = tmp_path / "run"
    run.mkdir()
    (run / "job.json").write_text(json.dumps({"config": JobConfig().to_dict()}))
    if summary is not None:
        (run / "summary.json").write_text(json.dumps(summary))
    return run


def test_load_report_takes_the_initial_plan_from_job_json(tmp_path):
    report = load_report(_run_dir(tmp_path, _summary()))
    assert report.run_name == "run"
    assert report.plans[0].layer_text == "[0,3) [3,6)"  # the default tiny model, pp 2
    assert report.plans[0].dp_text == "2 2"
    assert report.plans[0].schedule == JobConfig().plan().schedule.value
    assert report.verdicts == ()  # no events.log: no verdicts, not an error


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (
            lambda run: (run / "summary.json").unlink(),
            "no summary.json in .*: the job is still running or did not finish",
        ),
        (
            lambda run: [(run / name).unlink() for name in ("summary.json", "job.json")],
            "is not a run directory",
        ),
        (lambda run: (run / "summary.json").write_text('{"global'), "summary.json' is corrupt"),
        (lambda run: (run / "summary.json").write_text(""), r"not valid JSON \(empty\)"),
        (lambda run: (run / "summary.json").write_bytes(b"\xff\xfe"), "not UTF-8 text"),
        (lambda run: (run / "job.json").write_text("{}"), "job.json' is corrupt: it has no"),
        (
            lambda run: (run / "job.json").write_text('{"config": {"train": {"dp": 0}}}'),
            r"job.json' is corrupt: its config is invalid \(dp = 0",
        ),
        (lambda run: (run / "events.log").write_bytes(b"\xc1" * 8), "events.log' is corrupt"),
        (
            lambda run: (run / "summary.json").write_text(
                json.dumps({**json.loads((run / "summary.json").read_text()), "first_step": -3})
            ),
            "summary.json': first_step = -3: must be >= 0",
        ),
    ],
)
def test_load_report_bad_run_dirs(tmp_path, setup, message):
    run = _run_dir(tmp_path, _summary())
    setup(run)
    with pytest.raises(ValueError, match=message):
        load_report(run)


def test_render_writes_a_png_labelled_emulated(tmp_path):
    pytest.importorskip("matplotlib")
    events = [StragglerDetected(sender="core", step=1, ranks=[2], factors=[2.0])]
    report = build_report(_summary(), INITIAL, run_name="r", events=events)
    out = tmp_path / "report.png"
    render(report, out)
    png = read_png(out)
    assert 400 <= png.width <= 4000 and 300 <= png.height <= 4000
    assert "EMULATED timings" in png.text["Title"]
    assert png.text["Description"] == "\n".join(report.lines())


def test_render_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ImportError
    report = build_report(_summary(), INITIAL, run_name="r")
    with pytest.raises(ValueError, match="matplotlib is not installed") as info:
        render(report, tmp_path / "report.png")
    assert PLOT_EXTRA in str(info.value)
    assert not (tmp_path / "report.png").exists()


def test_the_timeline_is_each_ranks_last_timed_trace_by_stage():
    """Each rank's last traced step with times, stage by stage; traces without times
    (results written before they were recorded) are left out."""

    def result(rank, stage, traces):
        return SimpleNamespace(rank=rank, stage=stage, traces=traces)

    acts = (("F", 0), ("I", 0), ("W", 0))
    timed = Trace(step=1, actions=acts, times=((0.0, 0.1), (0.1, 0.2), (0.2, 0.3)))
    rows = timeline([
        result(2, 1, (Trace(step=0, actions=acts), timed)),
        result(0, 0, (timed,)),
        result(1, 0, (Trace(step=1, actions=acts),)),
    ])  # fmt: skip
    assert [(r.rank, r.stage, r.step) for r in rows] == [(0, 0, 1), (2, 1, 1)]
    assert rows[0].actions == (("F", 0, 0.0, 0.1), ("I", 0, 0.1, 0.2), ("W", 0, 0.2, 0.3))
