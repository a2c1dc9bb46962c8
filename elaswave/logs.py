"""structlog set-up shared by every ElasWave process.

Key-value events, logged to stderr so that the CLI's user-facing output on stdout stays
clean. Each process renders them one of three ways (:class:`Output`): JSON lines, the
default when stderr is not a terminal (and always in the Core and the workers, whose
logs go to ``RUN_DIR/logs/``); structlog's console lines, the default on a terminal; or,
for ``elaswave train`` and ``run`` on a terminal (``--log-format auto``), handed to the
CLI, which shows a person the few that matter as sentences (:class:`PeopleSink`).

A child's log (the Core's JSON lines, relayed by the job host) reaches this process's
stderr through :func:`relay`, rendered the way this process renders its own.
"""

from __future__ import annotations

import enum
import json as jsonlib
import logging
import os
import sys
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, Protocol

import structlog


class LogFormat(enum.StrEnum):
    """``--log-format``: how ``elaswave train`` and ``run`` show structured logs."""

    AUTO = "auto"
    """Sentences for people on a terminal, JSON lines otherwise."""
    CONSOLE = "console"
    """structlog's key-value lines."""
    JSON = "json"
    """One JSON object per line."""


class Output(enum.StrEnum):
    """How this process renders its log records (and the ones it relays)."""

    JSON = "json"
    CONSOLE = "console"
    PEOPLE = "people"
    """Handed to a :class:`PeopleSink`."""


class PeopleSink(Protocol):
    """Shows a person the log records that matter, as sentences. ``relayed``: the
    record comes from a child's log (the Core's), not from this process."""

    def __call__(self, record: Mapping[str, Any], *, relayed: bool) -> None: ...


Write = Callable[[str], None]
"""Writes one line (without its newline) where a person reads this process's log."""

_output: Output | None = None
"""What :func:`configure` chose; None before it runs (then as ``configure()``)."""
_people: PeopleSink | None = None


def _to_stderr(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


_write: Write = _to_stderr


def configure(*, json: bool | None = None, level: str | None = None) -> None:
    """Configure structlog once per process: JSON lines (``json``; by default when
    stderr is not a terminal) or console lines. ``ELASWAVE_LOG_LEVEL`` overrides
    ``level``."""
    if json is None:
        json = not sys.stderr.isatty()
    _apply(Output.JSON if json else Output.CONSOLE, level, None, None)


def configure_for(
    log_format: LogFormat, people: PeopleSink, write: Write, *, level: str | None = None
) -> None:
    """Configure structlog as ``--log-format`` asks: ``auto`` hands records to
    ``people`` when stderr is a terminal and writes JSON lines otherwise. Every line
    goes through ``write`` (the CLI's, which keeps it off the progress line)."""
    match log_format:
        case LogFormat.JSON:
            _apply(Output.JSON, level, None, write)
        case LogFormat.CONSOLE:
            _apply(Output.CONSOLE, level, None, write)
        case LogFormat.AUTO if sys.stderr.isatty():
            _apply(Output.PEOPLE, level, people, write)
        case LogFormat.AUTO:
            _apply(Output.JSON, level, None, write)


def output() -> Output:
    """How this process renders its records (as ``configure()`` would, before it runs)."""
    if _output is not None:
        return _output
    return Output.CONSOLE if sys.stderr.isatty() else Output.JSON


def relay(line: bytes) -> None:
    """Write one line of a child's JSON log where this process writes its own, rendered
    as it renders its own records. A line that is not a JSON record (a crash's output)
    is written as it is."""
    out = output()
    record = _record(line) if out is not Output.JSON else None
    if record is None:
        _write(line.decode(errors="replace").removesuffix("\n"))
    elif out is Output.PEOPLE:
        assert _people is not None
        _people(record, relayed=True)
    else:
        _write(_CONSOLE(None, "", dict(record)))


_CONSOLE = structlog.dev.ConsoleRenderer(colors=False)


def _record(line: bytes) -> dict[str, Any] | None:
    try:
        record = jsonlib.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and "event" in record else None


def _apply(out: Output, level: str | None, people: PeopleSink | None, write: Write | None) -> None:
    global _output, _people, _write
    _output, _people, _write = out, people, write or _to_stderr
    level_name = (os.environ.get("ELASWAVE_LOG_LEVEL") or level or "warning").upper()
    numeric = logging.getLevelNamesMapping().get(level_name, logging.WARNING)
    last: list[structlog.typing.Processor]
    if out is Output.PEOPLE:
        assert people is not None
        last = [structlog.processors.format_exc_info, _HandTo(people)]
    elif out is Output.JSON:
        last = [structlog.processors.JSONRenderer()]
    else:
        last = [_CONSOLE]
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            *last,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        # The stream is looked up when a logger is made, not now: a host that swaps
        # sys.stderr (a test runner's capture, an embedding program) keeps logging to
        # the current one instead of a stream it has since closed.
        logger_factory=_stderr_logger if write is None else _LineLogger.factory(write),
        cache_logger_on_first_use=False,
    )


class _HandTo:
    """The last processor for people: give the record to the sink, print nothing."""

    def __init__(self, people: PeopleSink) -> None:
        self.people = people

    def __call__(self, logger: Any, method: str, event: MutableMapping[str, Any]) -> str:
        self.people(event, relayed=False)
        raise structlog.DropEvent


def _stderr_logger(*args: object) -> structlog.PrintLogger:
    return structlog.PrintLogger(file=sys.stderr)


class _LineLogger:
    """A structlog logger that hands each rendered line to a :data:`Write`."""

    def __init__(self, write: Write) -> None:
        self._write = write

    @classmethod
    def factory(cls, write: Write) -> Callable[..., _LineLogger]:
        return lambda *args: cls(write)

    def msg(self, message: str) -> None:
        self._write(message)

    log = debug = info = warn = warning = err = error = critical = exception = fatal = msg
