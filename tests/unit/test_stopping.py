"""The stop phase of a change (engine.phases.stopping), driven through random interleavings.

A hypothesis state machine plays the world: members of a plan report (again, late, for
the wrong generation), exit with any code before or after reporting, strangers report.
After every event it checks the rules the Core relies on:

- the change plans (STOPPED) only when every member left has reported, and no member
  left is lost;
- every lost member is announced before the change can plan, every announcement names
  the whole failed set so far, and no set is announced twice;
- NONE_LEFT exactly when every member is lost, and nothing is announced then;
- a report never brings back a lost rank.

CI runs 1,000 sequences; `scripts/model_check` runs 20,000 (set
``ELASWAVE_MODEL_CHECK=N`` to run N).
"""

from __future__ import annotations

import os

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from elaswave.engine.phases.stopping import StopStatus, on_exit, on_report, status, stop_phase

EXAMPLES = int(os.environ.get("ELASWAVE_MODEL_CHECK", "500"))  # scripts/model_check: more
LENGTHS: list[int] = []
"""Events of each sequence run, the last one last (for the broken-rule test)."""


class StopPhase(RuleBasedStateMachine):
    @initialize(
        generation=st.integers(0, 3),
        size=st.integers(1, 6),
        pre=st.sets(st.integers(0, 5), max_size=3),
    )
    def start(self, generation: int, size: int, pre: set[int]) -> None:
        self.generation = generation
        self.plan = frozenset(range(size))
        failed = {r: -9 for r in pre if r in self.plan}
        self.state, announced = stop_phase(generation, self.plan, failed, deadline=0.0)
        self.lost = set(failed)
        self.reported: set[int] = set()
        self.announcements: list[tuple[int, ...]] = []
        LENGTHS.append(0)
        self._take(announced)

    def _take(self, announced: list) -> None:
        for a in announced:
            assert a.generation == self.generation
            assert a.ranks == tuple(sorted(self.lost)), (a.ranks, self.lost)
            assert a.ranks not in self.announcements, "the same failed set announced twice"
            assert set(a.new) and set(a.new) <= self.lost
            self.announcements.append(a.ranks)

    @rule(rank=st.integers(0, 7), code=st.sampled_from([-9, -15, 1, 0]))
    def exits(self, rank: int, code: int) -> None:
        LENGTHS[-1] += 1
        self.state, announced = on_exit(self.state, rank, code)
        if rank in self.plan:
            self.lost.add(rank)
            self.reported.discard(rank)
        self._take(announced)

    @rule(rank=st.integers(0, 7), stale=st.booleans())
    def reports(self, rank: int, stale: bool) -> None:
        LENGTHS[-1] += 1
        generation = self.generation - 1 if stale else self.generation
        self.state = on_report(self.state, rank, generation)
        if not stale and rank in self.plan and rank not in self.lost:
            self.reported.add(rank)

    @invariant()
    def rules_hold(self) -> None:
        left = self.plan - self.lost
        assert self.state.members == left
        assert set(self.state.failed) == self.lost
        assert self.state.reported == self.reported
        result = status(self.state)
        if not left:
            assert result is StopStatus.NONE_LEFT
            return
        if result is StopStatus.STOPPED:
            assert self.reported >= left, "planned before every member left reported"
        else:
            assert result is StopStatus.WAITING and not self.reported >= left
        if self.lost:  # every loss announced while members are left to plan for
            assert self.announcements and set(self.announcements[-1]) == self.lost


TestStopPhase = StopPhase.TestCase
TestStopPhase.settings = settings(max_examples=EXAMPLES, stateful_step_count=30, deadline=None)


@pytest.mark.long  # mutation check of the model checker: test_protocol.py's broken commit rule
def test_a_broken_rule_is_caught(monkeypatch):
    """The check is not vacuous: a ``status`` that plans with one report missing (the
    stop-phase twin of committing with one ack missing) is caught, and hypothesis
    shrinks it to a short sequence."""
    import pytest
    from hypothesis.errors import Flaky
    from hypothesis.stateful import run_state_machine_as_test

    def broken(state):
        if not state.members:
            return StopStatus.NONE_LEFT
        missing = state.members - state.reported
        return StopStatus.STOPPED if len(missing) <= 1 else StopStatus.WAITING

    monkeypatch.setitem(globals(), "status", broken)
    with pytest.raises((AssertionError, Flaky), match="planned before every member"):
        run_state_machine_as_test(
            StopPhase, settings=settings(max_examples=200, deadline=None, database=None)
        )
    # The shrunk counterexample is the last sequence run: one member and no event at all
    # (or a two-member plan with one report) already plans too early.
    assert LENGTHS[-1] <= 2, LENGTHS[-1]
    print(f"broken rule caught; shrunk to a sequence of {LENGTHS[-1]} event(s)")
