"""What scripts/gpu_check measures of one ``elaswave train`` run: the run itself (a
subprocess with a deadline, its process tree sampled while it runs) and the figures read
back from its run directory (release latency, survivors' thread and GPU-memory growth).

Sampling reads /proc (threads of every process under the job host) and, where
``nvidia-smi`` is on the PATH, the GPU memory of each of those processes; elsewhere the
GPU figures are None. Nothing here imports torch or raises on a run that failed: a
failed run is a :class:`Run` with ``ok`` False and its reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from elaswave.bus.eventlog import read_event_log
from elaswave.bus.schema import (
    Event,
    FailureDetected,
    RecoveryFinished,
    RecoveryReady,
    RecoveryStarted,
    StepCompleted,
    WorkerStarted,
)
from elaswave.rundir import EVENT_LOG, fault_record

SAMPLE_EVERY_S = 0.5
TAIL_CHARS = 1500


@dataclass(frozen=True, kw_only=True)
class Sample:
    """The job's processes at one moment."""

    t: float
    """Wall-clock time (seconds since the epoch)."""
    threads: Mapping[int, int]
    """Threads of each process under the job host, by pid."""
    gpu_mib: Mapping[int, int] | None
    """GPU memory of each process nvidia-smi lists, by pid (None: no nvidia-smi)."""
    names: Mapping[int, Mapping[str, int]] = field(default_factory=dict)
    """Each process's threads by name (digits as ``#``), by pid."""
    rss_mib: Mapping[int, int] = field(default_factory=dict)
    """Each process's resident host memory (MiB), by pid."""


@dataclass(frozen=True, kw_only=True)
class Run:
    """One finished (or abandoned) ``elaswave train`` run."""

    out: Path
    """Its run directory."""
    ok: bool
    """Exited 0 within its deadline."""
    reason: str
    """Why not ok (empty when ok): the exit code or the deadline, and the output's tail."""
    wall_s: float
    samples: tuple[Sample, ...]


def _children() -> dict[int, list[int]]:
    """Every process's children, from /proc (pid -> child pids)."""
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(parent, []).append(int(entry.name))
    return tree


def _status(pid: int, key: str) -> int | None:
    """The first number of ``pid``'s /proc status line ``key`` (None: gone or absent)."""
    try:
        status = (Path("/proc") / str(pid) / "status").read_text()
    except OSError:
        return None
    lines = (line for line in status.splitlines() if line.startswith(key))
    return next((int(line.split()[1]) for line in lines), None)


def _threads(pid: int) -> int | None:
    return _status(pid, "Threads:")


def _rss_mib(pid: int) -> int | None:
    kib = _status(pid, "VmRSS:")
    return None if kib is None else kib // 1024


def _thread_names(pid: int) -> dict[str, int]:
    """``pid``'s threads by name (/proc's 15-character names, digits as ``#``)."""
    names: dict[str, int] = {}
    try:
        for task in (Path("/proc") / str(pid) / "task").iterdir():
            name = re.sub(r"[0-9]+", "#", (task / "comm").read_text().strip())
            names[name] = names.get(name, 0) + 1
    except OSError:
        pass  # gone meanwhile
    return names


def _gpu_mib() -> dict[int, int] | None:
    """GPU memory (MiB) by pid from nvidia-smi; None when it is missing or fails."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    query = [smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
    try:
        text = subprocess.run(query, capture_output=True, text=True, timeout=5, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    usage: dict[int, int] = {}
    for line in text.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit() and mib.strip().isdigit():
            usage[int(pid)] = usage.get(int(pid), 0) + int(mib)
    return usage


def sample(root: int, *, gpu: bool) -> Sample:
    """Threads (and with ``gpu``, GPU memory) of ``root``'s descendants, ``root`` included."""
    tree, found, todo = _children(), [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(tree.get(pid, []))
    threads = {pid: n for pid in found if (n := _threads(pid)) is not None}
    usage = _gpu_mib() if gpu else None
    mine = None if usage is None else {pid: usage[pid] for pid in found if pid in usage}
    names = {pid: _thread_names(pid) for pid in threads}
    rss = {pid: mib for pid in threads if (mib := _rss_mib(pid)) is not None}
    return Sample(t=time.time(), threads=threads, gpu_mib=mine, names=names, rss_mib=rss)


def run_train(
    argv: Sequence[str],
    out: Path,
    *,
    env: Mapping[str, str],
    timeout_s: float,
    watch: bool,
    gpu: bool,
) -> Run:
    """Run ``argv`` (an ``elaswave train`` command writing ``out``) in a session of its
    own; past ``timeout_s`` its whole process group is SIGKILLed. ``watch``: sample its
    processes every :data:`SAMPLE_EVERY_S` (``gpu``: their GPU memory too)."""
    log = out.with_name(out.name + ".log")
    out.parent.mkdir(parents=True, exist_ok=True)
    start, samples = time.monotonic(), []
    with log.open("w") as sink:
        proc = subprocess.Popen(
            list(argv), stdout=sink, stderr=subprocess.STDOUT, env=dict(env), start_new_session=True
        )
        code: int | None = None
        while code is None and time.monotonic() - start < timeout_s:
            if watch:
                samples.append(sample(proc.pid, gpu=gpu))
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = proc.wait(timeout=SAMPLE_EVERY_S)
        if code is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the job's group: host, zygote, Core, workers
            proc.wait()
    wall = time.monotonic() - start
    tail = log.read_text(errors="replace")[-TAIL_CHARS:].strip().replace("\n", " | ")
    if code is None:
        reason = f"no exit within {timeout_s:.0f} s (killed); output: {tail}"
    else:
        reason = "" if code == 0 else f"exit {code}; output: {tail}"
    return Run(out=out, ok=code == 0, reason=reason, wall_s=wall, samples=tuple(samples))


def events_of(run_dir: Path) -> list[Event]:
    path = run_dir / EVENT_LOG
    if not path.exists():
        return []
    return [r.event for r in read_event_log(path) if r.event is not None]


@dataclass(frozen=True, kw_only=True)
class Release:
    """How fast the survivors of the first failure abandoned their step."""

    from_announcement_s: float
    """The Core's failure announcement to the last survivor's RecoveryReady."""
    from_fault_s: float | None
    """The fault's own time (SIGKILL or SIGSTOP) to the same (None: no fault record)."""


def release(run_dir: Path, events: Sequence[Event]) -> Release | None:
    """The first failure's release, from the event log and the fault record; None when
    the log has no failure with every survivor's RecoveryReady."""
    failure = next((e for e in events if isinstance(e, FailureDetected)), None)
    if failure is None:
        return None
    started = {e.rank for e in events if isinstance(e, WorkerStarted) and not e.joining}
    survivors = started - set(failure.ranks)
    ready = {
        e.rank: e.time
        for e in events
        if isinstance(e, RecoveryReady)
        and e.generation == failure.generation
        and e.rank in survivors
    }
    if not survivors or set(ready) != survivors:
        return None
    last = max(ready.values())
    records = (_killed_at(fault_record(run_dir, rank)) for rank in failure.ranks)
    times = [t for t in records if t is not None]
    return Release(
        from_announcement_s=last - failure.time, from_fault_s=last - min(times) if times else None
    )


def _killed_at(path: Path) -> float | None:
    """The time a fault record (RUN_DIR/faults/rankN.json) gives; None without one."""
    try:
        return float(json.loads(path.read_text())["killed_at"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True, kw_only=True)
class Growth:
    """Survivors' resources after the run's changes against before the first of them."""

    survivors: int
    """Worker processes alive both before the first change and at the end."""
    threads_before: int
    threads_after: int
    """The most threads one survivor had (before, after)."""
    joiner_threads_after: int | None
    """Threads, at the end, of the last started of the joiners a change added (None: no
    worker joined; one that started too late to be added holds no groups). A rank holds
    threads per communicator and per peer connection (NCCL's proxy and socket threads,
    torch's watchdog), so a job that grows gives every member more; the last joiner
    holds the final plan's groups and nothing of earlier ones: a survivor that holds
    many more leaked them."""
    gpu_mib_before: int | None
    gpu_mib_after: int | None
    """The most GPU memory one survivor held (None: not measured)."""
    rss_mib_before: int | None = None
    rss_mib_after: int | None = None
    """The most resident host memory one survivor held (None: not measured): what a
    survivor keeps of the changes it went through (host snapshot buffers, the buffers of
    operations its communicators still hold) shows here on every device."""
    joiner_rss_mib_after: int | None = None
    """The last joiner's resident host memory at the end (None: none joined, or not
    measured): what a rank holds that went through none of the earlier changes."""
    thread_excess: str = ""
    """The threads the survivor with the most holds at the end beyond the last joiner
    (where none joined: beyond its own before the first change), by name: what a leak
    would be made of."""


QUIET_OF_LAST = 4
""":func:`growth` measures the end of a run by the quietest of its last this many
samples (2 s at :data:`SAMPLE_EVERY_S`)."""


def growth(samples: Sequence[Sample], events: Sequence[Event]) -> Growth | None:
    """Survivors' growth: the last sample before the first RecoveryStarted against the
    quietest of the last :data:`QUIET_OF_LAST` samples before the last step completed
    (the one whose busiest survivor holds the fewest threads); None without a change or
    without samples on both sides.

    A change under way holds the old generation's communicators beside the new ones for
    a moment (gpu_check's churn: a survivor's threads 25 -> 34 -> 43 within one change,
    and 26 after it), and the churn trace changes the plan up to its last step: the last
    sample alone, taken inside a change, measured a leak that was not there (3 runs in
    10, on this session's code and the one before it). A leak grows with every change
    and shows in every sample."""
    first = next((e.time for e in events if isinstance(e, RecoveryStarted)), None)
    last = max((e.time for e in events if isinstance(e, StepCompleted)), default=None)
    workers = {e.pid for e in events if isinstance(e, WorkerStarted)}
    if first is None or last is None:
        return None
    before = [s for s in samples if s.t < first]
    after = [s for s in samples if first < s.t < last]
    if not before or not after:
        return None
    old, end = before[-1], after[-1]
    alive = sorted(workers & set(old.threads) & set(end.threads))
    if not alive:
        return None
    near_end = [s for s in after[-QUIET_OF_LAST:] if all(pid in s.threads for pid in alive)]
    new = min(near_end, key=lambda s: max(s.threads[pid] for pid in alive))
    started = {e.pid: e.time for e in events if isinstance(e, WorkerStarted)}
    added = {  # by a change finished by then: the joiner holds the plan's groups
        x for e in events if isinstance(e, RecoveryFinished) and e.time < new.t for x in e.joined
    }
    ranks = {e.pid: e.rank for e in events if isinstance(e, WorkerStarted)}
    joiners = [  # a joiner the job no longer needed (its steps ran out) holds no groups
        pid for pid in new.threads if started.get(pid, 0.0) > first and ranks[pid] in added
    ]
    last_joiner = max(joiners, key=lambda pid: started[pid], default=None)

    def most(values: Mapping[int, int] | None) -> int | None:
        return None if values is None else max((values.get(pid, 0) for pid in alive), default=0)

    busiest = max(alive, key=lambda pid: new.threads[pid])
    base = old.names.get(busiest, {}) if last_joiner is None else new.names.get(last_joiner, {})
    return Growth(
        survivors=len(alive),
        thread_excess=_excess(new.names.get(busiest, {}), base),
        threads_before=max(old.threads[pid] for pid in alive),
        threads_after=max(new.threads[pid] for pid in alive),
        joiner_threads_after=None if last_joiner is None else new.threads[last_joiner],
        gpu_mib_before=most(old.gpu_mib),
        gpu_mib_after=most(new.gpu_mib),
        rss_mib_before=most(old.rss_mib) if old.rss_mib else None,
        rss_mib_after=most(new.rss_mib) if new.rss_mib else None,
        joiner_rss_mib_after=None if last_joiner is None else new.rss_mib.get(last_joiner),
    )


def _excess(names: Mapping[str, int], base: Mapping[str, int]) -> str:
    """``name+k`` for each thread name ``names`` holds ``k`` more of than ``base``."""
    more = {n: c - base.get(n, 0) for n, c in names.items() if c > base.get(n, 0)}
    return " ".join(f"{n}+{k}" for n, k in sorted(more.items(), key=lambda nk: (-nk[1], nk[0])))
