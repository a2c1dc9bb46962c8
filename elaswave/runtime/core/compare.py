"""Compare a run against a reference run: per-step losses and final parameters.

Used by the tests and the scripts that check an elastic or re-laid-out run against the
same job run plainly. Relative parameter difference is max |a - b| over max |b|.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from elaswave import rundir
from elaswave.runtime.job.results import read_summary

Params = dict[int, dict[str, torch.Tensor]]


def load_params(run_dir: Path) -> Params:
    """Final parameters of every layer of a finished run, merged from its stage files."""
    params: Params = {}
    files = rundir.stage_params_files(run_dir)
    if not files:
        raise FileNotFoundError(f"no parameter files under {run_dir / rundir.PARAMS}")
    for path in files:
        try:
            stage = torch.load(path, weights_only=True)
        except Exception as exc:  # torch.load raises many kinds for a file not its own
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
            raise ValueError(
                f"{str(path)!r} is not a parameter file that a run saved (torch.load: {why})"
            ) from None
        if not _is_params(stage):
            raise ValueError(
                f"{str(path)!r} is not a parameter file that a run saved: expected "
                "{layer index: {parameter name: tensor}}"
            )
        params.update(stage)
    return dict(sorted(params.items()))


def _is_params(stage: object) -> bool:
    """Whether ``stage`` is shaped as a stage's parameter file: {int: {str: Tensor}}."""
    return isinstance(stage, dict) and all(
        isinstance(index, int)
        and isinstance(layer, dict)
        and all(isinstance(k, str) and isinstance(t, torch.Tensor) for k, t in layer.items())
        for index, layer in stage.items()
    )


def loss_rel_diff(loss: Sequence[float], ref: Sequence[float]) -> float:
    if len(loss) != len(ref):
        raise ValueError(f"runs have {len(loss)} and {len(ref)} steps")
    return max(abs(a - b) / abs(b) for a, b in zip(loss, ref, strict=True))


def param_rel_diff(params: Params, ref: Params) -> float:
    if params.keys() != ref.keys():
        raise ValueError(f"runs hold layers {sorted(params)} and {sorted(ref)}")
    scale = max(t.abs().max().item() for layer in ref.values() for t in layer.values())
    diff = max(
        (params[layer][name] - ref[layer][name]).abs().max().item()
        for layer in ref
        for name in ref[layer]
    )
    return diff / scale


@dataclass(frozen=True)
class Comparison:
    loss_rel: float
    param_rel: float
    eval_rel: float = 0.0
    """The largest relative difference of a held-out loss (``--eval-every``; 0 where
    neither run evaluated)."""


def compare_runs(run_dir: Path, ref_dir: Path) -> Comparison:
    run, ref = read_summary(run_dir), read_summary(ref_dir)
    if run.eval_steps != ref.eval_steps:
        raise ValueError(
            f"runs evaluated after steps {list(run.eval_steps)} and {list(ref.eval_steps)}"
        )
    return Comparison(
        loss_rel=loss_rel_diff(run.loss, ref.loss),
        param_rel=param_rel_diff(load_params(run_dir), load_params(ref_dir)),
        eval_rel=loss_rel_diff(run.eval_loss, ref.eval_loss) if run.eval_loss else 0.0,
    )
