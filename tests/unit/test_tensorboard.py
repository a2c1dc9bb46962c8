"""The job's TensorBoard file, read back by TensorBoard's own event reader."""

from __future__ import annotations

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from elaswave.bus.schema import RecoveryFinished, RunStarted, StepCompleted
from elaswave.runtime.host.tensorboard import ScalarLog, crc32c


def test_crc32c_matches_the_standard_check_value():
    assert crc32c(b"123456789") == 0xE3069283  # RFC 3720's CRC-32C check value


def _read(run_dir) -> EventAccumulator:
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return acc


def test_steps_and_changes_are_scalars_tensorboard_reads(tmp_path):
    log = ScalarLog(tmp_path)
    log(RunStarted(sender="core", run_id="r", world_size=4, dp=2, pp=2, steps=3,
                   global_batch=8, device="cpu", time=100.0))  # fmt: skip
    for step, loss in enumerate([4.5, 4.25, 4.0]):
        log(StepCompleted(sender="rank3", rank=3, step=step, loss=loss, step_time_s=0.5,
                          samples=8, time=101.0 + step))  # fmt: skip
    log(RecoveryFinished(sender="core", step=1, kind="fail-stop", ranks=[1], mttr_s=0.75,
                         time=102.5))  # fmt: skip
    log(RecoveryFinished(sender="core", step=2, kind="join", ranks=[4], mttr_s=1.25,
                         joined=[4], time=103.5))  # fmt: skip
    log.close()
    acc = _read(tmp_path)
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    assert scalars["train/loss"] == [(0, 4.5), (1, 4.25), (2, 4.0)]
    assert scalars["train/samples_per_s"] == [(0, 16.0), (1, 16.0), (2, 16.0)]
    assert scalars["recovery/mttr_s"] == [(1, 0.75), (2, 1.25)]
    assert scalars["plan/changes"] == [(1, 1.0), (2, 2.0)]
    assert scalars["plan/ranks"] == [(0, 4.0), (1, 3.0), (2, 4.0)]
    assert acc.Scalars("train/loss")[0].wall_time == 101.0


def test_the_learning_rate_and_a_clipped_jobs_gradient_norm_are_scalars(tmp_path):
    log = ScalarLog(tmp_path)
    common = {"sender": "rank3", "rank": 3, "step_time_s": 0.5, "samples": 8}
    log(StepCompleted(step=0, loss=4.5, lr=0.003, grad_norm=1.25, time=101.0, **common))
    log(StepCompleted(step=1, loss=4.25, lr=0.002, time=102.0, **common))  # not clipped
    log.close()
    acc = _read(tmp_path)
    lrs = [(e.step, round(e.value, 6)) for e in acc.Scalars("train/lr")]
    assert lrs == [(0, 0.003), (1, 0.002)]
    assert [(e.step, e.value) for e in acc.Scalars("train/grad_norm")] == [(0, 1.25)]
