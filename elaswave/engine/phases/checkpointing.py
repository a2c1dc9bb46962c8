"""Checkpointing after a wait for nodes that ran out (pure): each shard at the step the
survivors roll back to is written by its owner (stopped at that step or the next: the
optimizer keeps the step before) or by the holder of its host snapshot
(``CheckpointRequest(step, owners, writers)``). With every part written the job stops
naming ``--resume RUN_DIR``; a writer lost or late stops it naming the last periodic
checkpoint instead. A restarted Core asks again (a part is written idempotently).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from elaswave.bus.schema import CORE_SENDER, CheckpointRequest
from elaswave.engine.actions import Action, Note, Publish, Stopped
from elaswave.engine.change import Change, Checkpointing, State, Waiting
from elaswave.engine.inputs import Checkpointed, Exited, Input, Restarted
from elaswave.engine.phases.shared import describe, with_phase, without_joiner
from elaswave.engine.plan import snapshot_placement
from elaswave.engine.rules import Rules

replace = dataclasses.replace


def begin_checkpoint(
    r: Rules, s: State, c: Change, p: Waiting, now: float, out: list[Action]
) -> State:
    """The wait ran out: ask the stopped members to write a checkpoint of the step they
    roll back to, from their own state and the snapshots they hold (the job stops once
    every part is written; at once, naming the last periodic checkpoint, when no such
    checkpoint can be written)."""
    writers = (
        checkpoint_writers(s, p.members, p.step, r.ranks_per_node, r.snapshot_copies)
        if p.step >= 0
        else None
    )
    if writers is None or not r.resume_command:
        raise Stopped(_waited_out(r, s, c, p.failed, p.needed, r.resume_hint))
    q = Checkpointing(
        members=p.members,
        failed=p.failed,
        needed=p.needed,
        step=p.step,
        writers=frozenset(writers.values()),
        deadline=now + r.stop_timeout_s,
    )
    out.append(Note("core.checkpoint_requested", {"step": q.step}))
    out.append(Publish(_request(c, q.step, writers)))
    return with_phase(s, c, q)


def take(
    r: Rules, s: State, c: Change, p: Checkpointing, e: Input, now: float, out: list[Action]
) -> State:
    """What ``e`` does while the members write the checkpoint."""
    match e:
        case Exited(rank=rank) if rank not in s.plan.ranks:  # a joiner leaves the change
            return without_joiner(s, c, rank)
        case Exited(rank=rank, code=code) if rank in p.writers - p.written:
            raise Stopped(_failed(r, s, c, p, describe(s, {rank: code})))
        case Checkpointed(rank=rank, generation=g, step=step) if (g, step) == (
            c.generation + 1,
            p.step,
        ) and rank in p.writers:
            return _written(r, s, c, p, rank)
        case Restarted():  # ask again (a part is written idempotently)
            writers = checkpoint_writers(s, p.members, p.step, r.ranks_per_node, r.snapshot_copies)
            assert writers is not None, "the writers were found before"
            out.append(Publish(_request(c, p.step, writers)))
            return with_phase(s, c, replace(p, deadline=now + r.stop_timeout_s))
    return s


def due(r: Rules, s: State, c: Change, p: Checkpointing, now: float, out: list[Action]) -> State:
    """A part not written by the deadline stops the job."""
    if now >= p.deadline:
        raise Stopped(_failed(r, s, c, p, f"within {r.stop_timeout_s:g} s"))
    return s


def checkpoint_writers(
    s: State, members: frozenset[int], step: int, ranks_per_node: int, copies: int = 1
) -> dict[int, int] | None:
    """Who writes each shard of the plan's ranks at ``step``: the owner, when it is
    among ``members`` and stopped at that step or the next (it keeps the shard of the
    step before its committed one, for a one-step rollback); else the holder of its
    host snapshot. None when a shard has no stopped writer."""
    placement = snapshot_placement(s.plan, ranks_per_node, copies)
    out = {}
    for owner in s.plan.ranks:
        if owner in members and s.reports[owner].committed_step in (step, step + 1):
            out[owner] = owner
        elif held := [h for h in placement.holders_of(owner) if h in members]:
            out[owner] = held[0]
        else:
            return None
    return out


def _written(r: Rules, s: State, c: Change, p: Checkpointing, rank: int) -> State:
    """``rank`` wrote its part; with every part written the job stops, naming the
    checkpoint."""
    p = replace(p, written=p.written | {rank})
    if p.written < p.writers:
        return with_phase(s, c, p)
    raise Stopped(
        _waited_out(
            r,
            s,
            c,
            p.failed,
            p.needed,
            f"it wrote a checkpoint of step {p.step} from the state in memory, "
            f"the lost ranks' shards from their host snapshots: resume with "
            f"{r.resume_command}",
        )
    )


def _request(c: Change, step: int, writers: Mapping[int, int]) -> CheckpointRequest:
    owners = sorted(writers)
    return CheckpointRequest(
        sender=CORE_SENDER,
        generation=c.generation + 1,
        step=step,
        owners=owners,
        writers=[writers[o] for o in owners],
    )


def _failed(r: Rules, s: State, c: Change, p: Checkpointing, why: str) -> str:
    """Why the job stops when a part of the checkpoint was not written."""
    missing = sorted(p.writers - p.written)
    return _waited_out(
        r,
        s,
        c,
        p.failed,
        p.needed,
        f"ranks {missing} did not write their part of a checkpoint of step "
        f"{p.step} ({why}); {r.resume_hint}",
    )


def _waited_out(
    r: Rules, s: State, c: Change, failed: frozenset[int], needed: int, then: str
) -> str:
    """Why the job stops when its wait for joiners ran out; ``then``: what became of
    the state (how to resume)."""
    lost = "; ".join(
        f"stage {st.stage} (layers {st.layer_start}-{st.layer_stop - 1}) lost all its ranks "
        f"{list(st.ranks)}"
        for st in s.plan.stages
        if set(st.ranks) <= failed
    )
    return (
        f"{c.detail}; {lost}; waited {r.wait_for_nodes_s:g} s for {needed} more "
        f"rank{'s' if needed != 1 else ''} to fill every stage, and none came in time "
        f"(the job stops; {then})"
    )
