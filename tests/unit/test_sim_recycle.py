"""ReCycle's re-routing, bubble deferral and memory, checked against the plain pipeline."""

from __future__ import annotations

import dataclasses

import pytest

from elaswave.engine.cost import GIB, device
from elaswave.engine.steptime import plan_step_time
from elaswave.model.config import PRESETS
from elaswave.sim.policies import Layout, SimJob, SimPolicy, answer, baseline
from elaswave.sim.recycle import OutOfMemory, recycle_step

pytestmark = pytest.mark.timeout(120)


def job(name: str, tp: int, pp: int, dp: int, mb: int, gb: int, **kw) -> SimJob:
    return SimJob(PRESETS[name], device("ascend-910b"), tp=tp, pp=pp, dp=dp, micro_batch=mb,
                  global_batch=gb, layout=Layout.REPLICA_MAJOR, **kw)  # fmt: skip


J13 = job("llama2-13b", 4, 6, 4, 2, 2048)


def step(j: SimJob, failed, dev=None):
    return recycle_step(j.plan(), failed, model=j.model, layers=j.layers,
                        device=dev or j.device, tp=j.tp)  # fmt: skip


def test_replica_major_nodes_hold_one_replicas_consecutive_stages():
    # 6 stages x 2 TP groups per node: node 0 is replica 0's stages 0 and 1.
    assert J13.ranks_of_node(0) == [0, 4] and J13.ranks_of_node(2) == [16, 20]
    assert J13.ranks_of_node(3) == [1, 5]


def test_without_failures_recycle_is_the_plain_pipeline():
    got = step(J13, [])
    assert got.step_s == pytest.approx(plan_step_time(J13.plan(), J13.layers, J13.device).step_s)
    assert got.loads == ()


def test_peers_take_the_failed_ranks_micro_batches_and_the_step_slows():
    base = baseline(J13)
    got = step(J13, [0])  # stage 0, replica 0
    (load,) = got.loads
    m = J13.plan().num_micro_batches  # 256
    assert (load.stage, load.failed, load.peers, load.extra) == (0, 1, 3, -(-m // 3))
    # The peers' work grows by a third; stage 0 had some slack in the balanced plan
    # (it holds the most activations, so it got fewer layers), and a few deferred
    # weight-gradient passes hide in the bubble: the step grows, by less than a third.
    assert 1.05 < got.step_s / base.step_s < 4 / 3
    assert 0 < load.deferred < load.extra
    out = answer(SimPolicy.RECYCLE, J13, base.plan, [0])
    assert out.samples_per_step == 2048 and out.rerouted == {0}


def test_more_memory_defers_more_weight_gradients_into_the_bubble_and_is_faster():
    tight = step(J13, [0])
    roomy_device = dataclasses.replace(J13.device, memory_bytes=512 * GIB)
    roomy = step(J13, [0], roomy_device)
    assert roomy.loads[0].deferred > tight.loads[0].deferred
    assert roomy.step_s < tight.step_s
    assert tight.loads[0].memory_bytes <= J13.device.memory_bytes


def test_recycle_sits_between_elaswave_and_torchft_on_a_node_failure():
    base = baseline(J13)
    failed = J13.ranks_of_node(0)
    rate = {p: answer(p, J13, base.plan, failed).throughput / base.throughput
            for p in (SimPolicy.ELASWAVE, SimPolicy.RECYCLE, SimPolicy.TORCHFT)}  # fmt: skip
    assert rate[SimPolicy.ELASWAVE] > rate[SimPolicy.RECYCLE] > rate[SimPolicy.TORCHFT]


def test_whole_replicas_lost_fall_back_to_torchft():
    base = baseline(J13)
    failed = [r for n in range(3) for r in J13.ranks_of_node(n)]  # replica 0, all 6 stages
    torchft = answer(SimPolicy.TORCHFT, J13, base.plan, failed)
    out = answer(SimPolicy.RECYCLE, J13, base.plan, failed)
    assert out.plan.stages == torchft.plan.stages and out.step_s == torchft.step_s
    assert "whole replicas leave" in out.reason and not out.rerouted


def test_recycle_runs_out_of_memory_when_re_routed_activations_pass_device_memory():
    # Stage-major 34B: node 0 holds replicas 0 and 1 of stage 0; the last peer runs
    # three replicas' micro-batches and holds three pipelines' activations in flight.
    j = dataclasses.replace(job("llama2-34b", 4, 8, 3, 1, 768), layout=Layout.STAGE_MAJOR)
    assert j.ranks_of_node(0) == [0, 1]
    with pytest.raises(OutOfMemory, match=r"out of memory on stage 0: a peer holds .* of 32 GiB"):
        answer(SimPolicy.RECYCLE, j, j.plan(), j.ranks_of_node(0))
    # ElasWave re-plans the same failure within memory.
    assert answer(SimPolicy.ELASWAVE, j, j.plan(), j.ranks_of_node(0)).samples_per_step == 768
