"""DVFS planner (Alg. 2) against brute force over monotone time curves."""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from elaswave.engine.dvfs import FrequencyDecision, FrequencyStatus, plan_frequency

pytestmark = pytest.mark.timeout(120)

ACHIEVABLE, UNACHIEVABLE = FrequencyStatus.ACHIEVABLE, FrequencyStatus.UNACHIEVABLE


def _curve(c0: float, c1: float, base: float) -> Callable[[float], float]:
    """Mini-step time: a frequency-bound part c1 (at base) plus a fixed part c0."""
    return lambda mhz: c0 + c1 * base / mhz


def _recorded(curve: Callable[[float], float]) -> tuple[Callable[[float], float], list[float]]:
    calls: list[float] = []

    def observe(mhz: float) -> float:
        calls.append(mhz)
        return curve(mhz)

    return observe, calls


def _plan(observe: Callable[[float], float], **overrides: float) -> FrequencyDecision:
    args = {
        "current_mhz": 1400.0,
        "max_mhz": 1650.0,
        "target_s": 0.1,
        "tolerance_s": 0.001,
        "min_step_mhz": 10.0,
    }
    args.update(overrides)
    return plan_frequency(observe, **args)


@settings(max_examples=300, deadline=None)
@given(
    current=st.floats(500, 2000),
    span=st.floats(0, 1500),
    step=st.floats(1, 200),
    c0=st.floats(0, 0.2),
    c1=st.floats(0.01, 0.5),
    target_share=st.floats(0, 1),
    tolerance_share=st.floats(0, 0.05),
)
def test_bisection_matches_brute_force(
    current: float,
    span: float,
    step: float,
    c0: float,
    c1: float,
    target_share: float,
    tolerance_share: float,
) -> None:
    maximum = current + span
    curve = _curve(c0, c1, base=current)
    t_cur, t_max = curve(current), curve(maximum)
    # Targets from below what the maximum reaches to above the current time.
    target = 0.8 * t_max + target_share * (1.1 * t_cur - 0.8 * t_max)
    tolerance = target * tolerance_share
    bound = target + tolerance
    observe, calls = _recorded(curve)

    decision = plan_frequency(
        observe,
        current_mhz=current,
        max_mhz=maximum,
        target_s=target,
        tolerance_s=tolerance,
        min_step_mhz=step,
    )

    assert [mhz for mhz, _ in decision.observations] == calls
    assert all(curve(mhz) == t for mhz, t in decision.observations)
    assert all(current <= mhz <= maximum for mhz in calls)
    assert len(calls) <= math.log2(max(1.0, span / step)) + 3
    assert (decision.status is UNACHIEVABLE) == (t_max > bound)
    if decision.status is UNACHIEVABLE:
        assert decision.mhz == maximum
        return
    if t_cur <= bound:
        # Within tolerance, or already faster than needed: never down-clock.
        assert decision.mhz == current and calls == [current]
        return
    # The result was observed to meet the target, and no coarser than the step.
    assert (decision.mhz, curve(decision.mhz)) in decision.observations
    assert curve(decision.mhz) <= bound
    grid = np.linspace(current, maximum, 4001)
    feasible = grid[[curve(float(f)) <= bound for f in grid]]
    resolution = span / 4000
    true_min = float(feasible[0])
    assert true_min - resolution <= decision.mhz < true_min + step + resolution


def test_paper_setting_upclocks_only_as_far_as_needed() -> None:
    # 910B: 1,400 MHz now, 1,650 MHz max; the straggler needs about 8 % more clock.
    curve = _curve(0.02, 0.1, base=1400.0)  # 120 ms now
    target = curve(1512.0)
    decision = _plan(_recorded(curve)[0], target_s=target, tolerance_s=0.0, min_step_mhz=5.0)
    assert decision.status is ACHIEVABLE
    assert 1512.0 <= decision.mhz < 1517.0
    assert decision.observations[:2] == ((1400.0, curve(1400.0)), (1650.0, curve(1650.0)))
    assert "bisection" in decision.reason and "too slow" in decision.reason


def test_within_tolerance_keeps_the_current_frequency() -> None:
    observe, calls = _recorded(lambda mhz: 0.1005)
    decision = _plan(observe, target_s=0.1, tolerance_s=0.001)
    assert decision.mhz == 1400.0 and decision.status is ACHIEVABLE
    assert calls == [1400.0]
    assert "within" in decision.reason


def test_already_faster_than_needed_is_not_down_clocked() -> None:
    observe, calls = _recorded(_curve(0.0, 0.05, base=1400.0))  # 50 ms against 100 ms
    decision = _plan(observe, target_s=0.1, tolerance_s=0.001)
    assert decision.mhz == 1400.0 and decision.status is ACHIEVABLE
    assert calls == [1400.0]
    assert "already faster" in decision.reason and "only up-clocks" in decision.reason


def test_unachievable_returns_the_maximum() -> None:
    observe, calls = _recorded(_curve(0.09, 0.05, base=1400.0))  # 132 ms even at 1,650 MHz
    decision = _plan(observe, target_s=0.1, tolerance_s=0.001)
    assert decision.status is UNACHIEVABLE and decision.mhz == 1650.0
    assert calls == [1400.0, 1650.0]
    assert "not compute-bound" in decision.reason


def test_current_at_maximum_needs_one_observation() -> None:
    observe, calls = _recorded(lambda mhz: 0.2)
    decision = _plan(observe, current_mhz=1650.0, max_mhz=1650.0)
    assert decision.status is UNACHIEVABLE and decision.mhz == 1650.0
    assert calls == [1650.0]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.0, 0.3), min_size=12, max_size=12), st.floats(1, 50))
def test_noisy_observations_never_return_an_unobserved_feasible_frequency(
    times: list[float], step: float
) -> None:
    # A noisy, non-monotone measurement: bisection may miss the optimum, not feasibility.
    answers = iter(times)
    decision = _plan(lambda mhz: next(answers), min_step_mhz=step)
    bound = 0.1 + 0.001
    observed = dict(decision.observations)
    assume(decision.observations[0][1] > bound)  # the cases that up-clock or give up
    if decision.status is ACHIEVABLE:
        assert observed[decision.mhz] <= bound
    else:
        assert decision.mhz == 1650.0 and observed[1650.0] > bound


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"max_mhz": 1300.0}, "max_mhz 1300.0 is below current_mhz 1400.0"),
        ({"min_step_mhz": 0.0}, "min_step_mhz must be positive, got 0.0"),
        ({"min_step_mhz": -5.0}, "min_step_mhz must be positive"),
        ({"current_mhz": 0.0}, "current_mhz must be positive"),
        ({"target_s": -0.1}, "target_s must be positive"),
        ({"tolerance_s": -0.001}, "tolerance_s must be >= 0, got -0.001"),
        ({"max_mhz": math.inf}, "max_mhz must be a finite number, got inf"),
        ({"target_s": math.nan}, "target_s must be a finite number, got nan"),
    ],
)
def test_invalid_arguments_name_the_value(overrides: dict[str, float], message: str) -> None:
    observe, calls = _recorded(lambda mhz: 0.1)
    with pytest.raises(ValueError, match=re.escape(message)):
        _plan(observe, **overrides)
    assert calls == []


@pytest.mark.parametrize("bad", [math.nan, -0.01, math.inf])
def test_invalid_observation_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match=r"observe\(1400.0\) returned"):
        _plan(lambda mhz: bad)


def test_decision_is_frozen_and_keyword_only() -> None:
    decision = _plan(lambda mhz: 0.1)
    with pytest.raises(AttributeError):
        decision.mhz = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        FrequencyDecision(1.0, ACHIEVABLE, (), "")  # type: ignore[misc]
