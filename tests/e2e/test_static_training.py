"""The static path end to end: six layouts of the same job give the same numbers."""

from __future__ import annotations

import pytest
import torch

from elaswave.engine.schedule import max_in_flight
from elaswave.runtime.core.compare import compare_runs
from elaswave.runtime.job.results import Layout
from tests.runs import Run, train

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (2, 4)]
STEPS = 20


@pytest.fixture(scope="module")
def layout_runs(runs_dir) -> dict[tuple[int, int], Run]:
    return {
        (dp, pp): train(
            runs_dir / f"dp{dp}_pp{pp}",
            "--dp",
            str(dp),
            "--pp",
            str(pp),
            "--steps",
            str(STEPS),
            "--global-batch",
            "16",
            "--micro-batch",
            "2",
        )
        for dp, pp in LAYOUTS
    }


@pytest.mark.timeout(600)
def test_layouts_agree_with_dropout_on(layout_runs):
    ref = layout_runs[(1, 1)]
    ref_loss = ref.summary.loss
    assert len(ref_loss) == STEPS
    assert ref_loss[-1] < ref_loss[0] - 1.0, "the tiny model should learn the corpus"
    for layout, run in layout_runs.items():
        diff = compare_runs(run.out, ref.out)
        assert diff.loss_rel <= 1e-5, f"{layout}: losses differ by {diff.loss_rel:.2e} relative"
        assert diff.param_rel <= 1e-5, f"{layout}: params differ by {diff.param_rel:.2e} relative"


def test_dropout_is_on_and_matters(layout_runs, runs_dir):
    """With dropout off the same job trains differently: the invariance above is not vacuous."""
    off = runs_dir / "dropout_off.toml"
    off.write_text("[model]\ndropout = 0.0\n")
    run = train(
        runs_dir / "no_dropout", "--dp", "1", "--pp", "1", "--steps", "3", "--config", str(off)
    )
    on = layout_runs[(1, 1)].summary.loss[:3]
    assert run.summary.loss[1] != pytest.approx(on[1], rel=1e-4)


def test_summary_contract(layout_runs):
    s = layout_runs[(2, 4)].summary
    assert s.layout == Layout(dp=2, pp=4, tp=1)
    assert s.global_batch == 16 and s.steps_completed == STEPS
    assert len(s.loss) == len(s.step_time_s) == STEPS
    assert s.samples_per_s > 0 and s.events > 0 and s.recoveries == ()
    assert len(s.param_digest) == 64
    # Equal-valued parameters give equal digests only when the runs are bitwise equal;
    # 1x1 and 1x2 do exactly the same arithmetic.
    assert layout_runs[(1, 1)].summary.param_digest == layout_runs[(1, 2)].summary.param_digest


@pytest.mark.parametrize("layout", [(2, 4), (4, 2)])
def test_the_default_schedule_splits_the_backward_within_1f1bs_bound(layout_runs, layout):
    """The default (``--schedule auto``) plans zero-bubble lists for these pipelines:
    every micro-batch's forward, input-gradient and weight-gradient halves, once each,
    holding activations no longer than 1F1B would (tests/fault/test_schedules.py runs
    1F1B itself, whose bound is tight)."""
    dp, pp = layout
    workers = layout_runs[layout].workers()
    assert len(workers) == dp * pp
    for worker in workers:
        for trace in worker.traces:
            actions = [(op, mb) for op, mb in trace.actions]
            num_mb = 16 // (dp * 2)
            assert sorted(actions) == sorted(
                [(op, m) for op in ("F", "I", "W") for m in range(num_mb)]
            )
            peak = max_in_flight(actions)
            assert peak <= pp - worker.stage, (worker.rank, peak)


def test_zero1_each_rank_holds_only_its_shard(layout_runs):
    workers = layout_runs[(4, 2)].workers()
    for worker in workers:
        full = worker.stage_param_numel
        shard = worker.optimizer_shard_numel
        # Shard = ceil(numel_layer / 4) summed over the stage's layers: about a quarter.
        assert full / 4 <= shard <= full / 4 + 8, (worker.rank, shard, full)
    by_stage: dict[int, set[int]] = {}
    for worker in workers:
        by_stage.setdefault(worker.stage, set()).add(worker.optimizer_shard_numel)
    assert all(len(sizes) == 1 for sizes in by_stage.values())


def test_events_log_readable(layout_runs):
    from elaswave.bus.eventlog import read_event_log
    from tests.runs import elaswave

    out = elaswave("events", str(layout_runs[(2, 2)].out))
    assert out.returncode == 0, out.stderr
    kinds = [line.split()[2] for line in out.stdout.splitlines()]
    assert kinds.count("worker_started") == 4 and kinds.count("worker_finished") == 4
    assert kinds.count("step_completed") == STEPS
    # Only hellos come before the run's start (the job host's observer connects first).
    first = next(i for i, k in enumerate(kinds) if k != "hello")
    assert kinds[first] == "run_started" and kinds[-1] == "run_finished", kinds
    # The health log's records among them: every rank's timing of every step (the
    # event log keeps those the change protocol learns from: each step's first, and
    # each rank's first).
    assert kinds.count("step_timing") == 4 * STEPS
    quiet = elaswave("events", "--no-health", str(layout_runs[(2, 2)].out)).stdout
    assert quiet.count(" step_timing ") == STEPS + 3
    assert quiet.count(" step_completed ") == STEPS
    # Liveness plumbing is not logged: no beacon, and a worker's heartbeats once in 5 s.
    every = elaswave("events", "--all", str(layout_runs[(2, 2)].out))
    assert "beacon" not in [line.split()[2] for line in every.stdout.splitlines()]
    beats = [
        line.split()[3].split("#")[0] for line in out.stdout.splitlines() if " heartbeat " in line
    ]
    assert sorted(set(beats)) == [f"rank{r}" for r in range(4)]
    times = [r.t for r in read_event_log(layout_runs[(2, 2)].out / "events.log")]
    most = 2 + (max(times) - min(times)) / 5  # the first, then one in 5 s at most
    assert all(beats.count(f"rank{r}") <= most for r in range(4)), (beats, most)


def test_param_digest_matches_params(layout_runs):
    from elaswave.runtime.core.summary import param_digest

    run = layout_runs[(2, 2)]
    assert param_digest(run.params()) == run.summary.param_digest
    perturbed = run.params()
    first = next(iter(perturbed[0].values()))
    first.view(-1)[0] += torch.finfo(torch.float32).eps
    assert param_digest(perturbed) != run.summary.param_digest


def test_trains_on_a_user_token_file(runs_dir):
    import numpy as np

    rng = np.random.default_rng(0)
    tokens = (np.arange(40_000) * 7 + rng.integers(0, 3, 40_000)) % 128
    path = runs_dir / "tokens.u16"
    tokens.astype(np.uint16).tofile(path)
    run = train(
        runs_dir / "token_file",
        "--dp",
        "2",
        "--pp",
        "2",
        "--steps",
        "6",
        "--data",
        str(path),
        "--data-dtype",
        "uint16",
    )
    loss = run.summary.loss
    assert len(loss) == 6 and loss[-1] < loss[0]
