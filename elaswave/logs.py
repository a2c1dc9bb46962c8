"""structlog set-up shared by every ElasWave process.

Key-value events; JSON lines when stderr is not a terminal, a console renderer when it is.
Logging goes to stderr so that the CLI's user-facing output on stdout stays clean.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure(*, json: bool | None = None, level: str | None = None) -> None:
    """Configure structlog once per process. ``ELASWAVE_LOG_LEVEL`` overrides ``level``."""
    level_name = (os.environ.get("ELASWAVE_LOG_LEVEL") or level or "warning").upper()
    numeric = logging.getLevelNamesMapping().get(level_name, logging.WARNING)
    if json is None:
        json = not sys.stderr.isatty()
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        # The stream is looked up when a logger is made, not now: a host that swaps
        # sys.stderr (a test runner's capture, an embedding program) keeps logging to
        # the current one instead of a stream it has since closed.
        logger_factory=_stderr_logger,
        cache_logger_on_first_use=False,
    )


def _stderr_logger(*args: object) -> structlog.PrintLogger:
    return structlog.PrintLogger(file=sys.stderr)
