"""What the zygote loads once for every process of a job (:mod:`elaswave.runtime.host.
zygote`): the Core's and the worker's modules without torch's compiler, and everything
a worker's first step would otherwise import while its pipeline waits."""

from __future__ import annotations

import json
import subprocess
import sys

PRELOAD = (
    "import importlib, sys, torch\n"
    "import elaswave.runtime.core.process, elaswave.runtime.worker.process\n"
)


def _run(code: str) -> object:
    """What a fresh interpreter prints last (JSON) after ``code``."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_core_and_worker_modules_load_no_compiler_and_no_pipelining_package() -> None:
    """torch's pipelining package imports its compiler (dynamo, sympy, DTensor): 1.6 s
    before every job's first fork when the split backward took its grouping from it."""
    heavy = ["torch._dynamo", "torch.distributed.pipelining", "torch.distributed.tensor"]
    probe = f"{PRELOAD}import json\nprint(json.dumps([m for m in {heavy!r} if m in sys.modules]))"
    assert _run(probe) == []


def test_after_the_preload_a_first_step_imports_nothing() -> None:
    """A backward (torch.autograd imports symbolic shapes on its first call, 0.8 s), the
    split backward's autograd passes and a checkpoint's torch.save load no module that
    the zygote has not loaded (each worker would load it in its first step)."""
    probe = PRELOAD + (
        "import io, json\n"
        "from elaswave.runtime.host.zygote import LAZY_IMPORTS\n"
        "for name in LAZY_IMPORTS:\n"
        "    importlib.import_module(name)\n"
        "before = set(sys.modules)\n"
        "x = torch.ones(2, 3, requires_grad=True)\n"
        "(x @ torch.ones(3, 2)).sum().backward()\n"
        "torch.autograd.grad((x * x).sum(), [x])\n"
        "torch.save({'x': x.detach()}, io.BytesIO())\n"
        "print(json.dumps(sorted(set(sys.modules) - before)))\n"
    )
    assert _run(probe) == []
