"""`elaswave sim`: bad input is one line naming the value; a run writes JSON and a PNG."""

from __future__ import annotations

import json

import pytest
import torch

from elaswave.cli.main import main
from elaswave.cli.sim import device_fraction
from elaswave.engine.steptime import plan_step_time
from elaswave.runtime.host.profile import profile_layers
from elaswave.runtime.job.config import JobConfig
from elaswave.sim.policies import SimJob
from elaswave.sim.trace import format_trace, full_start, slot_trace
from tests.png import read_png

pytestmark = pytest.mark.timeout(120)

SMALL = ["--model", "llama2-13b", "--pp", "6", "--dp", "4", "--micro-batch", "2",
         "--global-batch", "2048", "--steps", "30"]  # fmt: skip
START = format_trace(full_start(12)).removeprefix("time_ms,event,node\n")  # SMALL's 12 nodes


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("0,add,node1\n10,explode,node2\n", ":2: '10,explode,node2': unknown event 'explode'"),
        ("100,add,node1\n10,add,node2\n", ":2: '10,add,node2': time goes backwards"),
        (
            "100,remove,node3\n",
            ":1: '100,remove,node3': node3 is not in the cluster: traces start from an empty "
            "cluster; add every node first (0,add,node3)",
        ),
        ("100,add,node/1\n", ":1: '100,add,node/1': node id 'node/1': use letters, digits"),
        ("100;remove;node1\n", ":1: '100;remove;node1': expected time_ms,add|remove,NODE"),
        ("0,add,node3\n5,add,node3\n", ":2: '5,add,node3': node3 is already in the cluster"),
        (
            "0,add,a\n0,add,b\n9000,add,c\n",
            "trace.csv: the trace never has 12 nodes at once for the job's 12 node slots "
            "(at most 3, first at 9000 ms): use a smaller job (--dp/--pp/--tp)",
        ),
    ],
)
def test_a_bad_trace_is_refused_naming_the_line(tmp_path, capsys, text, words):
    trace = tmp_path / "trace.csv"
    trace.write_text(text)
    out = tmp_path / "out"
    assert main(["sim", "--trace", str(trace), "--out", str(out), *SMALL]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("elaswave: error: ") and words in err and "\n" not in err
    assert not out.exists(), "nothing is written for a refused trace"


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--policies", "elaswave,foo"], "unknown policy 'foo'; valid: elaswave"),
        (["--layout", "diagonal"], "--layout 'diagonal': valid layouts: stage-major"),
        (["--schedule", "gpipe"], "--schedule 'gpipe': valid schedules: auto, 1f1b, zb-h1"),
        (["--mtbf-hours", "-1"], "--mtbf-hours -1.0: must be a positive number"),
        (["--model", "gpt5"], "unknown model preset 'gpt5'"),
        (["--tp", "3"], "tp = 3 does not divide 8 devices per node"),
        (["--trace", "/no/such.csv"], "--trace '/no/such.csv': No such file"),
        (["--every-s", "10", "--count", "12"], "--count 12: must be in 0..11"),
        (["--spot-hours", "0"], "--spot-hours 0.0: must be a positive number"),
        (["--spot-hours", "1e9"], "--spot-hours 1000000000.0: must be at most 10000"),
        (["--spot-hours", "2", "--spot-nodes", "0"], "--spot-nodes 0: must be in 1..1000000"),
        (["--spot-nodes", "20"], "--spot-nodes: only with --spot-hours"),
        (["--spot-hours", "1", "--spot-nodes", "8"], "never has 12 nodes at once"),
    ],
)
def test_bad_flags_are_one_line(tmp_path, capsys, flags, words):
    assert main(["sim", "--out", str(tmp_path / "o"), *SMALL, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err and "Traceback" not in err


def test_a_run_writes_every_policy_to_json_and_a_png(tmp_path, capsys):
    trace = tmp_path / "spot.csv"
    trace.write_text(f"time_ms,event,node\n{START}200000,remove,node11\n900000,add,node11\n")
    out = tmp_path / "out"
    assert main(["sim", "--trace", str(trace), "--out", str(out), *SMALL]) == 0
    printed = capsys.readouterr().out
    doc = json.loads((out / "sim.json").read_text())
    assert list(doc["policies"]) == [
        "elaswave", "elaswave-migrate", "elaswave-resize", "recycle", "torchft", "restart"
    ]  # fmt: skip
    for name, p in doc["policies"].items():  # all over the same stretch: the trace's
        assert p["simulated_s"] == 900 and p["steps"] >= 5 and name in printed
        removal = next(c for c in p["changes"] if c["kind"] == "remove")
        assert removal["mttr_s"] > removal["overhead_s"] > 0
    ew, ft = doc["policies"]["elaswave"], doc["policies"]["torchft"]
    assert ew["samples_per_s"] > ft["samples_per_s"]
    assert 0.89 <= ew["linear_scaling_efficiency"] <= 1.05
    assert doc["assumptions"]["process_restart_s"] == 60
    png = read_png(out / "sim.png")
    assert png.width > 800 and png.height > 300


SMALL_BATCH = ["--model", "llama2-13b", "--device", "h100", "--tp", "4", "--pp", "4", "--dp",
               "8", "--micro-batch", "1", "--global-batch", "1024", "--every-s", "600",
               "--count", "5", "--policies", "elaswave,recycle", "--no-plot"]  # fmt: skip


def test_elaswave_chooses_its_schedule_as_the_runtime_does(tmp_path, capsys):
    """`--schedule` as `elaswave run`'s, default auto: ElasWave's planner chooses the
    schedule of its initial plan and of every change. A job of one-sample micro-batches
    losing a node every 10 minutes (a stage left with 7 or 6 ranks of 8 shares every
    8-sample micro-batch unevenly): on 1F1B alone ElasWave trails ReCycle, whose
    weight-gradient passes fill the bubbles; choosing zero-bubble lists it leads, also
    against its own fault-free job."""
    docs = {}
    for schedule in ("auto", "1f1b"):
        out = tmp_path / schedule
        assert main(["sim", *SMALL_BATCH, "--schedule", schedule, "--out", str(out)]) == 0
        docs[schedule] = json.loads((out / "sim.json").read_text())
    auto, fixed = docs["auto"], docs["1f1b"]
    assert fixed["elaswave_fault_free"] == fixed["baseline"]
    assert auto["elaswave_fault_free"]["schedule"] != "1f1b"
    assert auto["elaswave_fault_free"]["samples_per_s"] > auto["baseline"]["samples_per_s"]
    assert auto["policies"]["recycle"] == fixed["policies"]["recycle"]
    recycle = auto["policies"]["recycle"]["samples_per_s"]
    assert fixed["policies"]["elaswave"]["samples_per_s"] < recycle
    assert (
        auto["policies"]["elaswave"]["vs_own_fault_free"]
        > 1.05 * recycle / (auto["baseline"]["samples_per_s"])
    )
    printed = capsys.readouterr().out
    own = auto["elaswave_fault_free"]
    assert (
        f"samples/s on 1F1B, {own['samples_per_s']:.1f} on ElasWave's {own['schedule']}" in printed
    )


def test_device_fraction_is_the_time_average_of_nodes_present():
    text = format_trace(full_start(4)) + "0,remove,node0\n50000,add,node0\n"
    events = slot_trace(text, num_slots=4).events
    assert device_fraction(events, 4, 100.0) == pytest.approx((3 * 50 + 4 * 50) / 400)
    assert device_fraction((), 4, 100.0) == 1.0


@pytest.mark.long  # the sim command: the other cases here
def test_a_spot_cluster_runs_from_its_start_with_spares(tmp_path, capsys):
    out = tmp_path / "out"
    flags = ["--spot-hours", "3", "--spot-nodes", "14", "--seed", "2", "--no-plot"]
    assert main(["sim", "--out", str(out), *SMALL, *flags]) == 0
    doc = json.loads((out / "sim.json").read_text())
    trace = doc["trace"]
    assert trace["source"].startswith("spot cluster of 14 nodes for 3 h, seed 2, job from ")
    assert 0 < trace["start_ms"] <= 300_000 and trace["max_spares"] >= 1
    assert trace["csv"].startswith("time_ms,event,node\n")
    span = (trace["end_ms"] - trace["start_ms"]) / 1000  # the trace from the job's start
    assert all(p["simulated_s"] == pytest.approx(span) for p in doc["policies"].values())


def test_sim_prices_a_run_profile_on_its_device(tmp_path, capsys):
    """--profile PATH: a run's measured layers, priced on --device, replace the FLOP
    formulas; a model of another depth, or a TP split, is refused."""
    job_cfg = JobConfig()  # the tiny built-in model
    profile = profile_layers(job_cfg, device=torch.device("cpu"), repeats=1)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile.to_dict()))
    args = ["sim", "--model", "tiny", "--device", "emulated", "--tp", "1", "--pp", "2",
            "--dp", "2", "--micro-batch", "2", "--global-batch", "16", "--steps", "20",
            "--devices-per-node", "1", "--no-plot", "--out", str(tmp_path / "sim")]  # fmt: skip
    assert main([*args, "--profile", str(path)]) == 0
    doc = json.loads((tmp_path / "sim" / "sim.json").read_text())
    assert doc["job"]["profile"] == str(path)
    dev = job_cfg.cost_device
    job = SimJob(job_cfg.model, dev, tp=1, pp=2, dp=2, micro_batch=2, global_batch=16,
                 devices_per_node=1, profile=profile.costs(dev))  # fmt: skip
    assert doc["baseline"]["step_s"] == plan_step_time(job.plan(), job.layers, job.device).step_s
    capsys.readouterr()
    assert main([*args, "--profile", str(path), "--model", "llama2-7b"]) == 2
    assert capsys.readouterr().err == (
        "elaswave: error: the profile has 6 layers, the simulated model 34: simulate the "
        "model that was profiled\n"
    )
    assert main([*args, "--profile", str(path), "--tp", "2", "--devices-per-node", "2"]) == 2
    assert "--profile with --tp 2: the profile measured whole layers; use --tp 1" in (
        capsys.readouterr().err
    )
