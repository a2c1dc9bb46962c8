"""scripts/gpu_probe.py's churn growth check, on made-up samples: a survivor is measured
against the worker that joined last, which holds the final plan's groups and nothing of
earlier ones."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from elaswave.bus.schema import RecoveryFinished, RecoveryStarted, StepCompleted, WorkerStarted

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "gpu_probe.py"
_SPEC = importlib.util.spec_from_file_location("gpu_probe", _PATH)
assert _SPEC is not None and _SPEC.loader is not None
probe = sys.modules.setdefault("gpu_probe", importlib.util.module_from_spec(_SPEC))
_SPEC.loader.exec_module(probe)
Sample, growth = probe.Sample, probe.growth


def _started(pid: int, t: float) -> WorkerStarted:
    return WorkerStarted(sender="w", rank=pid, stage=0, replica=0, pid=pid, host="h", time=t)


def test_survivors_are_measured_before_the_first_change_and_against_the_last_joiner() -> None:
    events = [
        _started(10, 0.0),
        _started(11, 0.0),
        RecoveryStarted(sender="core", step=2, kind="join", ranks=[12], reason="", time=5.0),
        _started(12, 6.0),
        RecoveryFinished(sender="core", step=2, kind="join", ranks=[12], mttr_s=1.0, joined=[12]),
        _started(13, 8.0),  # too late: no change adds it
        _started(14, 9.0),
        RecoveryFinished(sender="core", step=6, kind="join", ranks=[14], mttr_s=1.0, joined=[14]),
        StepCompleted(sender="w", rank=0, step=9, loss=1.0, step_time_s=1.0, samples=4, time=20.0),
    ]
    samples = [
        Sample(t=4.0, threads={10: 30, 11: 31}, gpu_mib={10: 100}, rss_mib={10: 700, 11: 900}),
        Sample(
            t=19.0,
            threads={10: 50, 12: 52, 13: 5, 14: 47},
            gpu_mib={10: 120},
            rss_mib={10: 750, 12: 2000, 14: 640},
            names={10: {"pt_nccl_watchdg": 6, "python3": 44}, 14: {"pt_nccl_watchdg": 3}},
        ),
        Sample(t=21.0, threads={10: 99, 13: 99}, gpu_mib={10: 999}),  # after the last step
    ]
    grown = growth(samples, events)
    assert grown is not None
    assert (grown.survivors, grown.threads_before, grown.threads_after) == (
        1,
        30,
        50,
    )  # pid 11 is gone at the end
    assert grown.joiner_threads_after == 47  # pid 14 was added last (13 never was)
    assert (grown.gpu_mib_before, grown.gpu_mib_after) == (100, 120)
    assert (grown.rss_mib_before, grown.rss_mib_after) == (700, 750)  # survivors only
    assert grown.joiner_rss_mib_after == 640
    assert grown.thread_excess == "python3+44 pt_nccl_watchdg+3"
    no_join = [e for e in events if not isinstance(e, RecoveryFinished)]
    grown = growth(samples, no_join)
    assert grown is not None and grown.joiner_threads_after is None


def test_the_end_of_a_run_is_measured_by_its_quietest_late_sample() -> None:
    """A change under way holds the old generation's groups beside the new ones: a
    survivor's threads rose 25 -> 43 within one change of gpu_check's churn, and a last
    sample taken there measured a leak that was not there. The quietest of the last
    samples is measured; a leak, there in every sample, is still seen."""
    events = [
        _started(10, 0.0),
        RecoveryStarted(sender="core", step=2, kind="join", ranks=[12], reason="", time=5.0),
        _started(12, 6.0),
        RecoveryFinished(sender="core", step=2, kind="join", ranks=[12], mttr_s=1.0, joined=[12]),
        StepCompleted(sender="w", rank=0, step=9, loss=1.0, step_time_s=1.0, samples=4, time=20.0),
    ]

    def run(late: list[int]) -> list:
        """One sample before the change, and ``late`` a second apart up to the end."""
        first = 19.5 - len(late) + 1
        return [Sample(t=4.0, threads={10: 30}, gpu_mib=None)] + [
            Sample(t=first + i, threads={10: n, 12: 25}, gpu_mib=None) for i, n in enumerate(late)
        ]

    grown = growth(run([60, 26, 34, 43]), events)  # the last one inside a change
    assert grown is not None and (grown.threads_after, grown.joiner_threads_after) == (26, 25)
    grown = growth(run([26, 60, 61, 62, 70]), events)  # only the last 4 count
    assert grown is not None and grown.threads_after == 60
