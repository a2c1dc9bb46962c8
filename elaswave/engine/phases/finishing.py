"""After a change (pure): its plan runs, and its record waits for the redone step
(MTTR ends when it completes: :func:`redone`) and, for a non-blocking migration, for
every rank's MigrationDone (what it streamed). Then the Core announces
RecoveryFinished (:func:`finish`); a wait that runs out announces it with what came.
"""

from __future__ import annotations

import dataclasses

from elaswave.bus.schema import CORE_SENDER, RecoveryFinished
from elaswave.engine.actions import Action, Publish
from elaswave.engine.change import State
from elaswave.engine.record import RecoveryRecord, Streamed
from elaswave.engine.rules import Rules

replace = dataclasses.replace


def redone(s: State, step: int, at: float) -> State:
    """The job completed ``step`` at ``at``: the change that redoes it ends its MTTR."""
    finishing = []
    for f in s.finishing:
        if f.redone_at is None and f.redo == step and at >= f.planned_at:
            record = s.recoveries[f.index]
            phases = replace(record.phases, redo=max(0.0, at - f.done_at))
            s = _set_record(s, f.index, replace(record, mttr_s=at - f.origin, phases=phases))
            f = replace(f, redone_at=at)
        finishing.append(f)
    return replace(s, finishing=tuple(finishing))


def finish(r: Rules, s: State, now: float, out: list[Action]) -> State:
    """Announce RecoveryFinished for each change whose redone step completed (and whose
    migration every rank finished), or whose wait ran out."""
    keep = []
    for f in s.finishing:
        migrated = {k: v for k, v in s.migrated.items() if k[0] == f.generation}
        if f.redone_at is None:
            due = now >= f.deadline
        else:
            due = len(migrated) >= f.ranks or now >= f.redone_at + r.migrated_wait_s
        if not due:
            keep.append(f)
            continue
        record = s.recoveries[f.index]
        if migrated:
            streamed = Streamed(
                bytes_streamed=sum(m.bytes_streamed for m in migrated.values()),
                waited_s=max(m.waited_s for m in migrated.values()),
            )
            record = replace(record, migration=replace(record.migration, streamed=streamed))
            s = _set_record(s, f.index, record)
            s = replace(s, migrated={k: v for k, v in s.migrated.items() if k[0] != f.generation})
        out.append(
            Publish(
                RecoveryFinished(
                    sender=CORE_SENDER,
                    generation=f.generation,
                    step=f.redo,
                    kind=str(record.kind),
                    ranks=list(record.ranks),
                    mttr_s=record.mttr_s,
                    joined=list(record.joined),
                )
            )
        )
    if len(keep) == len(s.finishing):
        return s
    return replace(s, finishing=tuple(keep))


def _set_record(s: State, index: int, record: RecoveryRecord) -> State:
    return replace(s, recoveries=(*s.recoveries[:index], record, *s.recoveries[index + 1 :]))
