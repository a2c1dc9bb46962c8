"""Load a job from a TOML file plus command-line overrides into the frozen config classes.

Tables map to config classes: [model] (optionally ``preset = "tiny"`` first), [data],
[optim], and the training settings either in their sections ([layout], [schedule],
[elastic], [liveness], [state], [network], [injection]; see
:mod:`elaswave.runtime.job.sections`) or flat in [train], as before sections existed
(``[train] dp = 2``). A key is a setting's name in either form. Unknown tables or keys,
a setting given twice, wrong types and out-of-range values raise ValueError with one
message naming the value and what would be valid.
"""

from __future__ import annotations

import dataclasses
import enum
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from elaswave.data.corpus import DataConfig
from elaswave.fabric.adamw import OptimizerConfig
from elaswave.model.config import ModelConfig, preset
from elaswave.runtime.job.config import JobConfig
from elaswave.runtime.job.sections import FLAT, SECTION_OF, SECTIONS

PARTS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "optim": OptimizerConfig,
    **SECTIONS,
}
"""JobConfig's parts by name: the tables a config file may hold, besides [train]."""

TABLES = (*PARTS, FLAT)
"""Every table a config file may hold."""


def _check_type(where: str, key: str, hint: Any, value: Any) -> Any:
    """``value`` as setting ``key`` (of type ``hint``) takes it; ValueError naming
    ``[where] key`` when its type is wrong. A choice takes its string."""
    if typing.get_origin(hint) is tuple:  # e.g. faults: a TOML array of strings
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"[{where}] {key} = {value!r}: expected an array of strings")
        return tuple(value)
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    allowed = tuple(
        str if isinstance(a, type) and issubclass(a, enum.StrEnum) else a
        for a in allowed
        if isinstance(a, type)
    )
    if float in allowed:
        allowed += (int,)
    ok = isinstance(value, allowed) and not (isinstance(value, bool) and bool not in allowed)
    if not ok:
        want = " or ".join("none" if a is type(None) else a.__name__ for a in allowed)
        raise ValueError(f"[{where}] {key} = {value!r}: expected {want}")
    return value


Given = dict[str, dict[str, tuple[str, Any]]]
"""Values by JobConfig part: key -> (the table it was given in, the value)."""


def _checked(part: str, values: dict[str, tuple[str, Any]]) -> dict[str, Any]:
    """The values for ``part``, each checked against its field's type; an error names
    the table the value was given in."""
    cls = PARTS[part]
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    out = {}
    for key, (where, value) in values.items():
        if key not in names:
            raise ValueError(f"unknown key [{where}] {key!r}; valid keys: {', '.join(names)}")
        out[key] = _check_type(where, key, hints[key], value)
    return out


def _placed(source: dict[str, dict[str, Any]]) -> Given:
    """One source's values (a TOML file's tables, flags, a resumed run) by JobConfig
    part; [train]'s flat settings go to their sections. None: not given."""
    out: Given = {}
    for table, values in source.items():
        for key, value in values.items():
            if value is None:
                continue
            part = table
            if table == FLAT:
                if key not in SECTION_OF:
                    raise ValueError(
                        f"unknown key [{FLAT}] {key!r}; valid keys: {', '.join(SECTION_OF)}"
                    )
                part = SECTION_OF[key]
            if key in out.get(part, {}):  # in [train] and in its section's table
                raise ValueError(f"[{FLAT}] {key} and [{part}] {key}: give the setting once")
            out.setdefault(part, {})[key] = (table, value)
    return out


def load_toml(path: Path) -> dict[str, dict[str, Any]]:
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"config file {str(path)!r} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config file {str(path)!r} is not valid TOML: {exc}") from None
    for section, body in raw.items():
        if section not in TABLES:
            raise ValueError(
                f"unknown section [{section}] in {str(path)!r}; valid sections: {', '.join(TABLES)}"
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


def _model(given: dict[str, tuple[str, Any]]) -> ModelConfig:
    """The model: a preset, a Hugging Face or Megatron source, or the default, with the
    [model] keys given applied."""
    values = {key: value for key, (_, value) in given.items()}
    name = str(values.pop("preset")) if "preset" in values else None
    if name is not None and name.startswith(("hf:", "megatron:")):  # --model hf:DIR
        values.setdefault("source", name)
        name = None
    base = preset(name) if name is not None else ModelConfig()
    if values.get("source"):
        base = _hf_base(values)
    checked = _checked("model", {key: ("model", value) for key, value in values.items()})
    return dataclasses.replace(base, **checked)


def build_job(*sources: dict[str, dict[str, Any]] | None) -> JobConfig:
    """Merge the sources' values (a later source's win) and validate everything. A
    source is shaped as a TOML file: tables of keys (a value None is not given)."""
    merged: Given = {name: {} for name in PARTS}
    for source in sources:
        for part, values in _placed(source or {}).items():
            merged[part].update(values)
    parts: dict[str, Any] = {"model": _model(merged.pop("model"))}
    for part, values in merged.items():
        parts[part] = PARTS[part](**_checked(part, values))
    return JobConfig(**parts)
