"""Rotation blocks: a rotating stage holds its shares for several micro-batches in a row.

Two adjacent stages whose shares rotate every micro-batch keep meeting each other's
largest share in the 1F1B loop; holding the shares for a block of micro-batches breaks
that lockstep. The planner simulates each block length and keeps one only when the step
is shorter by more than ``BLOCK_GAIN``. Blocks change which replica takes which samples,
never which samples a micro-batch holds, so the gradient is unchanged
(``tests/fault/test_fail_stop.py`` checks a run against the fault-free one).
"""

from __future__ import annotations

import dataclasses

import pytest

from elaswave.data.sampler import GlobalBatchSampler
from elaswave.engine import rebalance as rebalance_module
from elaswave.engine.cost import device
from elaswave.engine.dataflow import resize_after_failure
from elaswave.engine.plan import Plan, StagePlan, initial_plan, plan_from_dict, plan_to_dict
from elaswave.engine.rebalance import BLOCK_GAIN, rebalance
from elaswave.engine.steptime import plan_step_time
from elaswave.model.config import PRESETS, ModelConfig
from elaswave.runtime.job.config import JobConfig
from elaswave.runtime.job.sections import LayoutConfig, ScheduleConfig
from elaswave.sim.policies import Layout, SimJob

pytestmark = pytest.mark.timeout(120)


def _rotating(block: int) -> Plan:
    """dp 3 x pp 2, one sample per replica, rank 1 (stage 0) gone: 3 samples over 2."""
    plan = initial_plan(num_layers=6, dp=3, pp=2, global_batch=24, micro_batch=1)
    resized, _ = resize_after_failure(plan, {1})
    stage = dataclasses.replace(resized.stages[0], block=block)
    return dataclasses.replace(resized, stages=(stage, resized.stages[1]))


def test_a_block_holds_the_shares_for_that_many_micro_batches():
    stage = StagePlan(0, 0, 1, ranks=(0, 1), sizes=(2, 1), rotate=True, block=2)
    assert stage.period == 4
    assert [stage.shares(mb) for mb in range(6)] == [
        (2, 1), (2, 1), (1, 2), (1, 2), (2, 1), (2, 1),
    ]  # fmt: skip
    still = StagePlan(0, 0, 1, ranks=(0, 1), sizes=(2, 2), rotate=False, block=1)
    assert still.period == 1 and still.shares(5) == (2, 2)


@pytest.mark.parametrize("block", [1, 2, 3])
def test_every_sample_of_the_step_runs_once_per_stage_whatever_the_block(block):
    plan = _rotating(block)
    sampler = GlobalBatchSampler(plan.global_batch, plan.num_micro_batches)
    step = 4
    for stage in plan.stages:
        ids = []
        for mb in range(plan.num_micro_batches):
            base = step * plan.global_batch + mb * sampler.micro_batch_samples
            ids += [base + i for lo, hi in stage.offsets(mb) for i in range(lo, hi)]
        assert sorted(ids) == list(sampler.step_ids(step))
    # Over the step each replica takes its mean share (12), exactly when the rotation's
    # period (2 x block) divides the 8 micro-batches, else within a block's difference.
    taken = [0] * plan.stages[0].dp
    for mb in range(plan.num_micro_batches):
        for replica, share in enumerate(plan.stages[0].shares(mb)):
            taken[replica] += share
    if plan.num_micro_batches % plan.stages[0].period == 0:
        assert taken == [12, 12]
    else:
        assert sum(taken) == 24 and taken != [12, 12]
        assert all(abs(t - 12) <= block for t in taken), taken


def test_a_block_needs_no_link_a_single_rotation_lacks():
    """Blocks reorder the same routes: a block change edits no communicator group."""
    assert _rotating(3).group_specs() == _rotating(1).group_specs()


def test_plan_documents_keep_the_block_and_refuse_a_bad_one():
    plan = _rotating(3)
    doc = plan_to_dict(plan)
    assert plan_from_dict(doc) == plan
    old = plan_to_dict(_rotating(1))
    del old["stages"][0]["block"]  # documents from before blocks read as block 1
    assert plan_from_dict(old) == _rotating(1)
    for bad in (0, -2, "3", 1.5, True):
        doc["stages"][0]["block"] = bad
        with pytest.raises(ValueError, match="block = ") as info:
            plan_from_dict(doc)
        assert repr(bad) in str(info.value) and "at least 1" in str(info.value)


def _decide(job: SimJob, plan: Plan):
    return rebalance(plan, layers=job.layers, device=job.device, policy="migrate+dvfs",
                     power_budget=job.power_budget)  # fmt: skip


def test_the_planner_holds_rotations_in_blocks_when_that_simulates_faster(monkeypatch):
    """Llama2-7B on 96 simulated devices loses its last node (replica-major: replica 7 of
    stages 1 and 2): two adjacent stages rotate 32 samples over 7. Blocks of 3
    micro-batches step more than BLOCK_GAIN faster than rotating every micro-batch."""
    job = SimJob(
        PRESETS["llama2-7b"], device("ascend-910b"), tp=4, pp=3, dp=8,
        micro_batch=4, global_batch=8192, layout=Layout.REPLICA_MAJOR,
    )  # fmt: skip
    resized, _ = resize_after_failure(job.plan(), job.ranks_of_node(job.num_nodes - 1))
    assert [s.rotate for s in resized.stages] == [False, True, True]
    decision = _decide(job, resized)
    new = decision.plan
    assert [s.block for s in new.stages] == [1, 3, 3], decision.reason
    assert "in blocks of 3 micro-batches" in decision.reason
    chosen = plan_step_time(new, job.layers, job.device).step_s
    single = dataclasses.replace(
        new, stages=tuple(dataclasses.replace(s, block=1) for s in new.stages)
    )
    assert chosen < plan_step_time(single, job.layers, job.device).step_s * (1 - BLOCK_GAIN)
    # Without blocks the planner's plan steps slower than with them.
    monkeypatch.setattr(rebalance_module, "ROTATION_BLOCKS", (1,))
    without = _decide(job, resized).plan
    assert {s.block for s in without.stages} == {1}
    assert chosen < plan_step_time(without, job.layers, job.device).step_s * (1 - BLOCK_GAIN)


def test_a_block_gaining_less_than_the_threshold_is_not_taken():
    """The emulated dp 4 x pp 4 job of docs/elastic_throughput.md (on 1F1B) loses rank
    5: its best block steps within BLOCK_GAIN of block 1, so the plan keeps block 1."""
    cfg = JobConfig(
        model=ModelConfig(num_blocks=14),
        layout=LayoutConfig(dp=4, pp=4),
        schedule=ScheduleConfig(global_batch=64, micro_batch=2, pipeline_schedule="1f1b"),
    )
    resized, _ = resize_after_failure(cfg.plan(), {5})
    decision = rebalance(resized, layers=cfg.layer_costs, device=cfg.cost_device,
                         policy="migrate", power_budget=cfg.power_budget)  # fmt: skip
    new = decision.plan
    assert new.stages[1].rotate and {s.block for s in new.stages} == {1}
    single = plan_step_time(new, cfg.layer_costs, cfg.cost_device).step_s
    steps = {
        block: plan_step_time(
            dataclasses.replace(new, stages=tuple(
                dataclasses.replace(s, block=block) if s.rotate else s for s in new.stages
            )),
            cfg.layer_costs, cfg.cost_device,
        ).step_s
        for block in rebalance_module.ROTATION_BLOCKS
        if block > 1
    }  # fmt: skip
    assert min(steps.values()) > single * (1 - BLOCK_GAIN)
    assert min(steps.values()) < single, "some block is faster, yet below the threshold"
