"""A worker that runs the user's script (``elaswave run``): the script trains through the
embedded API (:mod:`elaswave.embedded`), which finds this process's step loop here.

The runtime owns the registry and the layer above reads it: nothing in the runtime
imports the embedded API.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the registry stays light: the embedded API imports it in any process
    from elaswave.runtime.worker.steploop import StepLoop

_installed: StepLoop | None = None


def installed_loop() -> StepLoop | None:
    """The step loop this worker runs the user's script around (None outside one)."""
    return _installed


def run_script(loop: StepLoop, script: tuple[str, ...]) -> None:
    """Run the user's script as this worker's training loop, with ``loop`` installed
    for ``elaswave.job()``."""
    global _installed
    _installed = loop
    sys.argv = list(script)
    sys.path.insert(0, str(Path(script[0]).resolve().parent))
    try:
        runpy.run_path(script[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise RuntimeError(f"{script[0]} exited with status {exc.code}") from None
    if not loop.done:
        raise RuntimeError(
            f"{script[0]} returned at step {loop.step} of {loop.cfg.schedule.steps}: call "
            "job.train_step() until job.done"
        )
    loop.finish()
