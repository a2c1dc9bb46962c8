"""What the Core observes as the change protocol's inputs: one mapping from bus events
(observe.to_input), which also decides what the recorder hands the supervisor."""

from __future__ import annotations

import pytest

from elaswave.bus.schema import (
    CheckpointWritten,
    FailureDetected,
    Heartbeat,
    MigrationDone,
    PlanAck,
    RecoveryDone,
    RecoveryReady,
    ScaleRequest,
    StepCompleted,
    StepTiming,
    WorkerStarted,
)
from elaswave.engine import inputs as inp
from elaswave.runtime.core.observe import takes, to_input

S = {"sender": "rank1", "generation": 2}
STARTED = {**S, "rank": 5, "stage": 0, "replica": 0, "pid": 1, "host": "h"}


@pytest.mark.parametrize(
    ("event", "kind"),
    [
        (RecoveryReady(**S, rank=1, committed_step=3), inp.Ready),
        (PlanAck(**S, rank=1, plan_digest="d"), inp.Acked),
        (RecoveryDone(**S, rank=1, comm_s=0, remap_s=0, resume_s=0), inp.Done),
        (MigrationDone(**S, rank=1, step=4, early=0, bytes_streamed=8, waited_s=0), inp.Migrated),
        (StepCompleted(**S, rank=1, step=4, loss=1, step_time_s=1, samples=8), inp.StepDone),
        (StepTiming(**S, rank=1, step=4, compute_s=1, expected_s=1, micro_batches=2), inp.Trained),
        (ScaleRequest(sender="cli", add=1), inp.ScaleUp),
        (CheckpointWritten(**S, rank=1, step=3, owners=[1]), inp.Checkpointed),
        (WorkerStarted(**STARTED, joining=True), inp.Joining),
        (WorkerStarted(**STARTED), None),  # a member's start is no input
        (Heartbeat(**S, rank=1, step=4), None),
        (FailureDetected(sender="core", generation=2, ranks=[1], source="x"), None),
    ],
)
def test_the_protocol_takes_exactly_the_events_it_maps(event, kind) -> None:
    got = to_input(event, 5.0, 0)
    assert (type(got) if got is not None else None) is kind
    assert takes(event) is (kind is not None)
