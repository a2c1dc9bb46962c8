"""Fail-slow detection: which ranks are consistently slower than their peers.

Agents report, per rank and step, the rank's mean mini-step compute time and the time
the cost model expects for the work it did (its layers and micro-batch share at its
frequency). Their ratio is the rank's *slowness*: 1.0 for a healthy rank whatever its
share, 2.0 for a rank running at half speed. A rank is a straggler when

* the median of its slowness over its last ``window`` reports exceeds ``threshold``
  times the median over its peers (the other ranks' window medians), and
* that has held for ``min_steps`` consecutive evaluations.

Medians make single-step spikes harmless (a spike must fill half the window to move
one); comparing with the peers makes a job-wide slowdown (a busy machine, a slow
shared file system) harmless, since every rank slows together. A flagged rank whose
slowness stays at or below the threshold for ``min_steps`` consecutive evaluations is
reported as recovered.

The detector is a pure function, in the style of torchft's ``quorum_compute(now, state,
opt)``: :func:`detect_stragglers` takes the recent reports and the
:class:`DetectorState` returned by the previous evaluation, and returns a
:class:`StragglerVerdict` carrying the next state. Only the last ``window`` reports of
each rank are read, so callers keep a bounded tail of reports, and replaying logged
report batches through the function reproduces every verdict.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "DetectorState",
    "RankStreak",
    "StepReport",
    "Straggler",
    "StragglerVerdict",
    "detect_stragglers",
]


@dataclass(frozen=True, kw_only=True)
class StepReport:
    """One rank's timing for one training step, as its agent reports it."""

    rank: int
    """Global rank that ran the step."""
    step: int
    """Training step the timing belongs to."""
    ministep_s: float
    """Measured mean mini-step compute time of the rank in this step, in seconds."""
    expected_s: float
    """Cost-model time for the same work (layers, micro-batch share, frequency), seconds."""

    def __post_init__(self) -> None:
        if self.rank < 0 or self.step < 0:
            raise ValueError(f"rank and step must be >= 0 in {self}")
        if not math.isfinite(self.ministep_s) or self.ministep_s < 0:
            raise ValueError(f"ministep_s must be a finite time >= 0 in {self}")
        if not math.isfinite(self.expected_s) or self.expected_s <= 0:
            raise ValueError(f"expected_s must be a finite time > 0 in {self}")

    @property
    def slowness(self) -> float:
        """Measured over expected time: 1.0 when the rank runs as the cost model predicts."""
        return self.ministep_s / self.expected_s


@dataclass(frozen=True, kw_only=True)
class RankStreak:
    """Detector memory for one rank."""

    rank: int
    """The rank this streak belongs to."""
    slow: int = 0
    """Consecutive evaluations above the threshold while the rank is not flagged."""
    normal: int = 0
    """Consecutive evaluations at or below the threshold while the rank is flagged."""
    flagged_at: int | None = None
    """Step of the evaluation that flagged the rank; None while it is not flagged."""
    factor: float = 1.0
    """Latest estimate of the rank's slowness relative to its peers."""


@dataclass(frozen=True, kw_only=True)
class DetectorState:
    """Everything the detector remembers between evaluations; start from ``DetectorState()``."""

    step: int | None = None
    """Step of the latest evaluation; None before the first one."""
    ranks: tuple[RankStreak, ...] = ()
    """Per-rank streaks, sorted by rank."""


@dataclass(frozen=True, kw_only=True)
class Straggler:
    """A flagged rank and how much slower than its peers it runs."""

    rank: int
    """The slow rank."""
    factor: float
    """Its window-median slowness over its peers' median (2.0: half speed)."""
    since_step: int
    """Step of the evaluation that flagged it."""


@dataclass(frozen=True, kw_only=True)
class StragglerVerdict:
    """Result of one evaluation."""

    step: int | None
    """The evaluated step (the latest step in the reports); None when there were none."""
    stragglers: tuple[Straggler, ...]
    """Every rank flagged after this evaluation, sorted by rank."""
    newly_flagged: tuple[int, ...]
    """Ranks this evaluation flagged (a subset of ``stragglers``)."""
    recovered: tuple[int, ...]
    """Previously flagged ranks this evaluation found back in line with their peers."""
    state: DetectorState
    """Pass back as ``state`` to the next evaluation."""
    reason: str
    """Human-readable account of the verdict."""


def _median_without(values: Sequence[float], index: int) -> float:
    """Median of sorted ``values`` with the element at ``index`` left out (len >= 2)."""
    size = len(values) - 1

    def at(position: int) -> float:
        return values[position if position < index else position + 1]

    middle = size // 2
    return at(middle) if size % 2 else (at(middle - 1) + at(middle)) / 2


def _factor(own: float, peers: float) -> float:
    if peers > 0:
        return own / peers
    return math.inf if own > 0 else 1.0


def detect_stragglers(
    reports: Sequence[StepReport],
    *,
    window: int,
    threshold: float,
    min_steps: int,
    state: DetectorState | None = None,
) -> StragglerVerdict:
    """Evaluate the latest step in ``reports`` and return the stragglers after it.

    Args:
        reports: recent reports, in any order; at most one per (rank, step). Only each
            rank's last ``window`` reports are read, so a tail of ``window`` steps suffices.
        window: how many of a rank's latest reports its median slowness is taken over.
        threshold: a rank is slow in an evaluation when its median slowness exceeds
            ``threshold`` times its peers' median; must be above 1.
        min_steps: consecutive slow evaluations before a rank is flagged, and
            consecutive normal ones before a flagged rank is reported as recovered.
        state: the previous verdict's ``state``; None (or ``DetectorState()``) at start.

    Each call is one evaluation, at the latest step present in ``reports``, which must be
    newer than ``state.step``. A rank takes part when it reported that step and has at
    least ``window`` reports; one that reported but lacks a full window keeps its streaks
    unchanged, and one absent from ``reports`` altogether is forgotten (it left the job).
    Evaluated every step, a steady slowdown by a factor above the threshold is flagged
    at the ``window // 2 + min_steps``-th evaluation after its onset at the latest (the
    median turns once more than half the window is slow), as long as noise stays well
    below the margin between the factor and the threshold.
    """
    _check_settings(window=window, threshold=threshold, min_steps=min_steps)
    state = DetectorState() if state is None else state
    if not reports:
        return StragglerVerdict(
            step=state.step,
            stragglers=_stragglers(state.ranks),
            newly_flagged=(),
            recovered=(),
            state=state,
            reason="no reports to evaluate",
        )
    history = _slowness(reports)
    step = max(max(steps) for steps in history.values())
    if state.step is not None and step <= state.step:
        raise ValueError(
            f"the reports end at step {step}, but step {state.step} was already evaluated; "
            "pass reports that include a newer step"
        )
    medians = _window_medians(history, step=step, window=window)
    if len(medians) < 2:
        return _too_few(state, history, step=step, window=window, compared=len(medians))
    factors = _peer_factors(medians)
    streaks = _next_streaks(
        state, sorted(history), factors, step=step, threshold=threshold, min_steps=min_steps
    )
    before = {s.rank: s.flagged_at for s in state.ranks}
    newly_flagged = [
        s.rank for s in streaks if s.flagged_at is not None and before.get(s.rank) is None
    ]
    recovered = [s.rank for s in streaks if s.flagged_at is None and before.get(s.rank) is not None]
    forgotten = sorted(set(before) - set(history))
    next_state = DetectorState(step=step, ranks=tuple(streaks))
    stragglers = _stragglers(next_state.ranks)
    return StragglerVerdict(
        step=step,
        stragglers=stragglers,
        newly_flagged=tuple(newly_flagged),
        recovered=tuple(recovered),
        state=next_state,
        reason=_reason(
            step=step,
            window=window,
            threshold=threshold,
            min_steps=min_steps,
            factors=factors,
            stragglers=stragglers,
            newly_flagged=newly_flagged,
            recovered=recovered,
            forgotten=forgotten,
        ),
    )


def _check_settings(*, window: int, threshold: float, min_steps: int) -> None:
    if window < 1:
        raise ValueError(f"window must be at least 1 step, got {window}")
    if min_steps < 1:
        raise ValueError(f"min_steps must be at least 1 evaluation, got {min_steps}")
    if not math.isfinite(threshold) or threshold <= 1:
        raise ValueError(
            f"threshold must be a finite factor above 1 (e.g. 1.2), got {threshold!r}: "
            "at or below 1 a rank running exactly like its peers would be flagged"
        )


def _slowness(reports: Sequence[StepReport]) -> dict[int, dict[int, float]]:
    """rank -> step -> slowness of every report (at most one per rank and step)."""
    history: defaultdict[int, dict[int, float]] = defaultdict(dict)
    for report in reports:
        steps = history[report.rank]
        if report.step in steps:
            raise ValueError(f"rank {report.rank} reported step {report.step} more than once")
        steps[report.step] = report.slowness
    return history


def _window_medians(
    history: Mapping[int, Mapping[int, float]], *, step: int, window: int
) -> dict[int, float]:
    """The median slowness over its last ``window`` reports of every rank that reported
    ``step`` and has that many."""
    medians: dict[int, float] = {}
    for rank, steps in history.items():
        if step in steps and len(steps) >= window:
            latest = sorted(steps)[-window:]
            medians[rank] = statistics.median(steps[s] for s in latest)
    return medians


def _too_few(
    state: DetectorState,
    history: Mapping[int, Mapping[int, float]],
    *,
    step: int,
    window: int,
    compared: int,
) -> StragglerVerdict:
    """The verdict when fewer than two ranks have a full window: streaks unchanged,
    ranks without reports forgotten."""
    dropped = [s for s in state.ranks if s.rank not in history]
    kept = tuple(s for s in state.ranks if s.rank in history)
    reason = (
        f"step {step}: {compared} rank(s) with a full {window}-step window; "
        "at least two are needed to compare"
    )
    if dropped:
        reason += f"; forgot ranks {[s.rank for s in dropped]} (no reports)"
    return StragglerVerdict(
        step=step,
        stragglers=_stragglers(kept),
        newly_flagged=(),
        recovered=(),
        state=DetectorState(step=step, ranks=kept),
        reason=reason,
    )


def _peer_factors(medians: Mapping[int, float]) -> dict[int, float]:
    """Each rank's median over the median of the other ranks' medians."""
    ordered = sorted(medians.items(), key=lambda item: (item[1], item[0]))
    values = [median for _, median in ordered]
    return {
        rank: _factor(median, _median_without(values, index))
        for index, (rank, median) in enumerate(ordered)
    }


def _next_streaks(
    state: DetectorState,
    ranks: Sequence[int],
    factors: Mapping[int, float],
    *,
    step: int,
    threshold: float,
    min_steps: int,
) -> list[RankStreak]:
    """The streak of every rank of ``ranks`` (ascending) after this evaluation; a rank
    without a factor (no full window) keeps its streak."""
    previous = {s.rank: s for s in state.ranks}
    streaks = []
    for rank in ranks:
        old = previous.get(rank, RankStreak(rank=rank))
        if rank in factors:
            factor = factors[rank]
            old = _next_streak(old, factor, step=step, threshold=threshold, min_steps=min_steps)
        streaks.append(old)
    return streaks


def _next_streak(
    old: RankStreak, factor: float, *, step: int, threshold: float, min_steps: int
) -> RankStreak:
    """``old`` after one evaluation that found its rank ``factor`` times its peers: a
    rank is flagged after ``min_steps`` slow evaluations in a row, and cleared after
    ``min_steps`` normal ones."""
    slow = factor > threshold
    if old.flagged_at is None:
        run = old.slow + 1 if slow else 0
        if run >= min_steps:
            return RankStreak(rank=old.rank, flagged_at=step, factor=factor)
        return RankStreak(rank=old.rank, slow=run, factor=factor)
    run = 0 if slow else old.normal + 1
    if run >= min_steps:
        return RankStreak(rank=old.rank, factor=factor)
    return RankStreak(rank=old.rank, normal=run, flagged_at=old.flagged_at, factor=factor)


def _stragglers(streaks: Sequence[RankStreak]) -> tuple[Straggler, ...]:
    return tuple(
        Straggler(rank=s.rank, factor=s.factor, since_step=s.flagged_at)
        for s in streaks
        if s.flagged_at is not None
    )


def _reason(
    *,
    step: int,
    window: int,
    threshold: float,
    min_steps: int,
    factors: dict[int, float],
    stragglers: Sequence[Straggler],
    newly_flagged: Sequence[int],
    recovered: Sequence[int],
    forgotten: Sequence[int],
) -> str:
    parts = [
        f"step {step}: {len(factors)} ranks compared over their last {window} steps "
        f"(slow above {threshold:g}x the peer median)"
    ]
    for straggler in stragglers:
        if straggler.rank in newly_flagged:
            parts.append(
                f"rank {straggler.rank} flagged: {straggler.factor:.2f}x its peers for "
                f"{min_steps} evaluation(s)"
            )
        else:
            parts.append(
                f"rank {straggler.rank} still a straggler since step {straggler.since_step} "
                f"({straggler.factor:.2f}x)"
            )
    for rank in recovered:
        parts.append(
            f"rank {rank} recovered: {factors[rank]:.2f}x its peers for {min_steps} evaluation(s)"
        )
    if forgotten:
        parts.append(f"forgot ranks {list(forgotten)} (no reports)")
    if not stragglers and not recovered:
        rank, factor = max(factors.items(), key=lambda item: (item[1], -item[0]))
        parts.append(f"no straggler (slowest: rank {rank} at {factor:.2f}x)")
    return "; ".join(parts)
