"""The engine's planners, the Core's change protocol and the simulator load no torch:
they plan with values (:mod:`elaswave.comm.spec`, :mod:`elaswave.fabric.placement`,
:mod:`elaswave.fabric.errors`), so that ``elaswave sim``, replay's planners and the model
check start in a fraction of a second and run where torch is not installed."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import elaswave.engine
import elaswave.sim

ENGINE = sorted(f"elaswave.engine.{m.name}" for m in pkgutil.iter_modules(elaswave.engine.__path__))
TORCH = ("torch", "torch.distributed")
SIM = sorted(f"elaswave.sim.{m.name}" for m in pkgutil.iter_modules(elaswave.sim.__path__))


def _loaded_after(code: str) -> set[str]:
    """Which of torch and torch.distributed a fresh interpreter holds after ``code``."""
    probe = (
        f"{code}\nimport json, sys\nprint(json.dumps([m for m in {TORCH!r} if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_importing_the_engine_and_the_simulator_loads_no_torch() -> None:
    imports = "\n".join(f"import {m}" for m in [*ENGINE, *SIM, "elaswave.cli.main"])
    assert _loaded_after(imports) == set()


def test_a_simulation_from_the_command_line_loads_no_torch(tmp_path: Path) -> None:
    run = (
        "from elaswave.cli.main import main\n"
        "assert main(['sim', '--model', 'llama2-7b', '--tp', '4', '--pp', '3', '--dp', '2',"
        " '--micro-batch', '4', '--global-batch', '64', '--every-s', '600', '--count', '1',"
        f" '--out', {str(tmp_path)!r}]) == 0"
    )
    assert _loaded_after(run) == set()


def test_the_probe_sees_torch_when_it_is_loaded() -> None:
    assert _loaded_after("import elaswave.comm.group") == {"torch", "torch.distributed"}
