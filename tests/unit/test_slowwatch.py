"""The Core's fail-slow watch feeds the pure detector only steps it can evaluate."""

from __future__ import annotations

from elaswave.bus.schema import StepTiming
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
    timings += [_timing(r, 4, 0.0, 0.0) for r in (0, 1)]  # nothing modelled at step 4
    assert watch.update(timings, {0, 1}) is None
    assert watch.evaluated == 4
    timings += [_timing(0, 5, 1.0, 1.0), _timing(1, 5, 3.0, 1.0)]
    assert watch.update(timings, {0, 1}) is None  # evaluated at 5: one slow step so far
    assert watch.evaluated == 5
