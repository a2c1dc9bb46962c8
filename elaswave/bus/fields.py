"""Checks for the fields of bus events, as :mod:`elaswave.bus.schema` decodes them.

msgpack only produces exact builtin types, so exact type tests are both strict (``True``
is not an int) and fast. A checker returns the value or raises TypeError.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any, NamedTuple


def is_int(value: object) -> bool:
    return type(value) is int


def _exact(tp: type) -> Callable[[object], object]:
    def check(value: object) -> object:
        if type(value) is not tp:
            raise TypeError
        return value

    return check


def _float(value: object) -> float:
    if type(value) is float:
        return value
    if type(value) is int:
        return float(value)
    raise TypeError


_SCALAR_CHECKERS: dict[Any, Callable[[object], object]] = {
    int: _exact(int),
    float: _float,
    bool: _exact(bool),
    str: _exact(str),
}


def checker(tp: Any) -> Callable[[object], object]:
    """Build the checker for one field annotation (scalars and ``list`` of scalars)."""
    if tp in _SCALAR_CHECKERS:
        return _SCALAR_CHECKERS[tp]
    if typing.get_origin(tp) is list:
        (item_type,) = typing.get_args(tp)
        check_item = _SCALAR_CHECKERS[item_type]

        def check_list(value: object) -> object:
            if type(value) is not list:
                raise TypeError
            return [check_item(item) for item in value]

        return check_list
    raise TypeError(f"event fields must be int, float, bool, str or list of those, not {tp}")


def type_name(tp: Any) -> str:
    return tp.__name__ if typing.get_origin(tp) is None else str(tp)


class FieldSpec(NamedTuple):
    """How to decode one field of an event class."""

    name: str
    check: Callable[[object], object]
    type_name: str
    required: bool


def short(value: object, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters (for error messages)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
