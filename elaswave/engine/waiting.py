"""Waiting for nodes instead of stopping (pure): when too few ranks are left to fill
every stage but no state is lost, the stopped members keep their state in memory and
the change waits for joiners (:class:`~elaswave.engine.change.Phase` ``WAITING``), up to
``Rules.wait_for_nodes_s``; joiners arriving meanwhile are planned with the survivors
(:func:`elaswave.engine.phases.plan_next`), and a wait that runs out stops the job
naming how to resume. Transitions :mod:`elaswave.engine.phases` composes."""

from __future__ import annotations

import dataclasses

from elaswave.bus.schema import WaitingForNodes
from elaswave.engine.change import Action, Change, Note, Phase, Publish, Rules, Spawn, State
from elaswave.fabric.errors import TooFewRanks

replace = dataclasses.replace


def wait_for_nodes(r: Rules, s: State, exc: TooFewRanks, now: float, out: list[Action]) -> State:
    """Too few ranks are left for the stages: the stopped members keep their state and
    wait for joiners until ``r.wait_for_nodes_s`` after the wait began (the deadline
    :func:`advance` stops the job at). Announced again whenever what is missing
    changes. Joiners the job schedules (``join@STEP``) are started at once, as many as
    are missing: the steps they were due at cannot come while the job waits."""
    c = s.change
    assert c is not None
    since = now if c.waiting_since < 0 else c.waiting_since
    c = replace(
        c,
        phase=Phase.WAITING,
        needed=exc.needed,
        waiting_since=since,
        deadline=since + r.wait_for_nodes_s,
        participants=frozenset(),
        acked=frozenset(),
    )
    s = replace(s, change=c)
    reason = f"{c.detail}; {exc}"
    out.append(Note("core.waiting_for_nodes", {"needed": exc.needed, "joined": list(c.joined)}))
    out.append(
        Publish(
            WaitingForNodes(
                sender="core",
                generation=c.generation + 1,
                needed=exc.needed,
                wait_s=r.wait_for_nodes_s,
                since=since,
                reason=reason,
            )
        )
    )
    coming = s.alive - set(s.plan.ranks) - set(c.joined)  # started, not joining yet
    while len(coming) < exc.needed and s.joins_done < len(r.join_steps) and r.can_spawn:
        s = spawn(r, replace(s, joins_done=s.joins_done + 1), out)
        coming = s.alive - set(s.plan.ranks) - set(c.joined)
    return s


def waited_out(r: Rules, s: State, c: Change) -> str:
    """Why the job stops when its wait for joiners ran out."""
    lost = "; ".join(
        f"stage {st.stage} (layers {st.layer_start}-{st.layer_stop - 1}) lost all its ranks "
        f"{list(st.ranks)}"
        for st in s.plan.stages
        if set(st.ranks) <= set(c.stop.failed)
    )
    return (
        f"{c.detail}; {lost}; waited {r.wait_for_nodes_s:g} s for {c.needed} more "
        f"rank{'s' if c.needed != 1 else ''} to fill every stage, and none came in time "
        f"(the job stops; {r.resume_hint})"
    )


def spawn(r: Rules, s: State, out: list[Action]) -> State:
    if not r.can_spawn:
        out.append(Note("core.join_refused", {"reason": "this job cannot start workers"}))
        return s
    out.append(Spawn(s.next_rank))
    return replace(s, alive=s.alive | {s.next_rank}, next_rank=s.next_rank + 1)
