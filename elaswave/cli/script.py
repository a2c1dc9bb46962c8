"""``elaswave run``'s first look at a user's script: which model it trains.

The script runs once, with nothing started, up to its ``elaswave.job(model=...)`` call,
which writes the model to the file named by :data:`elaswave.embedded.DESCRIBE_ENV` and exits;
every process of the job (the Core's planners included) then knows the model before any
worker starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from elaswave.embedded import DESCRIBE_ENV

DESCRIBE_TIMEOUT_S = 300.0


def describe(script: Path, args: list[str]) -> str | None:
    """The model ``script`` asks for (None: the built-in one); ValueError naming the
    script when it fails or never calls ``elaswave.job``."""
    with tempfile.TemporaryDirectory(prefix="elaswave-describe-") as tmp:
        out = Path(tmp) / "model.json"
        env = dict(os.environ, **{DESCRIBE_ENV: str(out)}, OMP_NUM_THREADS="1")
        try:
            proc = subprocess.run(
                [sys.executable, str(script), *args],
                env=env,
                capture_output=True,
                text=True,
                timeout=DESCRIBE_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise ValueError(
                f"{script} did not reach elaswave.job() within {DESCRIBE_TIMEOUT_S:.0f} s"
            ) from None
        if not out.is_file():
            if proc.returncode != 0:
                tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
                raise ValueError(
                    f"{script} failed before elaswave.job() (status {proc.returncode}): {tail}"
                )
            raise ValueError(f"{script} never called elaswave.job(): nothing to run")
        model = json.loads(out.read_text())["model"]
    return None if model is None else str(model)
