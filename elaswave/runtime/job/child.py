"""What every process the job host starts (the workers, the Core) does on its way in
and out."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import NoReturn

RULE_BROKEN = 4
"""A worker's exit code when it broke a rule of its device's backend (the ``cpu-strict``
device's :class:`~elaswave.comm.strict.StrictViolation`): a bug in the data plane that
recovering would hide, so the job stops and names it."""


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process if the job host dies, so nothing trains (or
    plans) on without the store and the workers' owner."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux: the host's own cleanup is all there is
    if os.getppid() != parent:  # the host died before prctl took effect
        os._exit(1)


def exit_now(code: int) -> NoReturn:
    """Leave at once. Results are on disk and the bus session has flushed and closed;
    interpreter teardown of gloo pairs, the store client and torch takes seconds on a
    loaded host and protects nothing."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
