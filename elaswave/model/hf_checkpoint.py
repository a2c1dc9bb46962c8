"""A Hugging Face checkpoint's tensors under the names the model's modules have.

transformers 5 holds a mixture of experts' routed experts fused (``mlp.experts.gate_up_proj``,
one ``[experts, 2 x width, hidden]`` tensor), but checkpoints on disk, the hub's and the
ones ``save_pretrained`` writes, keep one tensor per expert and projection
(``mlp.experts.3.gate_proj.weight``; Mixtral's ``block_sparse_moe.experts.3.w1.weight``).
transformers converts them on load by a per-family list of renamings and merges
(``transformers.conversion_mapping``); :class:`CheckpointNames` reads the same list, so
that a layer built alone is loaded from the files as the whole model would be: renamed,
then each fused tensor stacked over the experts (``MergeModulelist(dim=0)``) and its
projections concatenated (``Concatenate(dim=1)``). A conversion of any other kind is
refused, naming the family. Names the model and the files share need nothing.

:func:`to_hub_layout` goes the other way, for ``elaswave export``: the model's fused
tensors split back into the files' one per expert and projection, and the renamings
reversed, as ``save_pretrained`` writes them (what other tools that read the hub's
checkpoints expect).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

MERGES = {("MergeModulelist", 0), ("Concatenate", 1)}
"""The conversion steps read here: stack over the experts, concatenate the projections."""


@dataclass(frozen=True)
class Fused:
    """A fused tensor's pieces: per source pattern (projection), the file tensors of
    experts 0, 1, ... in order."""

    parts: tuple[tuple[str, ...], ...]

    def assemble(self, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        stacked = [torch.stack([read(name) for name in experts]) for experts in self.parts]
        return stacked[0] if len(stacked) == 1 else torch.cat(stacked, dim=1)


def _steps(rule: Any, model_type: str, what: str) -> None:
    """Refuse a conversion rule of another kind than :data:`MERGES`, naming it."""
    steps = {(type(op).__name__, getattr(op, "dim", None)) for op in rule.operations}
    if not steps <= MERGES:
        raise ValueError(
            f"model_type = {model_type!r}: its checkpoint's {what} is converted by "
            f"{sorted(steps)}, which ElasWave does not read (only experts stacked and their "
            "projections concatenated)"
        )


def _conversions(model_type: str) -> list[Any]:
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # transformers 4: the modules hold one module per expert
        return []
    return list(get_checkpoint_conversion_mapping(model_type) or [])


class CheckpointNames:
    """Where each of the model's tensor names is in the files (see the module docstring)."""

    def __init__(self, file_names: Iterable[str], model_type: str) -> None:
        self.files = set(file_names)
        self.model_type = model_type
        conversions = _conversions(model_type)
        renamed = {self._renamed(name, conversions): name for name in self.files}
        self.renamed = {new: old for new, old in renamed.items() if new != old}
        """model name -> file name, for the names a renaming changes."""
        self.fused = self._fused(renamed, conversions)

    def _renamed(self, name: str, conversions: list[Any]) -> str:
        for rule in conversions:
            if type(rule).__name__ == "WeightRenaming":
                for source, target in zip(rule.source_patterns, rule.target_patterns, strict=True):
                    name = re.sub(source, target, name)
        return name

    def _fused(self, renamed: dict[str, str], conversions: list[Any]) -> dict[str, Fused]:
        found: dict[str, dict[int, dict[int, str]]] = defaultdict(lambda: defaultdict(dict))
        for rule in conversions:
            if type(rule).__name__ != "WeightConverter":
                continue
            (target,) = rule.target_patterns
            for which, pattern in enumerate(rule.source_patterns):
                regex = re.compile(re.escape(pattern).replace(r"\*", r"(\d+)"))
                for new, old in renamed.items():
                    if (match := regex.search(new)) is None:
                        continue
                    _steps(rule, self.model_type, old)
                    found[new[: match.start()] + target][which][int(match.group(1))] = old
        return {
            name: Fused(tuple(tuple(e[i] for i in sorted(e)) for _, e in sorted(parts.items())))
            for name, parts in found.items()
        }

    def __contains__(self, name: str) -> bool:
        return name in self.files or name in self.renamed or name in self.fused

    def read(self, name: str, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """The model's tensor ``name``, from the files (``read``: one file tensor)."""
        if name in self.files:
            return read(name)
        if name in self.renamed:
            return read(self.renamed[name])
        return self.fused[name].assemble(read)


def _literal(pattern: str) -> str | None:
    """A renaming's source pattern as the text it matches (escapes undone), None when it
    is a pattern of another kind (it cannot be written back)."""
    text = re.sub(r"\\(.)", r"\1", pattern)
    return None if re.search(r"[\^$*+?()\[\]{}|]", re.sub(r"\\.", "", pattern)) else text


def to_hub_layout(state: dict[str, torch.Tensor], model_type: str) -> dict[str, torch.Tensor]:
    """``state`` (the model's names, experts fused) as checkpoints on disk hold it: each
    fused tensor split into one per expert and projection, then the family's renamings
    undone (see the module docstring); a family without conversions as it is."""
    conversions = _conversions(model_type)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        out.update(_unfused(name, tensor, conversions, model_type) or {name: tensor})
    for rule in reversed(conversions):
        if type(rule).__name__ != "WeightRenaming":
            continue
        for source, target in zip(rule.source_patterns, rule.target_patterns, strict=True):
            text = _literal(source)
            if text is not None:
                out = {name.replace(target, text): t for name, t in out.items()}
    return out


def _unfused(
    name: str, tensor: torch.Tensor, conversions: list[Any], model_type: str
) -> dict[str, torch.Tensor] | None:
    """Fused tensor ``name`` as its files' tensors (None: not a fused one)."""
    for rule in conversions:
        if type(rule).__name__ != "WeightConverter":
            continue
        (target,) = rule.target_patterns
        if not name.endswith(target):
            continue
        _steps(rule, model_type, name)
        prefix, sources = name[: len(name) - len(target)], rule.source_patterns
        parts = tensor.chunk(len(sources), dim=1) if len(sources) > 1 else (tensor,)
        return {
            prefix + pattern.replace("*", str(expert)): part[expert].contiguous()
            for pattern, part in zip(sources, parts, strict=True)
            for expert in range(part.shape[0])
        }
    return None
