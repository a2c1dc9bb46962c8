"""Simulated policies: ElasWave's planners against TorchFT's replica drop."""

from __future__ import annotations

import pytest

from elaswave.engine.cost import device
from elaswave.model.config import PRESETS
from elaswave.sim.policies import Layout, SimJob, SimPolicy, answer, baseline

pytestmark = pytest.mark.timeout(120)

# The paper's Llama2-7B workload on 96 devices, 8 per node.
JOB = SimJob(PRESETS["llama2-7b"], device("ascend-910b"), tp=4, pp=3, dp=8, micro_batch=4,
             global_batch=8192)  # fmt: skip


def test_a_node_holds_whole_tp_groups_of_one_stage():
    assert JOB.num_devices == 96 and JOB.num_nodes == 12
    assert JOB.ranks_of_node(0) == [0, 1] and JOB.ranks_of_node(11) == [22, 23]
    with pytest.raises(ValueError, match="tp = 3 does not divide 8 devices per node"):
        SimJob(PRESETS["llama2-7b"], device("h100"), 3, 1, 1, 1, 1)


def test_torchft_drops_the_replicas_and_shrinks_the_batch():
    base = baseline(JOB)
    out = answer(SimPolicy.TORCHFT, JOB, base.plan, JOB.ranks_of_node(0))
    assert out.samples_per_step == 8192 * 6 // 8
    assert [s.dp for s in out.plan.stages] == [6, 6, 6]
    assert out.step_s == pytest.approx(base.step_s, rel=1e-3)  # same work per replica


def test_elaswave_keeps_the_batch_and_beats_torchft_on_a_node_failure():
    base = baseline(JOB)
    failed = JOB.ranks_of_node(0)
    got = {p: answer(p, JOB, base.plan, failed) for p in SimPolicy}
    assert got[SimPolicy.ELASWAVE].samples_per_step == 8192
    rate = {p: o.throughput / base.throughput for p, o in got.items()}
    assert rate[SimPolicy.ELASWAVE] >= rate[SimPolicy.ELASWAVE_MIGRATE] >= rate[SimPolicy.TORCHFT]
    assert rate[SimPolicy.ELASWAVE_MIGRATE] > rate[SimPolicy.ELASWAVE_RESIZE]
    efficiency = rate[SimPolicy.ELASWAVE] / (88 / 96)
    assert efficiency >= 0.89


def test_whole_replicas_lost_fall_back_to_torchft():
    base = baseline(JOB)
    replica = [s.ranks[5] for s in base.plan.stages]
    torchft = answer(SimPolicy.TORCHFT, JOB, base.plan, replica)
    for policy in (SimPolicy.ELASWAVE, SimPolicy.ELASWAVE_RESIZE):
        out = answer(policy, JOB, base.plan, replica)
        assert out.plan.stages == torchft.plan.stages and "whole replicas" in out.reason


def test_a_replica_that_lost_six_of_eight_stages_is_re_pipelined_ahead_of_recycle():
    """The paper's 34B row with 3 nodes of one replica lost (stages 0..5 of replica 0):
    8 stages of 2 or 3 ranks fell behind ReCycle (0.703 against 0.707 of fault-free);
    the 18 survivors as 6 full stages of 3 run ahead of it. The ablations keep their
    stages (elaswave-migrate at 0.674), and the churn timeline does not shorten."""
    job = SimJob(PRESETS["llama2-34b"], device("ascend-910b"), tp=4, pp=8, dp=3,
                 micro_batch=1, global_batch=768, layout=Layout.REPLICA_MAJOR)  # fmt: skip
    base = baseline(job)
    failed = [r for n in (0, 1, 2) for r in job.ranks_of_node(n)]
    shown = (SimPolicy.ELASWAVE, SimPolicy.ELASWAVE_MIGRATE, SimPolicy.RECYCLE, SimPolicy.TORCHFT)
    got = {p: answer(p, job, base.plan, failed) for p in shown}
    rate = {p: o.throughput / base.throughput for p, o in got.items()}
    assert rate[SimPolicy.ELASWAVE] >= rate[SimPolicy.RECYCLE] >= rate[SimPolicy.TORCHFT]
    assert [s.dp for s in got[SimPolicy.ELASWAVE].plan.stages] == [3] * 6
    assert "fewer, full stages" in got[SimPolicy.ELASWAVE].reason
    assert got[SimPolicy.ELASWAVE_MIGRATE].plan.pp == 8
    kept = answer(SimPolicy.ELASWAVE, job, base.plan, failed, shorten=False)
    assert kept.plan.pp == 8 and kept.throughput < got[SimPolicy.ELASWAVE].throughput
