"""Regrouped micro-batches: the same global batch in micro-batches of another size.

Rotating shares cost near the largest share when rotating stages are adjacent (the 1F1B
loop between them keeps meeting the larger share). Where another global micro-batch size
divides over every stage's width, the dataflow planner offers it; the throughput planner
keeps it when its step simulates shorter and its micro-batches fit in memory. Every
sample of the step keeps exactly one replica per stage, so the gradient is unchanged
(``tests/fault/test_fail_stop.py`` checks that against a fault-free run).
"""

from __future__ import annotations

import dataclasses

import pytest

from elaswave.comm.spec import MAX_MICRO_BATCHES
from elaswave.data.sampler import GlobalBatchSampler
from elaswave.engine import rebalance as rebalance_module
from elaswave.engine.cost import GIB, device, stage_memory
from elaswave.engine.dataflow import regroup, regroupings, resize_after_failure
from elaswave.engine.plan import Plan, StagePlan, initial_plan
from elaswave.engine.rebalance import rebalance
from elaswave.engine.steptime import plan_step_time
from elaswave.model.config import PRESETS
from elaswave.sim.policies import Layout, SimJob

pytestmark = pytest.mark.timeout(120)


def _widths(widths: tuple[int, ...], samples: int, global_batch: int) -> Plan:
    """A plan whose stages have ``widths`` replicas over ``samples``-sample micro-batches."""
    plan = initial_plan(num_layers=8, dp=1, pp=len(widths), global_batch=global_batch,
                        micro_batch=1)  # fmt: skip
    stages, rank = [], 0
    for stage, width in zip(plan.stages, widths, strict=True):
        ranks = tuple(range(rank, rank + width))
        rank += width
        stages.append(dataclasses.replace(stage, ranks=ranks, sizes=(1,) * width))
    plan = dataclasses.replace(plan, stages=tuple(stages))
    return regroup(plan, samples)[0] if samples != 1 else plan


def test_regroupings_are_the_nearest_sizes_every_width_takes_without_rotating():
    # 34B after a replica lost stages: widths 2 and 3 over 3-sample micro-batches.
    assert regroupings(_widths((2, 2, 3, 3), 3, 768)) == (2, 6)
    # 7B: 7 and 8 over 32 samples; a power-of-two batch has no multiple of 7 below
    # 4 x 32, so only fewer samples than the narrowest width remain (some idle).
    assert regroupings(_widths((8, 7, 7), 32, 8192)) == (4,)
    # Nothing between: 4 over 3 rotates, 5 does not divide the batch.
    assert 4 not in regroupings(_widths((3, 2), 3, 60)) and regroupings(_widths((3, 2), 3, 60))


def test_regroupings_keep_within_the_micro_batches_a_step_may_have():
    # 2-sample micro-batches would be 6144 per step, more than the pipeline's tags hold.
    plan = _widths((2, 3), 3, 3 * 4096)
    assert plan.global_batch // 2 > MAX_MICRO_BATCHES
    assert regroupings(plan) == (6,)


@pytest.mark.parametrize("samples", [2, 6, 12])
def test_a_regrouped_plan_runs_every_sample_of_the_step_once_per_stage(samples):
    plan, reason = regroup(_widths((2, 3, 2), 3, 36), samples)
    assert plan.num_micro_batches == 36 // samples and plan.global_batch == 36
    assert f"from 3 to {samples} samples" in reason
    sampler = GlobalBatchSampler(plan.global_batch, plan.num_micro_batches)
    step = 5
    for stage in plan.stages:
        assert not stage.rotate
        ids = []
        for mb in range(plan.num_micro_batches):
            base = step * plan.global_batch + mb * sampler.micro_batch_samples
            ids += [base + i for lo, hi in stage.offsets(mb) for i in range(lo, hi)]
        assert sorted(ids) == list(sampler.step_ids(step))


@pytest.mark.parametrize(("samples", "message"), [(5, "positive divisor"), (0, "positive")])
def test_regroup_refuses_a_size_that_does_not_divide_the_global_batch(samples, message):
    with pytest.raises(ValueError, match=message) as info:
        regroup(_widths((2, 3), 3, 36), samples)
    assert f"{samples} samples" in str(info.value) and "36" in str(info.value)


def _34b_first_three_nodes() -> tuple[SimJob, Plan]:
    job = SimJob(
        PRESETS["llama2-34b"], device("ascend-910b"), tp=4, pp=8, dp=3,
        micro_batch=1, global_batch=768, layout=Layout.REPLICA_MAJOR,
    )  # fmt: skip
    failed = [r for node in (0, 1, 2) for r in job.ranks_of_node(node)]
    resized, _ = resize_after_failure(job.plan(), failed)
    assert [s.rotate for s in resized.stages] == [True] * 6 + [False] * 2
    return job, resized


def _decide(job: SimJob, plan: Plan, **kwargs):
    return rebalance(plan, layers=job.layers, device=job.device, policy="migrate+dvfs",
                     power_budget=job.power_budget, **kwargs)  # fmt: skip


def _peak_bytes(job: SimJob, plan: Plan, stage: StagePlan) -> float:
    return stage_memory(
        job.layers[stage.layer_start : stage.layer_stop], micro_batch=max(stage.sizes),
        dp=stage.dp, stage=stage.stage, num_stages=plan.pp,
        num_micro_batches=plan.num_micro_batches,
    )  # fmt: skip


def test_the_planner_regroups_when_that_simulates_faster_and_fits(monkeypatch):
    """Llama2-34B loses nodes 0-2 (replica 0's stages 0-5): six adjacent stages rotate
    3 samples over 2 replicas. 6-sample micro-batches (3 + 3) do not fit without moving
    layers onto the full stages, which makes them slower; 2-sample micro-batches (1 + 1,
    one replica of each full stage idle) simulate faster than every rotating candidate,
    and every stage fits in 32 GiB."""
    job, resized = _34b_first_three_nodes()
    decision = _decide(job, resized)
    new = decision.plan
    assert new.num_micro_batches == 384 and not any(s.rotate for s in new.stages)
    assert "2-sample chosen" in decision.reason and "6-sample micro-batches -> step" in (
        decision.reason
    ), decision.reason
    for stage in new.stages:
        assert _peak_bytes(job, new, stage) <= job.device.memory_bytes
    regrouped = plan_step_time(new, job.layers, job.device).step_s
    monkeypatch.setattr(rebalance_module, "regroupings", lambda plan: ())
    rotating = _decide(job, resized).plan
    assert rotating.num_micro_batches == 256 and any(s.rotate for s in rotating.stages)
    assert regrouped < 0.97 * plan_step_time(rotating, job.layers, job.device).step_s


def test_a_regrouping_past_memory_moves_layers_first():
    """6-sample micro-batches hold three times the activations of the current layers on
    the stages that take 3 samples: the graph step must move layers whatever it gains."""
    job, resized = _34b_first_three_nodes()
    six, _ = regroup(resized, 6)
    assert any(_peak_bytes(job, six, s) > job.device.memory_bytes for s in six.stages)
    decision = rebalance(six, layers=job.layers, device=job.device, policy="migrate")
    assert "would not fit their memory" in decision.reason, decision.reason
    for stage in decision.plan.stages:
        assert _peak_bytes(job, decision.plan, stage) <= job.device.memory_bytes


def test_a_regrouping_that_does_not_fit_is_skipped_and_one_that_fits_replaces_rotation():
    job, resized = _34b_first_three_nodes()
    tight = _decide(job, resized, memory_cap_bytes=30 * GIB)
    assert "6-sample micro-batches do not fit" in tight.reason, tight.reason
    assert tight.plan.num_micro_batches == 384  # 2 samples: 1 + 1, one replica idle
    # At 24 GiB no rotating partition fits; the 2-sample regrouping still does.
    tighter = _decide(job, resized, memory_cap_bytes=24 * GIB)
    assert "rotating 3-sample shares do not fit" in tighter.reason, tighter.reason
    assert tighter.plan.num_micro_batches == 384
    for stage in tighter.plan.stages:
        assert _peak_bytes(job, tighter.plan, stage) <= 24 * GIB
