"""Simulated timelines: steps under a trace, per policy, and the simulator's speed."""

from __future__ import annotations

import time

import pytest

from elaswave.engine.cost import device
from elaswave.model.config import PRESETS
from elaswave.sim.mttr import RecoveryCosts
from elaswave.sim.policies import Layout, SimJob, SimPolicy, baseline
from elaswave.sim.timeline import simulate
from elaswave.sim.trace import TraceEvent, format_trace, full_start, periodic_failures, slot_trace

pytestmark = pytest.mark.timeout(120)


def on_full_job(text: str, *, num_nodes: int) -> tuple[TraceEvent, ...]:
    """The slot events of ``text``'s lines after every node of the job arrived at 0."""
    return slot_trace(format_trace(full_start(num_nodes)) + text, num_slots=num_nodes).events


JOB = SimJob(PRESETS["llama2-7b"], device("ascend-910b"), tp=4, pp=3, dp=8, micro_batch=4,
             global_batch=8192)  # fmt: skip


def test_without_events_every_step_takes_the_plans_step_time():
    tl = simulate(JOB, SimPolicy.ELASWAVE, (), steps=10)
    step = baseline(JOB).step_s
    assert [s.step for s in tl.steps] == list(range(10))
    assert tl.steps[-1].end_s == pytest.approx(10 * step)
    assert tl.samples_per_s == pytest.approx(8192 / step)


def test_a_removal_loses_the_partial_step_and_is_redone_after_the_overhead():
    step = baseline(JOB).step_s
    at = 3.5 * step
    trace = on_full_job(f"{at * 1000!r},remove,node3\n", num_nodes=12)
    costs = RecoveryCosts(detect_s=1.5, comm_edit_s=0.5)
    tl = simulate(JOB, SimPolicy.ELASWAVE, trace, steps=6, costs=costs)
    (change,) = tl.changes
    assert change.kind == "remove" and change.ranks == (6, 7)
    assert change.lost_s == pytest.approx(0.5 * step)
    assert change.parts["detect"] == 1.5 and change.parts["communicator edit"] == 0.5
    # The failed ranks' optimizer shards come back from their peers' snapshots.
    assert change.parts["shard restore"] > 0 and change.moved_bytes > 0
    assert change.overhead_s == pytest.approx(sum(change.parts.values()))
    redone = tl.steps[3]
    assert redone.end_s == pytest.approx(at + change.overhead_s + redone.step_s)
    assert change.mttr_s == pytest.approx(change.overhead_s + redone.step_s)
    assert redone.samples == 8192, "ElasWave keeps the global batch"


def test_checkpoint_restart_redoes_the_steps_since_its_last_checkpoint():
    step = baseline(JOB).step_s
    at = 13.25 * step
    trace = on_full_job(f"{at * 1000!r},remove,node3\n", num_nodes=12)
    costs = RecoveryCosts(checkpoint_every=10)
    tl = simulate(JOB, SimPolicy.RESTART, trace, steps=20, costs=costs)
    (change,) = tl.changes
    assert change.lost_s == pytest.approx(3.25 * step)
    assert {"detect", "process restart", "rendezvous", "checkpoint load"} <= change.parts.keys()
    steps = [s.step for s in tl.steps]
    assert steps == list(range(20)), "steps 10-12 are redone, not counted twice"
    # It restarts on 88 devices: 7 whole replicas of 12 devices, the global batch kept
    # as nearly as 7 replicas of 4-sample micro-batches allow.
    assert tl.steps[10].samples == 8192 // 28 * 28 and tl.steps[10].end_s > at + change.overhead_s
    assert change.mttr_s == pytest.approx(tl.steps[13].end_s - at)


def test_elaswave_keeps_more_throughput_than_torchft_through_a_trace():
    step = baseline(JOB).step_s
    trace = on_full_job(
        f"{5 * step * 1000!r},remove,node3\n{30 * step * 1000!r},slow,node6,1.5\n",
        num_nodes=12,
    )
    rates = {p: simulate(JOB, p, trace, steps=60).samples_per_s for p in SimPolicy}
    assert rates[SimPolicy.ELASWAVE] >= rates[SimPolicy.ELASWAVE_MIGRATE]
    assert rates[SimPolicy.ELASWAVE_MIGRATE] > rates[SimPolicy.ELASWAVE_RESIZE]
    assert rates[SimPolicy.ELASWAVE_RESIZE] > rates[SimPolicy.TORCHFT]


def test_torchft_replicas_rejoin_when_their_node_returns():
    step = baseline(JOB).step_s
    trace = on_full_job(
        f"{2 * step * 1000!r},remove,node3\n{10 * step * 1000!r},add,node3\n", num_nodes=12
    )
    tl = simulate(JOB, SimPolicy.TORCHFT, trace, steps=20)
    batches = [s.samples for s in tl.steps]
    assert batches[2] == 8192 * 6 // 8 and batches[-1] == 8192
    assert [c.kind for c in tl.changes] == ["remove", "add"]


def test_a_job_that_loses_every_replica_waits_for_nodes_then_restarts_from_its_checkpoint():
    """TorchFT once every replica lost a rank: no stop; it waits with nothing to train,
    and when a node comes back (after its processes start) it restarts from its last
    checkpoint on the ranks alive."""
    step = baseline(JOB).step_s
    published = periodic_failures(num_nodes=12, interval_ms=1000, count=4, first_ms=1)
    back = 20 * step * 1000
    text = format_trace(published) + "".join(f"{back!r},add,late{k}\n" for k in range(4))
    trace = slot_trace(text, num_slots=12).events
    # Nodes 11, 10, 9, 8 hold every replica of the last stage.
    costs = RecoveryCosts(process_restart_s=step, checkpoint_every=2)
    tl = simulate(JOB, SimPolicy.TORCHFT, trace, steps=8, costs=costs)
    assert tl.stopped is None and len(tl.steps) == 8
    assert any("waits for nodes" in c.reason and "nothing is left to train" in c.reason
               for c in tl.changes)  # fmt: skip
    resume = [c for c in tl.changes if c.kind == "resume"]
    assert resume and "resumes from its last checkpoint" in resume[0].reason
    assert tl.waited_s > 0


def test_elaswave_refills_a_stage_lost_whole_from_the_others():
    """Every rank of a stage gone at once (stage-major: nodes 8-11 hold stage 2): ranks
    of the other stages move there; the job never waits."""
    step = baseline(JOB).step_s
    lines = "".join(f"{(3.5 * step + k * 0.001) * 1000!r},remove,node{n}\n"
                    for k, n in enumerate((8, 9, 10, 11)))  # fmt: skip
    job = SimJob(PRESETS["llama2-7b"], device("ascend-910b"), tp=4, pp=3, dp=8,
                 micro_batch=4, global_batch=8192, layout=Layout.STAGE_MAJOR)  # fmt: skip
    tl = simulate(job, SimPolicy.ELASWAVE, on_full_job(lines, num_nodes=12), steps=8)
    assert tl.waited_s == 0 and len(tl.steps) == 8
    moved = [c for c in tl.changes if "ranks change stage" in c.reason]
    assert moved and "stage change" in moved[0].parts


def test_every_policy_is_measured_over_the_same_stretch():
    step = baseline(JOB).step_s
    trace = on_full_job(f"{3.5 * step * 1000!r},remove,node3\n", num_nodes=12)
    for policy in SimPolicy:
        tl = simulate(JOB, policy, trace, until_s=40 * step)
        assert tl.span_s == 40 * step and tl.steps[-1].end_s <= 40 * step + tl.steps[-1].step_s


# About 10^4 devices in the default suite; 10^5 (about 20 s on 2 cores) in scripts/test_long.
@pytest.mark.parametrize("dp", [78, pytest.param(781, marks=pytest.mark.long)])
def test_ten_to_the_fifth_devices_simulate_1000_steps_in_under_60_s(dp):
    job = SimJob(PRESETS["llama2-7b"], device("h100"), tp=8, pp=16, dp=dp, micro_batch=1,
                 global_batch=dp * 64)  # fmt: skip
    step = baseline(job).step_s
    nodes = range(0, job.num_nodes, job.num_nodes // 10)
    trace = on_full_job(
        "".join(f"{(k + 1) * 90 * step * 1000!r},remove,node{n}\n" for k, n in enumerate(nodes)),
        num_nodes=job.num_nodes,
    )
    started = time.perf_counter()
    tl = simulate(job, SimPolicy.ELASWAVE, trace, steps=1000)
    elapsed = time.perf_counter() - started
    assert len(tl.steps) == 1000 and len(tl.changes) >= 10 and tl.stopped is None
    assert elapsed < 60, f"{job.num_devices} devices: {elapsed:.1f} s"


def test_recycle_re_routes_until_the_node_returns_and_its_processes_restart():
    j13 = SimJob(PRESETS["llama2-13b"], device("ascend-910b"), tp=4, pp=6, dp=4, micro_batch=2,
                 global_batch=2048, layout=Layout.REPLICA_MAJOR)  # fmt: skip
    step = baseline(j13).step_s
    back = 10 * step * 1000
    trace = on_full_job(f"{2 * step * 1000!r},remove,node0\n{back!r},add,node0\n", num_nodes=12)
    costs = RecoveryCosts(process_restart_s=3 * step)
    tl = simulate(j13, SimPolicy.RECYCLE, trace, steps=24, costs=costs)
    remove, add = tl.changes
    assert "re-routed to same-stage peers" in remove.reason
    assert add.time_s >= back / 1000 + 3 * step, "the returning ranks start first"
    assert "take their micro-batches back" in add.reason and "quorum" in add.parts
    slow = [s for s in tl.steps if s.step_s > step * 1.01]
    assert slow and all(s.samples == 2048 for s in tl.steps), "ReCycle keeps the global batch"
    assert tl.steps[-1].step_s == pytest.approx(step)


def test_recycle_waits_for_nodes_when_its_peers_run_out_of_memory():
    j34 = SimJob(PRESETS["llama2-34b"], device("ascend-910b"), tp=4, pp=8, dp=3, micro_batch=1,
                 global_batch=768, layout=Layout.STAGE_MAJOR)  # fmt: skip
    trace = on_full_job("1000,remove,node0\n", num_nodes=j34.num_nodes)
    tl = simulate(j34, SimPolicy.RECYCLE, trace, until_s=100)
    (change,) = tl.changes
    assert "waits for nodes" in change.reason and "runs out of memory on stage 0" in change.reason
    assert tl.waited_s > 0
    assert simulate(j34, SimPolicy.ELASWAVE, trace, until_s=100).waited_s == 0


@pytest.mark.long  # 15 s of simulation: scripts/test_long
def test_a_pipeline_shrunk_by_churn_goes_on_and_grows_back():
    """Regression (elaswave sim --spot-hours 10.9 --spot-nodes 34 --spot-bursts-per-hour 5
    --spot-burst-mean 3 --seed 2 on tp1 pp4 dp8): a burst left 3 ranks, the pipeline
    shrank to 2 stages in smaller micro-batches, and the next removal crashed the
    simulator ("no partition of 34 layers over 2 stages fits the memory caps") from the
    throughput planner; later joiners took no samples, the micro-batches never growing
    back. Now it waits for nodes, then grows back to 4 stages and the job's
    micro-batches."""
    from elaswave.sim.trace import spot_trace, to_slots

    job = SimJob(PRESETS["llama2-7b"], device("h100"), tp=1, pp=4, dp=8, micro_batch=1,
                 global_batch=512, devices_per_node=1)  # fmt: skip
    events = spot_trace(capacity=34, hours=10.9, seed=2, bursts_per_hour=5, burst_mean=3)
    trace = to_slots(events, job.num_nodes)
    tl = simulate(job, SimPolicy.ELASWAVE, trace.events, until_s=2400)
    assert any("the pipeline becomes 2 stages" in c.reason for c in tl.changes)
    assert tl.waited_s > 0
    last = [c for c in tl.changes if "the pipeline becomes 4 stages" in c.reason]
    assert last, [c.reason[:80] for c in tl.changes[-12:]]
