"""A run's logs read together: the event log and the health log, in receive order.

The Core writes the run's events to RUN_DIR/events.log for its life and the liveness
and timing chatter (step timings, sampled heartbeats, node agents' heartbeats) to the
rolling log RUN_DIR/health, which keeps its newest records only
(:mod:`elaswave.runtime.core.recorder`). ``elaswave events`` and whoever watches a job's
progress by its step timings read both; restore, replay, the summary and the report
read the event log alone. :class:`RecordFilter` picks the records ``elaswave events``
prints (``--kind``, ``--rank``)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from elaswave.bus.eventlog import LogRecord, merge_by_time, read_event_log
from elaswave.bus.rolling import read_rolling_log
from elaswave.bus.schema import Event, EventKind
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


RANK_FIELDS = ("rank", "ranks", "failed", "joined", "slow_ranks")
"""The fields that name the ranks an event is about (a worker's own, or a change's)."""


@dataclass(frozen=True)
class RecordFilter:
    """Which records ``elaswave events`` prints: of these kinds (None: any), about these
    ranks (None: any; an event is about a rank it names in :data:`RANK_FIELDS` or that
    sent it). A record that is not a valid event passes only where neither is asked."""

    kinds: frozenset[str] | None = None
    ranks: frozenset[int] | None = None

    def __call__(self, record: LogRecord) -> bool:
        event = record.event
        if event is None:
            return self.kinds is None and self.ranks is None
        if self.kinds is not None and event.KIND.value not in self.kinds:
            return False
        return self.ranks is None or not self.ranks.isdisjoint(_ranks_of(event))


def _ranks_of(event: Event) -> set[int]:
    ranks = set()
    for name in RANK_FIELDS:
        value = getattr(event, name, None)
        if isinstance(value, int):
            ranks.add(value)
        elif isinstance(value, list):
            ranks.update(r for r in value if isinstance(r, int))
    if (sender := _SENDER_RANK.match(event.sender)) is not None:
        ranks.add(int(sender[1]))
    return ranks


_SENDER_RANK = re.compile(r"^rank(\d+)(?:\.\d+)?$")


def parse_kinds(text: str) -> frozenset[str]:
    """``--kind failure_detected,recovery_plan`` -> the kinds; ValueError names a kind
    that is not one and lists those that are."""
    kinds = frozenset(k.strip() for k in text.split(",") if k.strip())
    valid = {k.value for k in EventKind}
    unknown = sorted(kinds - valid)
    if unknown or not kinds:
        raise ValueError(
            f"--kind {text!r}: {', '.join(map(repr, unknown)) or 'no kind'} is not an event "
            f"kind; valid kinds: {', '.join(sorted(valid))}"
        )
    return kinds


def parse_ranks(text: str) -> frozenset[int]:
    """``--rank 3`` or ``--rank 1,5,9`` -> the ranks; ValueError names the value."""
    parts = [p.strip() for p in text.split(",")]
    if not parts or not all(p.isdigit() for p in parts):
        raise ValueError(f"--rank {text!r}: expected ranks as integers, e.g. 3 or 1,5,9")
    return frozenset(int(p) for p in parts)
