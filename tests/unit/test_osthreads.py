"""ElasWave's processes name their threads at the OS level, so that a count of a
worker's threads by name (/proc/PID/task/TID/comm) tells whose they are."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest

from elaswave import osthreads

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or sys.version_info >= (3, 14),
    reason="prctl names threads on Linux only; Python 3.14 names them itself",
)


def _os_name(native_id: int) -> str:
    return Path(f"/proc/self/task/{native_id}/comm").read_text().strip()


def _run(name: str, body=lambda: None) -> str:
    """Start a thread called ``name`` running ``body``; its OS name, read while it runs."""
    seen: list[str] = []

    def target() -> None:
        body()
        seen.append(_os_name(threading.get_native_id()))

    thread = threading.Thread(target=target, name=name)
    thread.start()
    thread.join()
    return seen[0]


@pytest.fixture
def restored_profile() -> Iterator[None]:
    before = threading.getprofile()
    yield
    threading.setprofile(before)


def test_threads_started_afterwards_carry_their_python_name(restored_profile: None) -> None:
    assert _run("ew-before") != "ew-before"  # the process's name, as before
    osthreads.name_new_threads()
    assert _run("ew-abort-dp0") == "ew-abort-dp0"
    assert _run("a-name-longer-than-fifteen") == "a-name-longer-t"  # Linux keeps 15 bytes


def test_a_profile_set_before_still_sees_every_new_threads_calls(restored_profile: None) -> None:
    calls: list[str] = []

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event == "call" and threading.current_thread().name == "profiled":
            calls.append(frame.f_code.co_name)

    def body() -> None:
        pass

    threading.setprofile(profile)
    osthreads.name_new_threads()
    osthreads.name_new_threads()  # once is enough; again changes nothing
    assert _run("profiled", body) == "profiled"
    assert calls[0] == "run" and "body" in calls  # the thread's first call, then the rest
    threading.setprofile(None)
    calls.clear()
    assert _run("profiled", body) != "profiled" and calls == []
