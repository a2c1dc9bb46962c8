"""The embedding API: attach your own process to a running ElasWave job's bus.

    import elaswave

    with elaswave.connect("runs/demo", sender="dashboard") as session:
        session.subscribe(print, kinds=[elaswave.EventKind.RECOVERY_FINISHED])
        ...

See :class:`elaswave.bus.session.Session` for publishing, callbacks and the async
iterator, and examples/embed_training.py for a training loop that uses them.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from elaswave.bus.schema import Topic
from elaswave.bus.session import Session
from elaswave.rundir import JOB
from elaswave.runtime.job.config import JobSpec


def connect(
    run_dir: str | Path, *, sender: str = "observer", topics: Iterable[Topic] | None = None
) -> Session:
    """A :class:`Session` on the bus of the job whose run directory is ``run_dir``.

    Like a constructed Session it is not started yet: use ``with elaswave.connect(...)``,
    or call ``.start()`` (and later ``.close()``). Set up callbacks and ``events()``
    iterators before starting so that no early event is missed.
    """
    run_dir = Path(run_dir)
    if not (run_dir / JOB).is_file():
        raise ValueError(f"{str(run_dir)!r} has no {JOB}: not a running job's run directory")
    spec = JobSpec.read(run_dir)
    endpoints = spec.endpoints
    return Session(
        sender,
        endpoints.bus_publish,
        endpoints.bus_subscribe,
        topics,
        keys=spec.config.network.keys(),
        fetch_endpoint=endpoints.bus_fetch or None,
    )
