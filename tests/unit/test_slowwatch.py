"""The Core's fail-slow watch feeds the pure detector only steps it can evaluate."""

from __future__ import annotations

from elaswave.bus.schema import StepTiming
from elaswave.runtime.core import recorder
from elaswave.runtime.core.slowwatch import StragglerWatch


def _timing(rank: int, step: int, compute: float, expected: float) -> StepTiming:
    return StepTiming(
        sender=f"rank{rank}", generation=0, rank=rank, step=step, compute_s=compute,
        expected_s=expected, micro_batches=1, overruns=0,
    )  # fmt: skip


def test_a_step_without_modelled_work_is_passed_over_not_evaluated_again() -> None:
    """Chaos seed 8086 case 232 (dp2 x tp2, emulated, a slow rank, migrate+dvfs): once
    the migration left a rank without samples, a step whose every report had no modelled
    time (expected 0) made the watch evaluate the detector at the previous step again,
    and the detector's ValueError stopped the Core."""
    watch = StragglerWatch(window=3, threshold=1.5, min_steps=2)
    timings = [_timing(r, s, 1.0, 1.0) for s in range(4) for r in (0, 1)]
    assert watch.update(timings, {0, 1}) is None
    assert watch.evaluated == 3
    nothing = [_timing(r, 4, 0.0, 0.0) for r in (0, 1)]  # nothing modelled at step 4
    assert watch.update(nothing, {0, 1}) is None
    assert watch.evaluated == 4
    slow = [_timing(0, 5, 1.0, 1.0), _timing(1, 5, 3.0, 1.0)]
    assert watch.update(slow, {0, 1}) is None  # evaluated at 5: one slow step so far
    assert watch.evaluated == 5


def test_reports_given_in_pieces_flag_a_straggler_once_every_rank_reported() -> None:
    """The watch takes each report once, as they arrive (the Core hands over only what
    came since the last call): a step half reported waits for its other half."""
    watch = StragglerWatch(window=3, threshold=1.5, min_steps=2)
    assert watch.update([_timing(r, s, 1.0, 1.0) for s in range(3) for r in (0, 1)], {0, 1}) is None
    verdicts = []
    for step in (3, 4, 5):
        assert watch.update([_timing(0, step, 1.0, 1.0)], {0, 1}) is None
        assert watch.evaluated == step - 1  # rank 1 has not reported the step
        verdicts.append(watch.update([_timing(1, step, 3.0, 1.0)], {0, 1}))
        assert watch.evaluated == step
    flagged = [(step, v) for step, v in zip((3, 4, 5), verdicts, strict=True) if v is not None]
    assert len(flagged) == 1  # flagged once, at its min_steps-th slow step
    assert [s.rank for s in flagged[0][1].stragglers] == [1]
    assert watch.update([], {0, 1}) is None  # nothing new: nothing evaluated again


def test_the_core_holds_a_bounded_backlog_of_step_timings(tmp_path, monkeypatch) -> None:
    """The Core hands each StepTiming to the fail-slow watch once and keeps at most
    MAX_PENDING_TIMINGS of those not taken (it kept every report of the run before:
    gigabytes over a long job, and forever in a job that does not detect stragglers)."""
    monkeypatch.setattr(recorder, "MAX_PENDING_TIMINGS", 8)
    core = recorder.Core(tmp_path)
    for step in range(10):
        core._dispatch(_timing(0, step, 1.0, 1.0))
    assert [t.step for t in core.take_step_timings()] == list(range(2, 10))  # the newest 8
    assert core.take_step_timings() == []
    core._dispatch(_timing(1, 10, 1.0, 1.0))
    assert [t.step for t in core.take_step_timings()] == [10]
