"""Load a job from a TOML file plus command-line overrides into the frozen config classes.

Sections map to config classes: [model] (optionally ``preset = "tiny"`` first), [data],
[optim] and [train]. Unknown sections or keys, wrong types and out-of-range values raise
ValueError with one message naming the value and what would be valid.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from elaswave.data.corpus import DataConfig
from elaswave.fabric.adamw import OptimizerConfig
from elaswave.model.config import ModelConfig, preset
from elaswave.runtime.job.config import JobConfig, TrainConfig

SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "optim": OptimizerConfig,
    "train": TrainConfig,
}


def _check_types(section: str, cls: type, values: dict[str, Any]) -> None:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key, value in values.items():
        if key not in names:
            raise ValueError(f"unknown key [{section}] {key!r}; valid keys: {', '.join(names)}")
        hint = hints[key]
        if typing.get_origin(hint) is tuple:  # e.g. faults: a TOML array of strings
            if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"[{section}] {key} = {value!r}: expected an array of strings")
            values[key] = tuple(value)
            continue
        allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        allowed = tuple(a for a in allowed if isinstance(a, type))
        if float in allowed:
            allowed += (int,)
        ok = isinstance(value, allowed) and not (isinstance(value, bool) and bool not in allowed)
        if not ok:
            want = " or ".join("none" if a is type(None) else a.__name__ for a in allowed)
            raise ValueError(f"[{section}] {key} = {value!r}: expected {want}")


def load_toml(path: Path) -> dict[str, dict[str, Any]]:
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"config file {str(path)!r} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config file {str(path)!r} is not valid TOML: {exc}") from None
    for section, body in raw.items():
        if section not in SECTIONS:
            raise ValueError(
                f"unknown section [{section}] in {str(path)!r}; valid sections: "
                f"{', '.join(SECTIONS)}"
            )
        if not isinstance(body, dict):
            raise ValueError(f"{section} in {str(path)!r} must be a [{section}] table")
    return raw


def _hf_base(values: dict[str, Any]) -> ModelConfig:
    """A Hugging Face model's shape from its config.json; of the shape keys only
    ``seq_len`` may be given (the rest are the model's)."""
    source = values.pop("source")
    if not isinstance(source, str):
        raise ValueError(f"[model] source = {source!r}: expected a string such as hf:DIR")
    own = [k for k in values if k != "seq_len"]
    if own:
        raise ValueError(
            f"[model] {', '.join(own)}: the model {source} takes its shape from its own "
            "config; only seq_len may be set"
        )
    seq_len = values.get("seq_len", ModelConfig().seq_len)
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise ValueError(f"[model] seq_len = {seq_len!r}: must be a positive integer")
    if source.startswith("megatron:"):
        from elaswave.model.megatron import megatron_shape

        return megatron_shape(source, seq_len=seq_len)
    from elaswave.model.hf import hf_shape  # imports transformers: only when asked for

    return hf_shape(source, seq_len=seq_len)


def build_job(
    file_values: dict[str, dict[str, Any]] | None = None,
    overrides: dict[str, dict[str, Any]] | None = None,
) -> JobConfig:
    """Merge TOML values and overrides (overrides win) and validate everything."""
    merged: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for source in (file_values or {}, overrides or {}):
        for section, values in source.items():
            merged[section].update({k: v for k, v in values.items() if v is not None})
    model_values = dict(merged["model"])
    name = str(model_values.pop("preset")) if "preset" in model_values else None
    if name is not None and name.startswith(("hf:", "megatron:")):  # --model hf:DIR
        model_values.setdefault("source", name)
        name = None
    base = preset(name) if name is not None else ModelConfig()
    if model_values.get("source"):
        base = _hf_base(model_values)
    parts: dict[str, Any] = {}
    for section, cls in SECTIONS.items():
        values = model_values if section == "model" else merged[section]
        _check_types(section, cls, values)
        if section == "model":
            parts[section] = dataclasses.replace(base, **values)
        else:
            parts[section] = cls(**values)
    return JobConfig(**parts)
