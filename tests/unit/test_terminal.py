"""What ``elaswave train`` shows a person: the progress line, the lines of a change of
plan, the log records a person must see, and the relay of the Core's log."""

from __future__ import annotations

import io
import json
import sys

import pytest
import structlog

from elaswave import logs
from elaswave.bus.schema import (
    CheckpointRequest,
    FailureDetected,
    RecoveryFinished,
    RecoveryPlan,
    RunFinished,
    StepCompleted,
    WaitingForNodes,
)
from elaswave.cli import terminal
from elaswave.cli.terminal import Progress, change_line, layout_text, log_line
from elaswave.engine.change import initial_state, state_to_json
from elaswave.engine.plan import Plan, StagePlan


class _Stream(io.StringIO):
    def __init__(self, *, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def _plan(generation: int = 1) -> Plan:
    return Plan(
        generation=generation,
        global_batch=16,
        num_micro_batches=4,
        stages=(
            StagePlan(stage=0, layer_start=0, layer_stop=3, ranks=(0,), sizes=(4,)),
            StagePlan(stage=1, layer_start=3, layer_stop=6, ranks=(2, 3), sizes=(2, 2)),
        ),
    )


def _step(step: int) -> StepCompleted:
    return StepCompleted(sender="rank2", rank=2, step=step, loss=4.0, step_time_s=0.5, samples=16)


KILL = FailureDetected(
    sender="core", ranks=[1], source="process-exit", detail="rank 1 exited with signal SIGKILL"
)
RECOVERED = RecoveryFinished(
    sender="core", generation=1, step=6, kind="fail-stop", ranks=[1], mttr_s=0.2346
)


@pytest.fixture(autouse=True)
def _fresh_screen(monkeypatch):
    monkeypatch.setattr(terminal, "SCREEN", terminal.Screen())


def test_on_a_terminal_a_recovery_gets_its_own_lines_off_the_progress_line(tmp_path):
    (tmp_path / "core_state.json").write_text(json.dumps(state_to_json(initial_state(_plan()))))
    out = _Stream(tty=True)
    progress = Progress(8, run_dir=tmp_path, stream=out)
    for event in (_step(5), KILL, _step(6), RECOVERED, _step(7)):
        progress(event)
    assert out.getvalue() == (
        "\rstep    6/8  loss 4.0000      32.0 samples/s\n"
        "elaswave: step 6: rank 1 failed: rank 1 exited with signal SIGKILL\n"
        "\rstep    7/8  loss 4.0000      32.0 samples/s\n"
        "elaswave: step 6: recovered rank 1 in 235 ms; now 3 ranks in 2 stages: "
        "stage 0 = rank 0 on layers 0-2; stage 1 = ranks 2, 3 on layers 3-5\n"
        "\rstep    8/8  loss 4.0000      32.0 samples/s\n"
    )


def test_without_a_terminal_only_the_step_lines_are_printed(tmp_path):
    out = _Stream(tty=False)
    progress = Progress(8, emulated=True, run_dir=tmp_path, stream=out)
    for event in (_step(5), KILL, _step(6), RECOVERED):
        progress(event)
    assert out.getvalue() == (
        "step    6/8  loss 4.0000      32.0 samples/s (emulated)\n"
        "step    7/8  loss 4.0000      32.0 samples/s (emulated)\n"
    )


def test_a_stopped_job_ends_the_progress_line_for_the_cli_to_say_why():
    out = _Stream(tty=True)
    progress = Progress(8, stream=out)
    progress(_step(2))
    progress(RunFinished(sender="core", steps_completed=0, ok=False, reason="lost"))
    assert out.getvalue() == "\rstep    3/8  loss 4.0000      32.0 samples/s\n"


def test_the_layout_is_left_out_when_the_core_holds_another_generation(tmp_path):
    (tmp_path / "core_state.json").write_text(json.dumps(state_to_json(initial_state(_plan(2)))))
    out = _Stream(tty=True)
    Progress(8, run_dir=tmp_path, stream=out)(RECOVERED)
    assert out.getvalue() == "elaswave: step 6: recovered rank 1 in 235 ms\n"


def _line(event) -> str | None:
    return change_line(event, step=4, layout=lambda generation: None, run_dir=None)


def test_planned_changes_say_who_and_why():
    slow = RecoveryPlan(
        sender="core", generation=1, failed=[], committed_step=7, plan_digest="d", reason="r",
        slow_ranks=[1], slow_factors=[2.0], kind="fail-slow",
    )  # fmt: skip
    assert _line(slow) == "step 8: rank 1 is 2.00x slower than its peers; rebalancing"
    two = RecoveryPlan(
        sender="core", generation=1, failed=[], committed_step=7, plan_digest="d", reason="r",
        slow_ranks=[1, 3], slow_factors=[2.0, 1.5], kind="fail-slow",
    )  # fmt: skip
    assert _line(two) == (
        "step 8: ranks 1 (2.00x), 3 (1.50x) are slower than their peers; rebalancing"
    )
    cleared = RecoveryPlan(
        sender="core", generation=2, failed=[], committed_step=9, plan_digest="d", reason="r",
        kind="fail-slow",
    )  # fmt: skip
    assert _line(cleared) == "step 10: no rank is slow any more; rebalancing"
    join = RecoveryPlan(
        sender="core", generation=2, failed=[], committed_step=9, plan_digest="d", reason="r",
        kind="join", joined=[4, 5],
    )  # fmt: skip
    assert _line(join) == "step 10: ranks 4, 5 joining"
    again = RecoveryPlan(
        sender="core", generation=2, failed=[], committed_step=9, plan_digest="d", reason="r",
        kind="join", joined=[4], attempt=1,
    )  # fmt: skip
    assert _line(again) is None, "an announcement made again is no news"
    joined = RecoveryFinished(
        sender="core", generation=2, step=10, kind="join", ranks=[4], mttr_s=1.0, joined=[4]
    )
    assert _line(joined) == "step 10: rank 4 joined in 1000 ms"


def test_a_wait_for_nodes_and_its_checkpoint_are_told():
    wait = WaitingForNodes(sender="core", generation=1, needed=1, wait_s=30.0, since=0, reason="r")
    assert _line(wait) == "too few ranks left for every stage: waiting up to 30 s for 1 more"
    checkpoint = CheckpointRequest(sender="core", step=2, owners=[0], writers=[0])
    assert _line(checkpoint) == (
        "no rank joined in time: writing a checkpoint of step 2 from memory before the job stops"
    )
    assert _line(_step(3)) is None


def test_layout_in_words_names_uneven_and_rotating_shares():
    plan = Plan(
        generation=1,
        global_batch=12,
        num_micro_batches=4,
        stages=(
            StagePlan(
                stage=0, layer_start=0, layer_stop=6, ranks=(0, 1), sizes=(2, 1), rotate=True
            ),
        ),
    )
    assert layout_text(plan) == (
        "2 ranks in 1 stage: stage 0 = ranks 0, 1 on layers 0-5 (2+1 samples, rotating)"
    )


def test_log_records_a_person_must_see_are_one_readable_line():
    lost = {"event": "host.core_lost", "level": "warning", "code": -9, "incarnation": 0}
    assert log_line(lost, relayed=False) == (
        "elaswave: the Core was lost (signal SIGKILL); starting it again; the workers train "
        "on (its log: logs/core0.log)"
    )
    recovered = {"event": "core.recovered", "level": "warning", "plan": {"stages": []}}
    assert log_line(recovered, relayed=True) is None, "the bus events tell it"
    failed = {"event": "core.failed", "level": "error", "error": "boom", "core": 1}
    assert log_line(failed, relayed=True) == (
        "elaswave: the Core logged error core.failed: boom (logs/core1.log)"
    )
    own = {"event": "host.odd", "level": "warning", "rank": 3, "detail": {"a": 1}}
    assert log_line(own, relayed=False) == "elaswave: warning: host.odd (rank 3)"


@pytest.fixture
def _logs_restored(monkeypatch):
    saved = structlog.get_config()
    for name in ("_output", "_people", "_write"):
        monkeypatch.setattr(logs, name, getattr(logs, name))
    yield
    structlog.configure(**saved)


RECORD = b'{"ranks": [1], "event": "core.failure_detected", "core": 0, "level": "warning"}\n'


@pytest.mark.usefixtures("_logs_restored")
def test_relayed_lines_are_rendered_as_this_process_renders_its_own(monkeypatch):
    lines: list[str] = []
    people: list[tuple[dict, bool]] = []

    def sink(record, *, relayed):
        people.append((dict(record), relayed))

    logs.configure_for(logs.LogFormat.JSON, sink, lines.append)
    logs.relay(RECORD)
    logs.configure_for(logs.LogFormat.CONSOLE, sink, lines.append)
    logs.relay(RECORD)
    logs.relay(b"Fatal Python error: Segmentation fault\n")
    assert lines[0] == RECORD.decode().rstrip("\n"), "JSON lines pass unchanged"
    assert "core.failure_detected" in lines[1]
    assert "ranks=[1]" in lines[1]
    assert not lines[1].startswith("{")
    assert lines[2] == "Fatal Python error: Segmentation fault", "not a record: as it is"
    err = _Stream(tty=True)
    monkeypatch.setattr(sys, "stderr", err)
    logs.configure_for(logs.LogFormat.AUTO, sink, lines.append)  # on a terminal: people
    assert logs.output() is logs.Output.PEOPLE
    logs.relay(RECORD)
    structlog.get_logger("t").warning("host.core_lost", code=-9, incarnation=0)
    assert people == [
        ({"ranks": [1], "event": "core.failure_detected", "core": 0, "level": "warning"}, True),
        (people[1][0], False),
    ]
    assert people[1][0]["event"] == "host.core_lost"
    assert len(lines) == 3, "records for people are the sink's to show"
    assert err.getvalue() == ""


@pytest.mark.usefixtures("_logs_restored")
def test_auto_is_json_without_a_terminal(capsys):
    logs.configure_for(logs.LogFormat.AUTO, lambda record, *, relayed: None, terminal.to_stderr)
    assert logs.output() is logs.Output.JSON  # pytest's captured stderr is no terminal
    structlog.get_logger("t").warning("host.core_lost", code=-9, incarnation=0)
    assert json.loads(capsys.readouterr().err)["event"] == "host.core_lost"
