"""Fail-slow detection: noise, job-wide slowdowns and spikes are ignored; stragglers are not."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from elaswave.engine.straggler import (
    DetectorState,
    StepReport,
    StragglerVerdict,
    detect_stragglers,
)

pytestmark = pytest.mark.timeout(120)

NUM_RANKS = 8
WINDOW = 9
THRESHOLD = 1.25
MIN_STEPS = 3
# Each rank's cost-model time differs (uneven layers and micro-batch shares after
# resizing); the detector must compare ratios, not raw times.
EXPECTED_S = [0.10, 0.12, 0.08, 0.15, 0.10, 0.09, 0.11, 0.13]

Slowdown = Callable[[int, int], float]
"""(rank, step) -> factor by which the rank's mini-step is slower in that step."""


def _healthy(rank: int, step: int) -> float:
    return 1.0


def _run(
    slowdown: Slowdown, *, num_steps: int, jitter: float = 0.0, seed: int = 0
) -> list[StragglerVerdict]:
    """Evaluate every step, keeping only the last WINDOW steps of reports (as the Core does)."""
    rng = random.Random(seed)
    reports: list[StepReport] = []
    state = DetectorState()
    verdicts = []
    for step in range(num_steps):
        for rank in range(NUM_RANKS):
            noise = 1.0 + rng.uniform(-jitter, jitter)
            expected = EXPECTED_S[rank]
            measured = expected * slowdown(rank, step) * noise
            reports.append(
                StepReport(rank=rank, step=step, ministep_s=measured, expected_s=expected)
            )
        reports = [r for r in reports if r.step > step - WINDOW]
        verdict = detect_stragglers(
            reports, window=WINDOW, threshold=THRESHOLD, min_steps=MIN_STEPS, state=state
        )
        assert verdict.step == step
        state = verdict.state
        verdicts.append(verdict)
    return verdicts


def _flagged_ranks(verdicts: list[StragglerVerdict]) -> set[int]:
    return {s.rank for v in verdicts for s in v.stragglers}


@pytest.mark.parametrize("seed", range(5))
def test_jitter_raises_nothing(seed: int) -> None:
    verdicts = _run(_healthy, num_steps=200, jitter=0.10, seed=seed)
    assert _flagged_ranks(verdicts) == set()
    assert "no straggler" in verdicts[-1].reason


@pytest.mark.parametrize("seed", range(5))
def test_job_wide_slowdown_raises_nothing(seed: int) -> None:
    # The machine gets busy at step 40: every rank slows 1.8x, then recovers at 120;
    # from 150 a slow drift makes every rank up to 2x slower.
    def busy(rank: int, step: int) -> float:
        if 40 <= step < 120:
            return 1.8
        return 1.0 + max(0, step - 150) / 50

    verdicts = _run(busy, num_steps=200, jitter=0.10, seed=seed)
    assert _flagged_ranks(verdicts) == set()


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("factor", [1.5, 2.0])
def test_consistent_straggler_is_flagged_with_its_factor(factor: float, seed: int) -> None:
    onset, slow_rank = 30, 5

    def slow(rank: int, step: int) -> float:
        return factor if rank == slow_rank and step >= onset else 1.0

    verdicts = _run(slow, num_steps=onset + WINDOW + MIN_STEPS, jitter=0.10, seed=seed)
    before, after = verdicts[:onset], verdicts[onset:]
    assert _flagged_ranks(before) == set()
    flagged_at = next(i for i, v in enumerate(after) if v.stragglers)
    assert after[flagged_at].newly_flagged == (slow_rank,)
    assert flagged_at < WINDOW + MIN_STEPS
    last = verdicts[-1]
    assert [s.rank for s in last.stragglers] == [slow_rank]
    straggler = last.stragglers[0]
    assert straggler.since_step == onset + flagged_at
    assert straggler.factor == pytest.approx(factor, rel=0.10)
    assert f"rank {slow_rank}" in last.reason


def test_clean_straggler_is_flagged_as_soon_as_the_median_turns() -> None:
    onset, slow_rank = 20, 2
    verdicts = _run(
        lambda rank, step: 2.0 if rank == slow_rank and step >= onset else 1.0, num_steps=40
    )
    first = next(v for v in verdicts if v.stragglers)
    # The window median turns once 5 of its 9 steps are slow; then 3 evaluations.
    assert first.step == onset + WINDOW // 2 + MIN_STEPS - 1
    assert first.stragglers[0].factor == pytest.approx(2.0)
    assert "flagged: 2.00x its peers for 3 evaluation(s)" in first.reason


@pytest.mark.parametrize("seed", range(5))
def test_single_spikes_are_ignored(seed: int) -> None:
    # Every rank has occasional 10x spikes (a GC pause, a page fault), never two in a row.
    rng = random.Random(1000 + seed)
    spikes = {(rank, step) for rank in range(NUM_RANKS) for step in range(0, 200, 7)}
    spikes = {s for s in spikes if rng.random() < 0.5}

    def spiky(rank: int, step: int) -> float:
        return 10.0 if (rank, step) in spikes else 1.0

    verdicts = _run(spiky, num_steps=200, jitter=0.10, seed=seed)
    assert _flagged_ranks(verdicts) == set()


def test_slowdown_shorter_than_half_the_window_is_ignored() -> None:
    # 4 slow steps never make a majority of a 9-step window; 5 do, for 5 evaluations.
    def brief(length: int) -> Slowdown:
        return lambda rank, step: 2.0 if rank == 1 and 50 <= step < 50 + length else 1.0

    assert _flagged_ranks(_run(brief(4), num_steps=80)) == set()
    assert _flagged_ranks(_run(brief(5), num_steps=80)) == {1}


def test_flagging_needs_min_steps_consecutive_slow_evaluations() -> None:
    # window=1 takes each step as it comes, so only min_steps filters short episodes.
    def run(slow_steps: set[int]) -> list[int]:
        state, flagged = DetectorState(), []
        for step in range(12):
            reports = [
                StepReport(
                    rank=rank,
                    step=step,
                    ministep_s=0.2 if rank == 0 and step in slow_steps else 0.1,
                    expected_s=0.1,
                )
                for rank in range(4)
            ]
            verdict = detect_stragglers(reports, window=1, threshold=1.5, min_steps=3, state=state)
            state = verdict.state
            flagged += [step for _ in verdict.newly_flagged]
        return flagged

    assert run({2, 3}) == []
    assert run({2, 3, 5, 6, 8, 9}) == []  # interrupted streaks start over
    assert run({2, 3, 4}) == [4]


@pytest.mark.parametrize("seed", range(3))
def test_recovery_is_reported(seed: int) -> None:
    onset, heal, slow_rank = 20, 60, 3

    def episode(rank: int, step: int) -> float:
        return 2.0 if rank == slow_rank and onset <= step < heal else 1.0

    verdicts = _run(episode, num_steps=100, jitter=0.10, seed=seed)
    assert [s.rank for s in verdicts[heal - 1].stragglers] == [slow_rank]
    recovered = [v for v in verdicts if v.recovered]
    assert len(recovered) == 1 and recovered[0].recovered == (slow_rank,)
    assert recovered[0].step is not None
    assert heal <= recovered[0].step < heal + WINDOW + MIN_STEPS
    assert recovered[0].stragglers == ()
    assert f"rank {slow_rank} recovered" in recovered[0].reason
    assert _flagged_ranks(verdicts[recovered[0].step :]) == set()


def test_two_stragglers_among_eight() -> None:
    verdicts = _run(
        lambda rank, step: {0: 1.5, 6: 2.0}.get(rank, 1.0) if step >= 10 else 1.0, num_steps=40
    )
    last = verdicts[-1]
    assert [(s.rank, round(s.factor, 2)) for s in last.stragglers] == [(0, 1.5), (6, 2.0)]


def test_two_ranks_suffice_to_compare() -> None:
    # The peer median leaves the rank itself out, so even a pair gives the true factor.
    reports = [
        StepReport(rank=rank, step=step, ministep_s=0.1 * (2.0 if rank else 1.0), expected_s=0.1)
        for step in range(3)
        for rank in range(2)
    ]
    state = DetectorState()
    for step in range(3):
        verdict = detect_stragglers(
            [r for r in reports if r.step <= step],
            window=1,
            threshold=1.5,
            min_steps=1,
            state=state,
        )
        state = verdict.state
    assert [(s.rank, s.factor) for s in verdict.stragglers] == [(1, 2.0)]


def test_ranks_without_a_full_window_wait_and_leavers_are_forgotten() -> None:
    def reports_for(ranks: range, steps: range, slow: int = -1) -> list[StepReport]:
        return [
            StepReport(rank=r, step=s, ministep_s=0.2 if r == slow else 0.1, expected_s=0.1)
            for r in ranks
            for s in steps
        ]

    state = DetectorState()
    # Rank 3 joins late: it has two reports, so it is not compared yet.
    late = reports_for(range(3), range(3)) + reports_for(range(3, 4), range(1, 3), slow=3)
    verdict = detect_stragglers(late, window=3, threshold=1.5, min_steps=1, state=state)
    assert verdict.stragglers == () and "3 ranks compared" in verdict.reason
    verdict = detect_stragglers(
        late + reports_for(range(4), range(3, 4), slow=3),
        window=3,
        threshold=1.5,
        min_steps=1,
        state=verdict.state,
    )
    assert [s.rank for s in verdict.stragglers] == [3]
    # Rank 3 leaves the job: its flag is dropped with it.
    verdict = detect_stragglers(
        reports_for(range(3), range(2, 5)),
        window=3,
        threshold=1.5,
        min_steps=1,
        state=verdict.state,
    )
    assert verdict.stragglers == () and "forgot ranks [3]" in verdict.reason
    assert [s.rank for s in verdict.state.ranks] == [0, 1, 2]


def test_state_must_move_forward() -> None:
    reports = [StepReport(rank=r, step=0, ministep_s=0.1, expected_s=0.1) for r in range(3)]
    verdict = detect_stragglers(reports, window=1, threshold=1.2, min_steps=1)
    with pytest.raises(ValueError, match="step 0 was already evaluated"):
        detect_stragglers(reports, window=1, threshold=1.2, min_steps=1, state=verdict.state)


def test_no_reports_keeps_the_state() -> None:
    state = DetectorState(step=4)
    verdict = detect_stragglers([], window=3, threshold=1.2, min_steps=2, state=state)
    assert verdict.state is state and verdict.stragglers == ()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"window": 0}, "window must be at least 1 step, got 0"),
        ({"min_steps": 0}, "min_steps must be at least 1 evaluation, got 0"),
        ({"threshold": 1.0}, "threshold must be a finite factor above 1"),
        ({"threshold": float("nan")}, "threshold must be a finite factor above 1"),
    ],
)
def test_invalid_parameters(kwargs: dict[str, float], message: str) -> None:
    args: dict[str, float] = {"window": 3, "threshold": 1.2, "min_steps": 2} | kwargs
    with pytest.raises(ValueError, match=message):
        detect_stragglers([], **args)  # type: ignore[arg-type]


def test_invalid_reports() -> None:
    with pytest.raises(ValueError, match="expected_s must be a finite time > 0"):
        StepReport(rank=0, step=0, ministep_s=0.1, expected_s=0.0)
    with pytest.raises(ValueError, match="ministep_s must be a finite time >= 0"):
        StepReport(rank=0, step=0, ministep_s=float("inf"), expected_s=0.1)
    with pytest.raises(ValueError, match="rank and step must be >= 0"):
        StepReport(rank=-1, step=0, ministep_s=0.1, expected_s=0.1)
    twice = [StepReport(rank=2, step=7, ministep_s=0.1, expected_s=0.1)] * 2
    with pytest.raises(ValueError, match="rank 2 reported step 7 more than once"):
        detect_stragglers(twice, window=1, threshold=1.2, min_steps=1)
