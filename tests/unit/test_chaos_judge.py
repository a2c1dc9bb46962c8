"""scripts/chaos.py's verdict on a stopped job, on made-up stop messages: the hint a stop
appends on how to go on (``--resume`` from a complete checkpoint) is not its reason, and a
TP job whose every unit lost a member stops as designed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "chaos.py"
_SPEC = importlib.util.spec_from_file_location("chaos", _PATH)
assert _SPEC is not None and _SPEC.loader is not None
chaos = sys.modules.setdefault("chaos", importlib.util.module_from_spec(_SPEC))
_SPEC.loader.exec_module(chaos)

CASE = chaos.Case(seed=90917, index=22, dp=2, pp=1, ranks_per_node=1, steps=10,
                  global_batch=4, micro_batch=1, faults=(), policy="resize",
                  device="cpu-strict", tp=4, checkpoint_every=3)  # fmt: skip
HINT = "; resume from the checkpoint of step 5 with --resume /runs/case0022"


def _verdict(reason: str, units: set[int]) -> str:
    job = chaos.Job(out=Path("/nonexistent"), code=1, stdout="", wall_s=1.0,
                    stderr=f"elaswave: job failed: {reason}\n")  # fmt: skip
    return chaos._judge_stop(CASE, job, units).outcome


@pytest.mark.parametrize("hint", ["", HINT])
def test_a_stop_is_judged_by_its_reason_whatever_it_says_of_resuming(hint):
    reason = "rank 1 exited with signal SIGKILL; no worker survives"
    assert _verdict(reason + hint, {0, 1}) == "stopped-ok"  # a member of each unit killed
    assert _verdict(reason + hint, {0}) == "unexplained-stop"  # unit 1 was never a victim
    wait = "ranks [1] did not pause within 30.0 s"
    assert _verdict(wait + hint, {0, 1}) == "unexplained-stop"
