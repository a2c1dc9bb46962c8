"""What the change protocol asks the Core's shell to do, as pure data
(:mod:`elaswave.runtime.core.supervisor` carries each out, in order)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from elaswave.bus.schema import Event
from elaswave.engine.plan import Plan


@dataclass(frozen=True)
class Publish:
    event: Event


@dataclass(frozen=True)
class Kill:
    """SIGKILL the worker (fenced)."""

    rank: int


@dataclass(frozen=True)
class Terminate:
    """Ask a joiner to leave (the job is over)."""

    rank: int


@dataclass(frozen=True)
class Spawn:
    """Start a worker that joins the running job as ``rank``."""

    rank: int


@dataclass(frozen=True)
class SharePlan:
    """Put the current plan where joiners read it (the store)."""

    plan: Plan


@dataclass(frozen=True)
class Note:
    """A log line: ``event`` with ``fields``."""

    event: str
    fields: Mapping[str, Any]


@dataclass(frozen=True)
class Stop:
    """The job cannot go on: stop it with ``reason``."""

    reason: str


Action = Publish | Kill | Terminate | Spawn | SharePlan | Note | Stop


class Stopped(Exception):
    """The job cannot go on (internal to the transitions: becomes a :class:`Stop`)."""
