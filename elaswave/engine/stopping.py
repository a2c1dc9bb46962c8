"""The stop phase of a plan change, as a pure state machine.

Before the Core can plan generation ``g + 1``, every member of generation ``g`` must have
stopped at a step boundary and reported its committed step (``RecoveryReady``), or be
known lost. Members keep failing while they stop: a node takes several ranks a few
milliseconds apart, a rank dies while the others pause for a join, a rank was already
gone when the change began. Each loss is announced (``FailureDetected(g, failed)``, the
whole failed set every time, so a member that missed one announcement learns it from the
next), and the members still in a step abort it and report.

``stop_phase`` starts it, ``on_exit`` and ``on_report`` advance it; each returns the new
state and the announcements to publish, in order. ``outcome`` says whether to keep
waiting, to plan, or that no member is left. The Core's supervisor runs this for a
failure and for a pause alike; tests drive it through random interleavings
(tests/unit/test_stopping.py).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass


class Outcome(enum.StrEnum):
    WAITING = "waiting"
    """A member has neither reported nor exited."""
    STOPPED = "stopped"
    """Every member left has reported: plan."""
    NONE_LEFT = "none-left"
    """Every member is lost: nothing is left to plan for."""


@dataclass(frozen=True, kw_only=True)
class Stopping:
    generation: int
    """The generation the change leaves."""
    members: frozenset[int]
    """Members of the plan not lost so far: each must report."""
    failed: Mapping[int, int]
    """Every rank lost so far (announced or about to be): its exit code."""
    reported: frozenset[int] = frozenset()
    """Members whose report of ``generation`` arrived."""
    announced: frozenset[int] = frozenset()
    """Failed ranks the last announcement named."""


@dataclass(frozen=True)
class Announce:
    """Publish ``FailureDetected(generation, ranks)``; ``new``: the ranks it adds."""

    generation: int
    ranks: tuple[int, ...]
    new: tuple[int, ...]


def stop_phase(
    generation: int, plan_ranks: frozenset[int], failed: Mapping[int, int]
) -> tuple[Stopping, list[Announce]]:
    """Start stopping the members of ``plan_ranks`` for a change; ``failed``: ranks of the
    plan already lost (announced at once)."""
    state = Stopping(
        generation=generation,
        members=frozenset(plan_ranks) - set(failed),
        failed=dict(failed),
    )
    return _announce(state)


def on_exit(state: Stopping, rank: int, code: int) -> tuple[Stopping, list[Announce]]:
    """A process exited. A member that exits, with any code, before its report is lost
    (one that finished cleanly cannot take part in the change either); so is a member
    that exits after reporting, since it cannot apply the plan."""
    if rank not in state.members:
        return state, []
    state = dataclasses.replace(
        state,
        members=state.members - {rank},
        reported=state.reported - {rank},
        failed={**state.failed, rank: code},
    )
    return _announce(state)


def on_report(state: Stopping, rank: int, generation: int) -> Stopping:
    """A member reported that it stopped (``RecoveryReady`` of ``generation``). Reports of
    another generation, or from a rank that is not a member (lost, or never one), change
    nothing."""
    if generation != state.generation or rank not in state.members:
        return state
    return dataclasses.replace(state, reported=state.reported | {rank})


def outcome(state: Stopping) -> Outcome:
    if not state.members:
        return Outcome.NONE_LEFT
    return Outcome.STOPPED if state.reported >= state.members else Outcome.WAITING


def _announce(state: Stopping) -> tuple[Stopping, list[Announce]]:
    new = sorted(set(state.failed) - state.announced)
    if not new or not state.members:
        return state, []
    ranks = tuple(sorted(state.failed))
    return dataclasses.replace(state, announced=frozenset(ranks)), [
        Announce(state.generation, ranks, tuple(new))
    ]
