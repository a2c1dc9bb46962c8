"""Operating-system names for the threads of ElasWave's processes.

Before Python 3.14 a thread started from Python keeps its process's name at the OS level
(``python3`` in ``/proc/PID/task/TID/comm``, ``top -H``, ``gdb``, a profiler's thread
list), as does every thread a native library starts without naming it. A count of a
worker's threads by name (scripts/gpu_check's churn case: what a survivor holds beyond a
worker that joined last) then cannot tell ElasWave's own threads from torch's or NCCL's.
:func:`name_new_threads`, called once at the start of a Core or worker process, gives
every thread the ``threading`` module starts from then on its Python name at the OS level
as well (its first 15 bytes: Linux's limit). NCCL names its own threads when asked
(``NCCL_SET_THREAD_NAME``, which :mod:`elaswave.comm.backend` sets unless the user did).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
import threading
from types import FrameType
from typing import Any

PR_SET_NAME = 15
"""prctl(2)'s option that names the calling thread."""
NAME_BYTES = 15
"""The longest OS thread name Linux keeps (16 bytes with the terminating NUL)."""


def os_name(name: str) -> bytes:
    """What the OS keeps of the thread name ``name``."""
    return name.encode("utf-8", "replace")[:NAME_BYTES]


@functools.cache
def _libc() -> Any:
    """The C library, or None off Linux (where prctl does not exist)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def set_os_name(name: str) -> bool:
    """Name the calling thread ``name`` at the OS level; False where that is not possible."""
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.prctl(PR_SET_NAME, ctypes.c_char_p(os_name(name)), 0, 0, 0) == 0)


def _name_then_restore(previous: Any, frame: FrameType, event: str, arg: object) -> object:
    """A new thread's first profile event: name the thread, then hand the thread the
    profile function it would have had without :func:`name_new_threads`."""
    set_os_name(threading.current_thread().name)
    sys.setprofile(previous)
    return None if previous is None else previous(frame, event, arg)


def name_new_threads() -> None:
    """From now on, name each thread the ``threading`` module starts after its Python
    name. A thread's first profile event does it (``threading.setprofile``), and the
    thread then runs with the profile function set before, if any: a user's profiler
    still sees every call. Nothing to do on Python 3.14 and later (Python names them)
    or off Linux; calling it again changes nothing."""
    if sys.version_info >= (3, 14) or _libc() is None:
        return
    previous = threading.getprofile()
    if isinstance(previous, functools.partial) and previous.func is _name_then_restore:
        return
    threading.setprofile(functools.partial(_name_then_restore, previous))
