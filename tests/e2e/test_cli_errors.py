"""Bad input fails at start with one clear line naming the value; no traceback, no hang."""

from __future__ import annotations

import pytest

from tests.runs import elaswave

LONG = pytest.mark.long
"""Cases of a kind a default case checks (a range, a choice, an endpoint), run by
scripts/test_long: each case starts a Python process with torch (about 4 s)."""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--dp", "2", "--pp", "2", "--world-size", "6"],
            "world size 6 != dp x pp x tp = 2 x 2 x 1 = 4",
        ),
        (["--pp", "7"], "pp = 7 stages but the model has only 6 layers"),
        (
            ["--dp", "2", "--global-batch", "10", "--micro-batch", "2"],
            "global batch 10 does not divide into micro-batches of 2 on 2 DP replicas",
        ),
        (["--device", "tpu"], "unknown device 'tpu'; valid devices: cpu, cpu-strict, cuda, npu"),
        pytest.param(["--dp", "0"], "dp = 0: must be a positive integer", marks=LONG),
        (["--model", "llama2-7b"], "the llama2-* presets are for the simulator"),
        (
            ["--data", "/nonexistent/tokens.bin"],
            "data.path = '/nonexistent/tokens.bin': no such file",
        ),
        (
            ["--data-dtype", "float32"],
            "data.dtype = 'float32': valid values are uint16, int32, int64",
        ),
        (["--bus-faults", "drop=2"], "bus fault drop=2.0: must be a probability in [0, 1)"),
        pytest.param(
            ["--bus-faults", "lose=0.1"], "NAME one of drop, dup, reorder, delay, seed", marks=LONG
        ),
        pytest.param(
            ["--plan-ack-timeout", "-1"],
            "plan_ack_timeout_s = -1.0: must be 0 to 600 seconds",
            marks=LONG,
        ),
        pytest.param(
            ["--health-log-mib", "0"],
            "health_log_mib = 0: must be an integer number of MiB from 1 to 1048576",
            marks=LONG,
        ),
        (["--fault", "kill:1@3:plans"], "unknown phase 'plans'"),
        pytest.param(
            ["--wait-for-nodes", "1e6"],
            "wait_for_nodes_s = 1000000.0: must be from 0 to 86400",
            marks=LONG,
        ),
        (["--nnodes", "2"], "nnodes = 2 needs --rdzv-endpoint HOST:PORT"),
        pytest.param(
            ["--precision", "fp16"], "precision = 'fp16': valid values are fp32, bf16", marks=LONG
        ),
        (
            [
                "--nnodes",
                "3",
                "--nproc-per-node",
                "2",
                "--dp",
                "2",
                "--pp",
                "2",
                "--rdzv-endpoint",
                "127.0.0.1:29599",
            ],
            "nnodes x nproc-per-node = 3 x 2 = 6 workers, but dp x pp x tp = 2 x 2 x 1 = 4",
        ),
        pytest.param(
            ["--rdzv-endpoint", "nohost", "--nnodes", "2"],
            "--rdzv-endpoint 'nohost': expected",
            marks=LONG,
        ),
        (["--node-rank", "1"], "--node-rank 1 needs --rdzv-endpoint HOST:PORT of node 0"),
        (
            ["--node-rank", "3", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29599"],
            "--node-rank 3: must be [0, 2)",
        ),
    ],
)
def test_bad_flags(tmp_path, args, message):
    proc = elaswave("train", "--out", str(tmp_path / "run"), *args, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("elaswave: error: ") and message in lines[0], lines[0]


def test_token_file_with_ids_beyond_vocab(tmp_path):
    import numpy as np

    path = tmp_path / "tokens.i32"
    np.full(1000, 500, dtype=np.int32).tofile(path)
    proc = elaswave("train", "--data", str(path), "--data-dtype", "int32", timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "token id 500 >= model.vocab_size 128" in proc.stderr


def test_malformed_toml(tmp_path):
    bad = tmp_path / "job.toml"
    bad.write_text("[train]\ndp = = 2\n")
    proc = elaswave("train", "--config", str(bad), "--out", str(tmp_path / "run"), timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "is not valid TOML" in proc.stderr and "line 2" in proc.stderr


def test_non_integer_flag_is_one_usage_error(tmp_path):
    proc = elaswave("train", "--dp", "two", timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "argument --dp: invalid int value: 'two'" in proc.stderr


def test_cuda_without_gpu_is_refused_cleanly(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the refusal is for machines without one")
    proc = elaswave(
        "train", "--device", "cuda", "--steps", "1", "--out", str(tmp_path / "r"), timeout=120
    )
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "no CUDA device" in proc.stderr
