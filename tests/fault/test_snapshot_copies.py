"""Two copies of every snapshot (``--snapshot-copies 2``): an owner killed together with
the holder of its first copy is rebuilt from the second, inside the step, and the run
matches the fault-free one; with one copy the same faults stop the job naming the lost
shard, and with the owner and both holders gone the message names both holders."""

from __future__ import annotations

import pytest

from elaswave.engine.cost import snapshot_host_bytes
from elaswave.fabric.placement import place_snapshots_across
from elaswave.runtime.job.config import JobConfig
from tests.fault.recovery import JOB, check_recovered
from tests.runs import elaswave, train

pytestmark = pytest.mark.timeout(300)


def _holders(owner: int, copies: int) -> tuple[int, ...]:
    """Holders of ``owner``'s snapshot in the dp2 x pp2 job (ranks 0-1, then 2-3)."""
    return place_snapshots_across([[0, 1], [2, 3]], 1, copies).holders_of(owner)


def test_an_owner_and_its_first_holder_lost_together_are_rebuilt_from_the_second(
    runs_dir, reference
):
    first, _ = _holders(0, 2)
    assert _holders(0, 1) == (first,)  # the first copy stays where one copy would be
    faults = ("--fault", "kill:0@3:backward", "--fault", f"kill:{first}@3:backward")
    run = train(runs_dir / "copies2", "--dp", "2", "--pp", "2", *JOB, "--snapshot-copies",
                "2", *faults)  # fmt: skip
    check_recovered(run, reference(2, 2), world=4, failed=[sorted([0, first])])


@pytest.mark.long  # the one-copy stop is tests/fault/test_fail_stop.py's by default
def test_with_one_copy_the_same_faults_stop_naming_the_lost_shard(tmp_path):
    (first,) = _holders(0, 1)
    proc = elaswave(
        "train", "--out", str(tmp_path / "one"), "--dp", "2", "--pp", "2", *JOB,
        "--fault", "kill:0@3:backward", "--fault", f"kill:{first}@3:backward", timeout=240,
    )  # fmt: skip
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert f"(owner 0, snapshot holder {first})" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.long  # the message's form is tests/unit/test_reshard.py's by default
def test_an_owner_and_every_holder_lost_names_them_all(tmp_path):
    """dp4 x pp1 (no pipeline, so every rank reaches its backward and its fault): rank
    0 and both holders of its snapshot are killed; rank 3 is left without a copy."""
    holders = place_snapshots_across([[0, 1, 2, 3]], 1, 2).holders_of(0)
    assert 3 not in holders
    kills = [arg for r in (0, *holders) for arg in ("--fault", f"kill:{r}@3:backward")]
    proc = elaswave(
        "train", "--out", str(tmp_path / "all"), "--dp", "4", "--pp", "1", *JOB,
        "--snapshot-copies", "2", *kills, timeout=240,
    )  # fmt: skip
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert f"(owner 0, snapshot holders {list(holders)})" in proc.stderr, proc.stderr[-2000:]


def test_a_bad_copy_count_gets_one_clear_line(tmp_path):
    proc = elaswave("train", "--out", str(tmp_path / "bad"), "--snapshot-copies", "0", timeout=60)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "snapshot_copies = 0: must be a positive integer" in proc.stderr, proc.stderr


@pytest.mark.long  # two dp4 runs; scripts/test_long
def test_host_memory_grows_with_the_copies_as_the_model_prices_it(runs_dir):
    """dp4 x pp1 (equal shards): each rank's snapshot memory, reported in summary.json,
    doubles with a second copy and is what the memory model prices, within the keeper's
    gradient buffers (2 in the model; 1 to 3 held at the end)."""
    job = ("--dp", "4", "--pp", "1", *JOB)
    held = {k: train(runs_dir / f"mem{k}", *job, "--snapshot-copies", str(k)) for k in (1, 2)}
    one, two = (held[k].summary.snapshot_host_bytes for k in (1, 2))
    assert one is not None and two is not None and sorted(one) == sorted(two) == [0, 1, 2, 3]
    params = sum(c.params for c in JobConfig().layer_costs)  # the default model's
    for k, measured in ((1, one), (2, two)):
        fewest, most = (snapshot_host_bytes(params, dp=4, copies=k, grad_buffers=b) for b in (1, 3))
        for rank, got in measured.items():
            assert fewest <= got <= most, (k, rank, got, fewest, most)
    assert sum(two.values()) > 1.8 * sum(one.values())
