"""Frozen dataclasses as JSON data and back, read off their type hints (pure).

One codec for every value the Core persists (:func:`elaswave.engine.change.
state_to_json`), so that no field is listed by hand: a new field of a state type is
persisted by being declared. What it writes, by declared type:

- ``int``, ``float``, ``str``, ``bool``, ``None``: themselves; a ``StrEnum``: its value;
- ``tuple[T, ...]`` and ``tuple[A, B]``: a list; ``frozenset[T]``: a sorted list;
- ``Mapping[str, V]``: an object; ``Mapping[int, V]``: an object keyed by the ints'
  decimal strings; a map with other keys (tuples): a list of ``[key, value]`` pairs;
- ``T | None``: null or the ``T``;
- a dataclass: an object of its fields (``ClassVar`` s aside); one of several dataclasses
  (``A | B``): that object with the class's tag first (``{"type": TAG, ...}``, ``TAG``
  the class's ``TAG`` attribute, else its name);
- a type in ``forms``: whatever its own pair of functions writes (a plan, a record).

Reading back checks what it reads against the same hints: a value of the wrong type, a
missing or unknown field raise :class:`ValueError` naming where.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Callable, Mapping
from functools import cache
from typing import Any

Forms = Mapping[type, tuple[Callable[[Any], Any], Callable[[Any], Any]]]
"""Types with a JSON form of their own: type -> (write, read)."""

TAG_KEY = "type"
"""The key naming which dataclass of a union an object is."""


def to_json(value: Any, tp: Any, forms: Forms | None = None) -> Any:
    """``value``, declared of type ``tp``, as JSON data."""
    return _Codec(forms or {}).write(value, tp, "$")


def from_json(data: Any, tp: Any, forms: Forms | None = None) -> Any:
    """The value of type ``tp`` that :func:`to_json` wrote as ``data``."""
    return _Codec(forms or {}).read(data, tp, "$")


@cache
def _hints(cls: type) -> dict[str, Any]:
    """The init fields of dataclass ``cls`` and their resolved types, in order."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _tag(cls: type) -> str:
    return str(getattr(cls, "TAG", cls.__name__))


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


class _Codec:
    def __init__(self, forms: Forms) -> None:
        self.forms = forms

    # ------------------------------------------------------------------ write

    def write(self, value: Any, tp: Any, at: str) -> Any:
        if tp in self.forms:
            return self.forms[tp][0](value)
        if _is_union(tp):
            return self._write_union(value, tp, at)
        origin = typing.get_origin(tp)
        if origin is tuple:
            args = typing.get_args(tp)
            each = [args[0]] * len(value) if args[-1] is Ellipsis else list(args)
            pairs = enumerate(zip(value, each, strict=True))
            return [self.write(v, t, f"{at}[{i}]") for i, (v, t) in pairs]
        if origin is frozenset:
            (arg,) = typing.get_args(tp)
            return [self.write(v, arg, f"{at}[]") for v in sorted(value)]
        if origin is Mapping:
            return self._write_map(value, tp, at)
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            return {
                name: self.write(getattr(value, name), hint, f"{at}.{name}")
                for name, hint in _hints(tp).items()
            }
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            return value.value
        if tp in (int, float, str, bool, type(None)):
            return value
        raise TypeError(f"{at}: no JSON form for type {tp!r}")

    def _write_union(self, value: Any, tp: Any, at: str) -> Any:
        args = typing.get_args(tp)
        if value is None:
            return None
        kinds = [a for a in args if a is not type(None)]
        if len(kinds) == 1:
            return self.write(value, kinds[0], at)
        cls = type(value)
        if cls not in kinds or not dataclasses.is_dataclass(cls):
            raise TypeError(f"{at}: {cls.__name__} is not one of the union's dataclasses")
        return {TAG_KEY: _tag(cls), **self.write(value, cls, at)}

    def _write_map(self, value: Mapping[Any, Any], tp: Any, at: str) -> Any:
        key_type, value_type = typing.get_args(tp)
        if key_type in (int, str):
            return {str(k): self.write(v, value_type, f"{at}[{k!r}]") for k, v in value.items()}
        return [
            [self.write(k, key_type, f"{at}<key>"), self.write(v, value_type, f"{at}[{k!r}]")]
            for k, v in value.items()
        ]

    # ------------------------------------------------------------------ read

    def read(self, data: Any, tp: Any, at: str) -> Any:
        if tp in self.forms:
            return self.forms[tp][1](data)
        if _is_union(tp):
            return self._read_union(data, tp, at)
        origin = typing.get_origin(tp)
        if origin is tuple:
            args = typing.get_args(tp)
            items = _expect(data, list, at)
            each = [args[0]] * len(items) if args[-1] is Ellipsis else list(args)
            if len(each) != len(items):
                raise ValueError(f"{at}: {len(items)} items, expected {len(each)}")
            pairs = enumerate(zip(items, each, strict=True))
            return tuple(self.read(v, t, f"{at}[{i}]") for i, (v, t) in pairs)
        if origin is frozenset:
            (arg,) = typing.get_args(tp)
            return frozenset(self.read(v, arg, f"{at}[]") for v in _expect(data, list, at))
        if origin is Mapping:
            return self._read_map(data, tp, at)
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            return self._read_dataclass(data, tp, at)
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            try:
                return tp(data)
            except ValueError:
                raise ValueError(f"{at}: {data!r} is not a {tp.__name__}") from None
        return _scalar(data, tp, at)

    def _read_union(self, data: Any, tp: Any, at: str) -> Any:
        args = typing.get_args(tp)
        if data is None and type(None) in args:
            return None
        kinds = [a for a in args if a is not type(None)]
        if len(kinds) == 1:
            return self.read(data, kinds[0], at)
        doc = dict(_expect(data, dict, at))
        tag = doc.pop(TAG_KEY, None)
        for cls in kinds:
            if _tag(cls) == tag:
                return self._read_dataclass(doc, cls, at)
        raise ValueError(f"{at}: {TAG_KEY} {tag!r} is none of {[_tag(c) for c in kinds]}")

    def _read_map(self, data: Any, tp: Any, at: str) -> dict[Any, Any]:
        key_type, value_type = typing.get_args(tp)
        if key_type in (int, str):
            out = {}
            for k, v in _expect(data, dict, at).items():
                key = _int_key(k, at) if key_type is int else k
                out[key] = self.read(v, value_type, f"{at}[{k!r}]")
            return out
        pairs = _expect(data, list, at)
        return {
            self.read(k, key_type, f"{at}<key>"): self.read(v, value_type, f"{at}[{k!r}]")
            for k, v in (_pair(p, at) for p in pairs)
        }

    def _read_dataclass(self, data: Any, cls: type, at: str) -> Any:
        doc = _expect(data, dict, at)
        hints = _hints(cls)
        if unknown := sorted(set(doc) - set(hints)):
            raise ValueError(f"{at}: unknown fields {unknown} of {cls.__name__}")
        if missing := sorted(set(hints) - set(doc)):
            raise ValueError(f"{at}: missing fields {missing} of {cls.__name__}")
        return cls(
            **{name: self.read(doc[name], hint, f"{at}.{name}") for name, hint in hints.items()}
        )


def _expect(data: Any, kind: type, at: str) -> Any:
    if not isinstance(data, kind):
        raise ValueError(f"{at}: expected a {kind.__name__}, found {data!r}")
    return data


def _pair(item: Any, at: str) -> tuple[Any, Any]:
    if not isinstance(item, list) or len(item) != 2:
        raise ValueError(f"{at}: expected a [key, value] pair, found {item!r}")
    return item[0], item[1]


def _int_key(key: str, at: str) -> int:
    try:
        return int(key)
    except ValueError:
        raise ValueError(f"{at}: key {key!r} is not an int") from None


def _scalar(data: Any, tp: Any, at: str) -> Any:
    if tp is type(None):
        ok = data is None
    elif tp is bool:
        ok = isinstance(data, bool)
    elif tp is int:
        ok = isinstance(data, int) and not isinstance(data, bool)
    elif tp is float:
        ok = isinstance(data, int | float) and not isinstance(data, bool)
    elif tp is str:
        ok = isinstance(data, str)
    else:
        raise TypeError(f"{at}: no JSON form for type {tp!r}")
    if not ok:
        raise ValueError(f"{at}: expected {getattr(tp, '__name__', tp)}, found {data!r}")
    return data
