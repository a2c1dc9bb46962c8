"""Interleaved A/B of the MTTR of one fault: this tree against a git revision.

    .venv/bin/python scripts/mttr_ab.py --base 73e28cd [--runs 8] [--fault kill:5@10:backward]

Checks the revision out into a temporary worktree, with a virtual environment that
sees this one's packages but imports elaswave from the worktree, and runs the same job
alternately on it and on this tree (base first, then this tree, ``--runs`` pairs), so
that the machine's drift hits both alike; prints each pair's MTTR (summary.json) and
the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def mttr(python: str, tree: Path, out: Path, args: argparse.Namespace) -> tuple[float, Phases]:
    """The run's MTTR and its phases (read as plain JSON: the base's summary schema may
    differ from this tree's)."""
    cmd = [python, "-m", "elaswave.cli.main", "train", "--dp", "4", "--pp", "2"]
    cmd += ["--steps", str(args.steps), "--fault", args.fault, "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, cwd=tree)
    (rec,) = json.loads((out / "summary.json").read_text())["recoveries"]
    phases = {k: float(v) for k, v in rec.get("phases", {}).items() if v is not None}
    return float(rec["mttr_s"]), phases


Phases = dict[str, float]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="git revision to compare against")
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--fault", default="kill:5@10:backward")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(base), args.base],
            cwd=ROOT, check=True, capture_output=True,
        )  # fmt: skip
        venv = Path(tmp) / "venv"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        (site,) = (venv / "lib").glob("python*/site-packages")
        packages = next(p for p in sys.path if p.endswith("site-packages"))
        (site / "base.pth").write_text(f"{base}\n{packages}\n")  # no editable install
        try:
            times: dict[str, list[float]] = {"base": [], "this": []}
            phases: dict[str, list[Phases]] = {"base": [], "this": []}
            pythons = {"base": str(venv / "bin" / "python"), "this": sys.executable}
            for i in range(args.runs):
                for name, tree in (("base", base), ("this", ROOT)):
                    t, p = mttr(pythons[name], tree, Path(tmp) / f"{name}{i}", args)
                    times[name].append(t)
                    phases[name].append(p)
                print(f"pair {i}: base {times['base'][-1]:.3f} s, this {times['this'][-1]:.3f} s")
            for name, values in times.items():
                print(
                    f"{name}: median MTTR {statistics.median(values):.3f} s over {len(values)} runs"
                )
                print(f"{name}: median phases (s) {_median_phases(phases[name])}")
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT)


def _median_phases(runs: list[Phases]) -> str:
    names = sorted({k for run in runs for k in run})
    medians = {n: statistics.median(run[n] for run in runs if n in run) for n in names}
    return " ".join(f"{n}={v:.3f}" for n, v in medians.items())


if __name__ == "__main__":
    main()
