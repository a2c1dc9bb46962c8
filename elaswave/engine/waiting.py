"""Waiting for nodes instead of stopping (pure): when too few ranks are left to fill
every stage but no state is lost, the stopped members keep their state in memory and
the change waits for joiners (:class:`~elaswave.engine.change.Phase` ``WAITING``), up to
``Rules.wait_for_nodes_s``; joiners arriving meanwhile are planned with the survivors
(:func:`elaswave.engine.phases.plan_next`), and a wait that runs out asks the members
to write a checkpoint of the step they roll back to from what they hold in memory
(``CHECKPOINTING``), then stops the job naming how to resume. A job that does not wait
re-pipelines onto fewer stages instead (:func:`elaswave.engine.replan.replan`).
Transitions :mod:`elaswave.engine.phases` composes."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from elaswave.bus.schema import CheckpointRequest, WaitingForNodes
from elaswave.engine.change import (
    Action,
    Change,
    Note,
    Phase,
    Publish,
    Rules,
    Spawn,
    State,
    Stopped,
)
from elaswave.engine.plan import snapshot_placement
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
        checkpoint_step=exc.committed_step,
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


def waited_out(r: Rules, s: State, c: Change, then: str) -> str:
    """Why the job stops when its wait for joiners ran out; ``then``: what became of
    the state (how to resume)."""
    lost = "; ".join(
        f"stage {st.stage} (layers {st.layer_start}-{st.layer_stop - 1}) lost all its ranks "
        f"{list(st.ranks)}"
        for st in s.plan.stages
        if set(st.ranks) <= set(c.stop.failed)
    )
    return (
        f"{c.detail}; {lost}; waited {r.wait_for_nodes_s:g} s for {c.needed} more "
        f"rank{'s' if c.needed != 1 else ''} to fill every stage, and none came in time "
        f"(the job stops; {then})"
    )


def checkpoint_writers(s: State, c: Change, ranks_per_node: int) -> dict[int, int] | None:
    """Who writes each shard of the plan's ranks at ``c.checkpoint_step``: the owner,
    when it stopped at that step or the next (it keeps the shard of the step before its
    committed one, for a one-step rollback); else the holder of its host snapshot. None
    when a shard has no stopped writer."""
    placement = snapshot_placement(s.plan, ranks_per_node)
    members = c.stop.members
    step = c.checkpoint_step
    out = {}
    for owner in s.plan.ranks:
        if owner in members and s.reports[owner].committed_step in (step, step + 1):
            out[owner] = owner
        elif (holder := placement.holder.get(owner)) is not None and holder in members:
            out[owner] = holder
        else:
            return None
    return out


def begin_checkpoint(r: Rules, s: State, now: float, out: list[Action]) -> State:
    """The wait ran out: ask the stopped members to write a checkpoint of the step they
    roll back to, from their own state and the snapshots they hold (the job stops once
    every part is written; at once, naming the last periodic checkpoint, when no such
    checkpoint can be written)."""
    c = s.change
    assert c is not None
    writers = checkpoint_writers(s, c, r.ranks_per_node) if c.checkpoint_step >= 0 else None
    if writers is None or not r.resume_command:
        raise Stopped(waited_out(r, s, c, r.resume_hint))
    c = replace(
        c,
        phase=Phase.CHECKPOINTING,
        writers=frozenset(writers.values()),
        written=frozenset(),
        deadline=now + r.stop_timeout_s,
    )
    out.append(Note("core.checkpoint_requested", {"step": c.checkpoint_step}))
    out.append(Publish(checkpoint_request(c, writers)))
    return replace(s, change=c)


def checkpoint_request(c: Change, writers: Mapping[int, int]) -> CheckpointRequest:
    owners = sorted(writers)
    return CheckpointRequest(
        sender="core",
        generation=c.generation + 1,
        step=c.checkpoint_step,
        owners=owners,
        writers=[writers[o] for o in owners],
    )


def checkpointed(r: Rules, s: State, rank: int, now: float) -> State:
    """``rank`` wrote its part; with every part written the job stops, naming the
    checkpoint."""
    c = s.change
    assert c is not None
    assert c.phase is Phase.CHECKPOINTING
    c = replace(c, written=c.written | {rank})
    if c.written < c.writers:
        return replace(s, change=c)
    raise Stopped(
        waited_out(
            r,
            s,
            c,
            f"it wrote a checkpoint of step {c.checkpoint_step} from the state in memory, "
            f"the lost ranks' shards from their host snapshots: resume with "
            f"{r.resume_command}",
        )
    )


def checkpoint_failed(r: Rules, s: State, c: Change, why: str) -> str:
    """Why the job stops when a part of the checkpoint was not written."""
    missing = sorted(c.writers - c.written)
    return waited_out(
        r,
        s,
        c,
        f"ranks {missing} did not write their part of a checkpoint of step "
        f"{c.checkpoint_step} ({why}); {r.resume_hint}",
    )


def spawn(r: Rules, s: State, out: list[Action]) -> State:
    if not r.can_spawn:
        out.append(Note("core.join_refused", {"reason": "this job cannot start workers"}))
        return s
    out.append(Spawn(s.next_rank))
    return replace(s, alive=s.alive | {s.next_rank}, next_rank=s.next_rank + 1)
