"""A rank that hears a failure and does not stop writes every thread's stack to its log
(where a launch or an allocation held it is then on record); one that stops does not."""

from __future__ import annotations

import subprocess
import sys

import pytest

HELD = """
import faulthandler, time
from elaswave.runtime.worker import executor
executor.STOP_DUMP_S = 0.3
executor.dump_unless_stopped()
time.sleep({sleep})
{then}
time.sleep(1.0)
"""


@pytest.mark.parametrize("stops", [False, True])
def test_a_rank_held_past_the_stop_dump_writes_its_stacks(stops: bool) -> None:
    then = "faulthandler.cancel_dump_traceback_later()" if stops else "pass"
    code = HELD.format(sleep=0.05 if stops else 1.0, then=then)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert ("Thread 0x" in done.stderr) is not stops, done.stderr
