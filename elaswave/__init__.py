"""ElasWave: an elastic-native runtime for hybrid-parallel LLM training.

Layers import downward only: bus -> comm -> fabric -> engine -> runtime -> cli.
``model`` and ``data`` are leaf packages any layer may use.

Your script as a worker of an elastic job (``elaswave run``): :func:`job`
(:mod:`elaswave.embedded`). Observing a job from another process: :func:`connect` and
:class:`Session`. Events are in :mod:`elaswave.bus.schema`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from elaswave.api import connect
    from elaswave.bus.schema import EventKind
    from elaswave.bus.session import Session
    from elaswave.embedded import Job, job

_LAZY = {
    "connect": "elaswave.api",
    "Session": "elaswave.bus.session",
    "EventKind": "elaswave.bus.schema",
    "job": "elaswave.embedded",
    "Job": "elaswave.embedded",
}


def __getattr__(name: str) -> Any:
    # Lazy, so that importing a leaf package (elaswave.model, ...) does not load the bus.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'elaswave' has no attribute {name!r}")


__all__ = ["EventKind", "Job", "Session", "__version__", "connect", "job"]
