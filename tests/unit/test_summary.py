import torch

from elaswave.engine.plan import initial_plan
from elaswave.runtime.core.summary import build_summary
from elaswave.runtime.job.results import WorkerResult, write_worker_result


def _worker(run_dir, rank, first_step, step_time_s, loss=None):
    result = WorkerResult(
        rank=rank, stage=0, replica=rank, step_time_s=tuple(step_time_s),
        loss=None if loss is None else tuple(loss), loss_steps=(), traces=(),
        optimizer_shard_numel=0, stage_param_numel=0, optimizer_digests=(),
        snapshot_digests={}, generation=0, first_step=first_step, bus={}, cpu_s=0.0,
        snapshot_cpu_s=0.0,
    )  # fmt: skip
    write_worker_result(run_dir, result)


def test_a_joiner_step_times_count_from_its_own_first_step(tmp_path):
    (tmp_path / "workers").mkdir()
    (tmp_path / "params").mkdir()
    torch.save({0: {"w": torch.ones(2)}}, tmp_path / "params" / "stage0.pt")
    _worker(tmp_path, 0, 0, [3.0, 1.0, 1.0, 1.0, 1.0], loss=[5.0, 4.0, 3.0, 2.0, 1.0])
    _worker(tmp_path, 1, 0, [3.0, 1.0, 1.0, 1.5, 1.0])
    _worker(tmp_path, 2, 3, [2.0, 1.2])  # joined at step 3
    plan = initial_plan(num_layers=2, dp=1, pp=2, global_batch=4, micro_batch=2)
    summary = build_summary(run_dir=tmp_path, plan=plan, steps=5, num_events=0, device="cpu")
    assert summary.step_time_s == (3.0, 1.0, 1.0, 2.0, 1.2)


def test_the_summary_predicts_the_initial_plan_step_time_from_the_job_costs(tmp_path):
    from elaswave.engine.cost import device, layer_costs
    from elaswave.engine.steptime import plan_step_time
    from elaswave.model.config import ModelConfig

    (tmp_path / "workers").mkdir()
    (tmp_path / "params").mkdir()
    torch.save({0: {"w": torch.ones(2)}}, tmp_path / "params" / "stage0.pt")
    _worker(tmp_path, 0, 0, [1.0, 1.0], loss=[2.0, 1.0])
    model = ModelConfig()
    plan = initial_plan(num_layers=model.num_layers, dp=1, pp=2, global_batch=4, micro_batch=2)
    layers, dev = layer_costs(model, dtype_bytes=4), device("emulated")
    summary = build_summary(run_dir=tmp_path, plan=plan, steps=2, num_events=0, device="cpu",
                            layers=layers, cost_device=dev)  # fmt: skip
    assert summary.predicted_step_s == plan_step_time(plan, layers, dev).step_s > 0
    bare = build_summary(run_dir=tmp_path, plan=plan, steps=2, num_events=0, device="cpu")
    assert bare.predicted_step_s is None


def test_the_summary_records_the_initial_plans_schedule_through_summary_json(tmp_path):
    from elaswave.engine.schedule import Schedule
    from elaswave.runtime.job.results import read_summary, write_summary

    (tmp_path / "workers").mkdir()
    (tmp_path / "params").mkdir()
    torch.save({0: {"w": torch.ones(2)}}, tmp_path / "params" / "stage0.pt")
    _worker(tmp_path, 0, 0, [1.0, 1.0], loss=[2.0, 1.0])
    plan = initial_plan(num_layers=4, dp=1, pp=2, global_batch=8, micro_batch=1,
                        schedule=Schedule.ZB_H1)  # fmt: skip
    summary = build_summary(run_dir=tmp_path, plan=plan, steps=2, num_events=0, device="cpu")
    assert summary.schedule is Schedule.ZB_H1
    write_summary(tmp_path, summary)
    assert read_summary(tmp_path).schedule is Schedule.ZB_H1
