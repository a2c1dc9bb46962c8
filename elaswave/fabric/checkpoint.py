"""Disk checkpoints of the optimizer state, in a layout-independent form.

Each rank writes the element ranges it owns of every layer's flat state (fp32 master
weights, exp_avg, exp_avg_sq): a checkpoint is the union of those pieces, so it can be
read back on any dp x pp layout by assembling whole layers and slicing new shards.
Parameters need no separate copy: they are the fp32 master weights.

A piece is named by its owner and the plan generation that wrote it
(``rank{R}.g{G}.pt``), with a small manifest beside it (``rank{R}.g{G}.json``: each
layer's element range) written after the piece is in place, so completeness is judged
from manifests without reading tensors. A step can be written twice, by two generations
(a step redone after a recovery rolled back past it, or re-trained after a checkpoint
was restored inside the job); one generation's pieces never overlap, so a checkpoint of
a step is complete when the pieces of one generation cover every layer exactly. Files
are written under a temporary name and renamed: a crash mid-write leaves no partial
piece. (Pieces named ``rank{R}.pt``, without a manifest, are read as one generation.)

In a tensor-parallel job each member of a rank holds its own slice of every layer, so
member M's pieces go to ``step{N}/tp{M}/`` (:func:`piece_dir`), each such directory a
checkpoint of the members' slices as above; a step is complete when every member's is.
It is read back on any dp x pp layout with the same tp.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path

import torch

from elaswave.fabric.adamw import ShardState
from elaswave.fabric.layout import InterleavedLayout
from elaswave.rundir import CHECKPOINTS, step_dir

_STEP_DIR = re.compile(r"^step(\d+)$")
_PIECE = re.compile(r"^rank(\d+)(?:\.g(\d+))?\.pt$")

LayerState = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""A layer's whole flat (master, exp_avg, exp_avg_sq)."""


def shard_pieces(layout: InterleavedLayout, replica: int, state: ShardState) -> dict:
    """This replica's element ranges of every layer, copied (safe to write in background)."""
    pieces = {}
    for shards, (layer, base, _) in zip(layout.layers, layout.shard_slices(), strict=True):
        lo = min(replica * shards.shard, shards.numel)
        hi = min(lo + shards.shard, shards.numel)
        n = hi - lo
        pieces[layer] = {
            "numel": shards.numel,
            "lo": lo,
            "hi": hi,
            "state": torch.stack(  # a copy: safe to write in the background
                [t[base : base + n] for t in (state.master, state.exp_avg, state.exp_avg_sq)]
            ),
        }
    return pieces


def piece_dir(run_dir: Path, step: int, member: int = 0, tp: int = 1) -> Path:
    """Where TP member ``member``'s pieces of the checkpoint of ``step`` go: the step's
    directory, or with ``tp`` > 1 the member's own under it."""
    directory = step_dir(run_dir, step)
    return directory if tp == 1 else directory / f"tp{member}"


def write_pieces(
    run_dir: Path,
    step: int,
    rank: int,
    pieces: dict,
    generation: int = 0,
    *,
    member: int = 0,
    tp: int = 1,
) -> Path:
    """Write ``rank``'s pieces (TP member ``member``'s of ``tp``) of the checkpoint of
    ``step`` (as generation ``generation`` trained it), then their manifest."""
    directory = piece_dir(run_dir, step, member, tp)
    directory.mkdir(parents=True, exist_ok=True)
    name = f"rank{rank}.g{generation}"
    final = directory / f"{name}.pt"
    tmp = directory / f".{name}.pt.tmp"
    torch.save({"step": step, "rank": rank, "generation": generation, "layers": pieces}, tmp)
    os.replace(tmp, final)
    manifest = {
        "step": step, "rank": rank, "generation": generation,
        "layers": {str(k): [p["numel"], p["lo"], p["hi"]] for k, p in pieces.items()},
    }  # fmt: skip
    tmp = directory / f".{name}.json.tmp"
    tmp.write_text(json.dumps(manifest))
    os.replace(tmp, directory / f"{name}.json")
    return final


Ranges = dict[int, tuple[int, int, int]]
"""A piece's manifest: layer -> (numel, lo, hi)."""


def _pieces(directory: Path) -> dict[int, list[tuple[Path, Ranges]]]:
    """Every complete piece in ``directory`` by the generation that wrote it."""
    out: dict[int, list[tuple[Path, Ranges]]] = {}
    for path in sorted(directory.glob("rank*.pt")):
        if (m := _PIECE.match(path.name)) is None:
            continue
        if m[2] is None:  # written before pieces had manifests: read its ranges
            doc = torch.load(path, weights_only=True)
            ranges = {int(k): (p["numel"], p["lo"], p["hi"]) for k, p in doc["layers"].items()}
            out.setdefault(-1, []).append((path, ranges))
            continue
        manifest = path.with_suffix(".json")
        if not manifest.is_file():
            continue  # its manifest is not written yet: the piece may be incomplete
        doc = json.loads(manifest.read_text())
        ranges = {int(k): (v[0], v[1], v[2]) for k, v in doc["layers"].items()}
        out.setdefault(int(m[2]), []).append((path, ranges))
    return out


def _covered(pieces: list[tuple[Path, Ranges]], layers: Iterable[int]) -> bool:
    """Whether ``pieces`` cover every element of each of ``layers`` exactly once."""
    for layer in layers:
        spans = [r[layer] for _, r in pieces if layer in r]
        covered = 0
        for _, lo, hi in sorted(spans, key=lambda s: s[1]):
            if lo != covered:
                return False  # a gap or an overlap
            covered = hi
        if not spans or covered != spans[0][0]:
            return False
    return True


def complete_generation(directory: Path, layers: Iterable[int]) -> int | None:
    """The newest generation whose pieces in ``directory`` cover ``layers``."""
    layers = list(layers)
    groups = _pieces(directory) if directory.is_dir() else {}
    return next((g for g in sorted(groups, reverse=True) if _covered(groups[g], layers)), None)


def load_layers(directory: Path, layers: Iterable[int]) -> dict[int, LayerState]:
    """Whole layers ``layers`` from the newest generation's pieces that cover them."""
    layers = list(layers)
    generation = complete_generation(directory, layers)
    if generation is None:
        raise ValueError(f"checkpoint {directory} does not cover layers {layers} completely")
    by_layer: dict[int, list[dict]] = {}
    for path, ranges in _pieces(directory)[generation]:
        if not set(ranges) & set(layers):
            continue
        doc = torch.load(path, weights_only=True)
        for layer, piece in doc["layers"].items():
            by_layer.setdefault(int(layer), []).append(piece)
    return {layer: _assemble(by_layer[layer]) for layer in layers}


def _assemble(pieces: list[dict]) -> LayerState:
    out = torch.zeros(3, pieces[0]["numel"])
    for p in pieces:
        out[:, p["lo"] : p["hi"]] = p["state"]
    return out[0], out[1], out[2]


def step_complete(run_dir: Path, step: int, num_layers: int, tp: int = 1) -> bool:
    """Whether every TP member's pieces of ``step`` (each of one generation) cover all
    ``num_layers`` layers."""
    layers = range(num_layers)
    return all(
        complete_generation(piece_dir(run_dir, step, m, tp), layers) is not None for m in range(tp)
    )


def _steps(run_dir: Path) -> list[int]:
    """The checkpoint steps with a directory, newest first."""
    root = run_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted((int(m[1]) for p in root.glob("step*") if (m := _STEP_DIR.match(p.name))),
                  reverse=True)  # fmt: skip


def complete_steps(
    run_dir: Path, num_layers: int, known: frozenset[int] = frozenset(), tp: int = 1
) -> frozenset[int]:
    """Every checkpoint step complete for all ``num_layers`` layers (:func:`step_complete`);
    steps in ``known`` (complete before) are not read again."""
    return frozenset(
        s for s in _steps(run_dir) if s in known or step_complete(run_dir, s, num_layers, tp)
    )


def latest_complete(run_dir: Path, num_layers: int, tp: int = 1) -> int | None:
    """The newest checkpoint step complete for all ``num_layers`` layers."""
    return next((s for s in _steps(run_dir) if step_complete(run_dir, s, num_layers, tp)), None)


def shard_of_layers(
    layout: InterleavedLayout, replica: int, layers: dict[int, LayerState]
) -> ShardState:
    """Replica ``replica``'s shard vectors cut from whole layers (decay mask left empty)."""
    parts = [
        layout.shard_of([layers[s.layer][i] for s in layout.layers], replica) for i in range(3)
    ]
    return ShardState(parts[0], parts[1], parts[2], torch.zeros(0))
