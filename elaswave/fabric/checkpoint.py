"""Disk checkpoints of the optimizer state, in a layout-independent form.

Each rank writes the element ranges it owns of every layer's flat state (fp32 master
weights, exp_avg, exp_avg_sq): a checkpoint is the union of those pieces, so it can be
read back on any dp x pp layout by assembling whole layers and slicing new shards. A
checkpoint is complete when its pieces cover every layer exactly; files are written
under a temporary name and renamed, so a crash mid-write leaves no partial piece.
Parameters need no separate copy: they are the fp32 master weights.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

import torch

from elaswave.fabric.adamw import ShardState
from elaswave.fabric.layout import InterleavedLayout
from elaswave.rundir import CHECKPOINTS, step_dir

_STEP_DIR = re.compile(r"^step(\d+)$")

LayerState = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""A layer's whole flat (master, exp_avg, exp_avg_sq)."""


def shard_pieces(layout: InterleavedLayout, replica: int, state: ShardState) -> dict:
    """This replica's element ranges of every layer, cloned (safe to write in background)."""
    pieces = {}
    for shards, (layer, base, _) in zip(layout.layers, layout.shard_slices(), strict=True):
        lo = min(replica * shards.shard, shards.numel)
        hi = min(lo + shards.shard, shards.numel)
        n = hi - lo
        pieces[layer] = {
            "numel": shards.numel,
            "lo": lo,
            "hi": hi,
            "state": torch.stack(
                [t[base : base + n] for t in (state.master, state.exp_avg, state.exp_avg_sq)]
            ).clone(),
        }
    return pieces


def write_pieces(run_dir: Path, step: int, rank: int, pieces: dict) -> Path:
    directory = step_dir(run_dir, step)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"rank{rank}.pt"
    tmp = directory / f".rank{rank}.pt.tmp"
    torch.save({"step": step, "rank": rank, "layers": pieces}, tmp)
    os.replace(tmp, final)
    return final


def _read(directory: Path) -> dict[int, list[dict]]:
    by_layer: dict[int, list[dict]] = {}
    for path in sorted(directory.glob("rank*.pt")):
        doc = torch.load(path, weights_only=True)
        for layer, piece in doc["layers"].items():
            by_layer.setdefault(int(layer), []).append(piece)
    return by_layer


def _assemble(pieces: list[dict]) -> LayerState | None:
    numel = pieces[0]["numel"]
    out = torch.zeros(3, numel)
    covered = 0
    for p in sorted(pieces, key=lambda p: p["lo"]):
        if p["lo"] != covered:
            return None  # a gap or an overlap: not a complete checkpoint
        out[:, p["lo"] : p["hi"]] = p["state"]
        covered = p["hi"]
    if covered != numel:
        return None
    return out[0], out[1], out[2]


def load_layers(directory: Path, layers: Iterable[int]) -> dict[int, LayerState]:
    by_layer = _read(directory)
    out = {}
    for layer in layers:
        state = _assemble(by_layer.get(layer, [])) if layer in by_layer else None
        if state is None:
            raise ValueError(f"checkpoint {directory} does not cover layer {layer} completely")
        out[layer] = state
    return out


def latest_complete(run_dir: Path, num_layers: int) -> int | None:
    """The newest checkpoint step whose pieces cover all ``num_layers`` layers."""
    root = run_dir / CHECKPOINTS
    steps = (
        sorted(
            (int(m[1]) for p in root.glob("step*") if (m := _STEP_DIR.match(p.name))), reverse=True
        )
        if root.is_dir()
        else []
    )
    for step in steps:
        by_layer = _read(step_dir(run_dir, step))
        if len(by_layer) == num_layers and all(_assemble(p) is not None for p in by_layer.values()):
            return step
    return None


def shard_of_layers(
    layout: InterleavedLayout, replica: int, layers: dict[int, LayerState]
) -> ShardState:
    """Replica ``replica``'s shard vectors cut from whole layers (decay mask left empty)."""
    parts = [
        layout.shard_of([layers[s.layer][i] for s in layout.layers], replica) for i in range(3)
    ]
    return ShardState(parts[0], parts[1], parts[2], torch.zeros(0))
