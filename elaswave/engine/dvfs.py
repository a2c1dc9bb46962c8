"""DVFS planner (paper §4.3, Alg. 2 "Minimum Bisection Frequency Scaling").

After dataflow and graph planning, the straggler stage may still lag its peers by less
than one layer's worth of work. The planner up-clocks only that stage, and only as far
as needed: it first checks that the target mini-step time is reachable at the maximum
frequency, then bisects between the current and the maximum frequency for the lowest
frequency whose observed time meets the target.

The planner is a pure function of its inputs. ``observe(mhz)`` returns the straggler's
mini-step time at ``mhz``: in emulation it is the cost model's prediction (itself pure);
on hardware the runtime passes a function that applies the clock through a
:class:`~elaswave.runtime.worker.frequency.FrequencyBackend` and measures over the observation
window W. The planner never down-clocks, and it never returns a frequency it has not
observed to meet the target.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["FrequencyDecision", "FrequencyStatus", "plan_frequency"]


class FrequencyStatus(enum.StrEnum):
    """Whether the straggler can be aligned with its peers by frequency alone."""

    ACHIEVABLE = "achievable"
    """The returned frequency meets the target (within tolerance)."""
    UNACHIEVABLE = "unachievable"
    """Even the maximum frequency misses the target: the gap is not compute-bound."""


@dataclass(frozen=True, kw_only=True)
class FrequencyDecision:
    """The planner's answer: the frequency to apply, and how it was found."""

    mhz: float
    """Frequency to apply to the straggler's devices."""
    status: FrequencyStatus
    """ACHIEVABLE when ``mhz`` meets the target, UNACHIEVABLE when even the maximum misses it."""
    observations: tuple[tuple[float, float], ...]
    """Every ``(mhz, seconds)`` observed, in the order observed."""
    reason: str
    """Human-readable account of the decision, for logs and the event log."""


def _check_finite(name: str, value: float, *, positive: bool = False) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4g} ms"


def _mhz(mhz: float) -> str:
    return f"{mhz:.6g} MHz"


def plan_frequency(
    observe: Callable[[float], float],
    *,
    current_mhz: float,
    max_mhz: float,
    target_s: float,
    tolerance_s: float,
    min_step_mhz: float,
) -> FrequencyDecision:
    """The lowest frequency in ``[current_mhz, max_mhz]`` whose mini-step meets the target.

    Args:
        observe: the straggler's mini-step time in seconds at a frequency in MHz; assumed
            non-increasing in frequency (bisection relies on it, and a noisy measurement
            that breaks it only costs optimality, never feasibility).
        current_mhz: the straggler's frequency now; the result is never below it.
        max_mhz: the highest frequency allowed (power and thermal limits included).
        target_s: the peers' mini-step time T* the straggler should align with.
        tolerance_s: ε; a time ``t`` meets the target when ``t <= target_s + tolerance_s``.
        min_step_mhz: Δf_min; bisection stops once the bracket is narrower than this,
            so the result is less than ``min_step_mhz`` above the true minimum.

    Returns the current frequency when its time is already within tolerance of the target
    (or faster: the planner only up-clocks stragglers), ``(max_mhz, UNACHIEVABLE)`` when
    even the maximum misses the target, and otherwise the feasible end of the final
    bisection bracket. ``observe`` is called at most ``log2((max - current) / step) + 3``
    times.
    """
    _check_inputs(
        current_mhz=current_mhz,
        max_mhz=max_mhz,
        target_s=target_s,
        tolerance_s=tolerance_s,
        min_step_mhz=min_step_mhz,
    )
    timed = _Timed(observe)
    bound = target_s + tolerance_s
    target = f"target {_ms(target_s)} ± {_ms(tolerance_s)}"
    t_cur = timed(current_mhz)
    if abs(t_cur - target_s) <= tolerance_s:
        return timed.decision(
            current_mhz,
            FrequencyStatus.ACHIEVABLE,
            f"{_ms(t_cur)} at the current {_mhz(current_mhz)} is within the {target}; "
            "frequency kept",
        )
    if t_cur < target_s:
        return timed.decision(
            current_mhz,
            FrequencyStatus.ACHIEVABLE,
            f"{_ms(t_cur)} at the current {_mhz(current_mhz)} is already faster than the "
            f"{target}; frequency kept (the planner only up-clocks stragglers)",
        )

    t_max = t_cur if max_mhz == current_mhz else timed(max_mhz)
    if t_max > bound:
        return timed.decision(
            max_mhz,
            FrequencyStatus.UNACHIEVABLE,
            f"even the maximum {_mhz(max_mhz)} gives {_ms(t_max)}, slower than the "
            f"{target}: the gap is not compute-bound; the maximum is the closest it gets",
        )
    lo, hi, t_hi = _bisect(timed, current_mhz, max_mhz, t_max, bound, min_step_mhz)
    return timed.decision(
        hi,
        FrequencyStatus.ACHIEVABLE,
        f"{_ms(t_cur)} at the current {_mhz(current_mhz)} misses the {target}; "
        f"{_mhz(hi)} gives {_ms(t_hi)} (bisection to within {min_step_mhz:g} MHz "
        f"over {len(timed.observations)} observations; {_mhz(lo)} is too slow)",
    )


def _check_inputs(
    *, current_mhz: float, max_mhz: float, target_s: float, tolerance_s: float, min_step_mhz: float
) -> None:
    _check_finite("current_mhz", current_mhz, positive=True)
    _check_finite("max_mhz", max_mhz, positive=True)
    _check_finite("target_s", target_s, positive=True)
    _check_finite("tolerance_s", tolerance_s)
    _check_finite("min_step_mhz", min_step_mhz, positive=True)
    if max_mhz < current_mhz:
        raise ValueError(
            f"max_mhz {max_mhz} is below current_mhz {current_mhz}: the planner only "
            "up-clocks, so the maximum must be at least the current frequency"
        )
    if tolerance_s < 0:
        raise ValueError(f"tolerance_s must be >= 0, got {tolerance_s}")


class _Timed:
    """``observe``, checked, with every ``(mhz, seconds)`` it returned kept in order."""

    def __init__(self, observe: Callable[[float], float]) -> None:
        self.observe = observe
        self.observations: list[tuple[float, float]] = []

    def __call__(self, mhz: float) -> float:
        seconds = self.observe(mhz)
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(
                f"observe({mhz}) returned {seconds!r}; a mini-step time must be a finite "
                "number of seconds >= 0"
            )
        self.observations.append((mhz, seconds))
        return seconds

    def decision(self, mhz: float, status: FrequencyStatus, reason: str) -> FrequencyDecision:
        return FrequencyDecision(
            mhz=mhz, status=status, observations=tuple(self.observations), reason=reason
        )


def _bisect(
    timed: _Timed, lo: float, hi: float, t_hi: float, bound: float, min_step_mhz: float
) -> tuple[float, float, float]:
    """(lo, hi, time at hi) of the bracket narrowed below ``min_step_mhz``, from ``lo``
    observed to miss ``bound`` and ``hi`` observed to meet it (which stays true)."""
    while hi - lo >= min_step_mhz:
        mid = (lo + hi) / 2
        t_mid = timed(mid)
        if t_mid <= bound:
            hi, t_hi = mid, t_mid
        else:
            lo = mid
    return lo, hi, t_hi
