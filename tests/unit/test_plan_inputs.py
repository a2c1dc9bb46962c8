"""The planner inputs a change announces: encoded into a RecoveryPlan and decoded from
it by one codec (the Core, the workers and replay all go through it)."""

from __future__ import annotations

import dataclasses

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from elaswave.bus.codec import decode as decode_frames
from elaswave.bus.codec import encode as encode_frames
from elaswave.bus.schema import RecoveryKind
from elaswave.engine.migration import MigrationMode
from elaswave.engine.plan_inputs import PlanInputs, PlanOutcome, announcement, decode, rebalancing
from elaswave.engine.rebalance import Policy
from elaswave.engine.recovery import Rebalancing

RANKS = st.lists(st.integers(0, 15), unique=True, max_size=4).map(tuple)
INPUTS = st.builds(
    PlanInputs,
    failed=RANKS,
    joined=RANKS,
    policy=st.sampled_from(list(Policy)),
    slowdowns=st.dictionaries(st.integers(0, 15), st.floats(1.0, 8.0), max_size=3),
    stale=RANKS,
    migration=st.sampled_from(list(MigrationMode)),
)
OUTCOME = PlanOutcome(
    generation=3, attempt=1, kind=RecoveryKind.FAIL_STOP, committed_step=7,
    plan_digest="0123456789abcdef", reason="why", rebuild=("dp.0",),
)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(INPUTS)
def test_announced_inputs_decode_back_equal(inputs: PlanInputs) -> None:
    event = announcement(inputs, OUTCOME)
    assert decode(event) == inputs
    on_the_wire = decode_frames(encode_frames(dataclasses.replace(event, seq=1)))
    assert decode(on_the_wire) == inputs  # through the bus's own codec too


def test_the_announcement_carries_the_inputs_in_the_recovery_plan_s_fields() -> None:
    inputs = PlanInputs(
        failed=(1, 3), joined=(5,), policy=Policy.MIGRATE, slowdowns={4: 2.0, 0: 1.5},
        stale=(2,), migration=MigrationMode.BLOCKING,
    )  # fmt: skip
    event = announcement(inputs, OUTCOME)
    assert (event.failed, event.joined, event.stale) == ([1, 3], [5], [2])
    assert (event.policy, event.migration) == ("migrate", "blocking")
    assert (event.slow_ranks, event.slow_factors) == ([0, 4], [1.5, 2.0])
    assert (event.generation, event.attempt, event.committed_step) == (3, 1, 7)
    assert (event.plan_digest, event.reason, event.rebuild) == ("0123456789abcdef", "why", ["dp.0"])
    assert event.kind == "fail-stop" and event.sender == "core"


def test_a_migration_no_core_announces_is_refused() -> None:
    event = dataclasses.replace(
        announcement(PlanInputs(failed=(1,), policy=Policy.RESIZE), OUTCOME), migration="teleport"
    )
    with pytest.raises(ValueError, match="announces migration 'teleport'; valid: none, blocking"):
        decode(event)


def test_the_planner_takes_the_announced_policy_and_slowdowns_with_the_job_s_cost_model() -> None:
    job = Rebalancing(policy=Policy.RESIZE, power_budget=4.0, shorten=True)
    inputs = PlanInputs(failed=(), policy=Policy.MIGRATE, slowdowns={1: 3.0})
    assert rebalancing(inputs, job) == dataclasses.replace(
        job, policy=Policy.MIGRATE, slowdowns={1: 3.0}
    )
