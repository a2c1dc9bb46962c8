"""A run's logs read together: the event log and the health log, in receive order.

The Core writes the run's events to RUN_DIR/events.log for its life and the liveness
and timing chatter (step timings, sampled heartbeats, node agents' heartbeats) to the
rolling log RUN_DIR/health, which keeps its newest records only
(:mod:`elaswave.runtime.core.recorder`). ``elaswave events`` and whoever watches a job's
progress by its step timings read both; restore, replay, the summary and the report
read the event log alone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from elaswave.bus.eventlog import LogRecord, merge_by_time, read_event_log
from elaswave.bus.rolling import read_rolling_log
from elaswave.rundir import EVENT_LOG, HEALTH_LOG


def read_run_log(run_dir: Path, *, health: bool = True) -> Iterator[LogRecord]:
    """The records of RUN_DIR's event log and (``health``) health log, in the order
    the Core received them; none where the run has no event log yet."""
    path = run_dir / EVENT_LOG
    if not path.is_file():
        return iter(())
    logs = [read_event_log(path)]
    if health:
        logs.append(read_rolling_log(run_dir / HEALTH_LOG))
    return merge_by_time(*logs)
