"""The Core's fail-slow watch: feeds StepTiming reports to the pure detector, step by step.

Every worker publishes a StepTiming after each step (its compute time and the cost
model's time for the same work). Once every live rank has reported a step, the watch
evaluates the detector (:func:`elaswave.engine.straggler.detect_stragglers`) at that
step with the previous evaluation's state; a verdict that flags or clears a rank is
what the supervisor acts on. Steps redone after a rollback report again: the latest
report of a (rank, step) counts, and a step is evaluated once.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from elaswave.bus.schema import StepTiming
from elaswave.engine.straggler import DetectorState, StepReport, StragglerVerdict, detect_stragglers


@dataclass
class StragglerWatch:
    window: int
    threshold: float
    min_steps: int
    state: DetectorState | None = None
    evaluated: int = -1
    """The last step evaluated."""
    _reports: dict[int, dict[int, StepTiming]] = field(default_factory=lambda: defaultdict(dict))
    """step -> rank -> its report, for the steps of the window and those not evaluated."""

    def update(
        self, timings: Iterable[StepTiming], alive: Collection[int]
    ) -> StragglerVerdict | None:
        """Take the reports that arrived since the last call (``timings``), evaluate
        every step newly reported by all of ``alive``; return the first verdict that
        flags or clears a rank (None when nothing changed)."""
        for timing in timings:
            # A TP group's members each report: the group runs at its slowest's pace.
            known = self._reports[timing.step].get(timing.rank)
            if known is None or _slowness(timing) >= _slowness(known):
                self._reports[timing.step][timing.rank] = timing
        alive = set(alive)
        complete = sorted(
            step
            for step, by_rank in self._reports.items()
            if step > self.evaluated and alive <= set(by_rank)
        )
        for step in complete:
            reports = [
                StepReport(
                    rank=t.rank, step=t.step, ministep_s=t.compute_s, expected_s=t.expected_s
                )
                for s in range(step - self.window + 1, step + 1)
                for t in self._reports.get(s, {}).values()
                if t.rank in alive and t.expected_s > 0
            ]
            if not any(r.step == step for r in reports):
                # No rank has modelled work at this step (each got no samples, or has
                # no model of its device): nothing to compare, and the detector takes
                # only a step newer than the last it evaluated.
                self.evaluated = step
                continue
            verdict = detect_stragglers(
                reports,
                window=self.window,
                threshold=self.threshold,
                min_steps=self.min_steps,
                state=self.state,
            )
            self.state, self.evaluated = verdict.state, step
            for old in [s for s in self._reports if s <= step - self.window]:
                del self._reports[old]
            if verdict.newly_flagged or verdict.recovered:
                return verdict
        return None


def _slowness(t: StepTiming) -> float:
    return t.compute_s / t.expected_s if t.expected_s > 0 else 0.0
