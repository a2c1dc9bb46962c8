"""One setting of a job, written once: its field, default, help, command-line flag and
the checks its section runs.

A section of the job's configuration (:mod:`.sections`) declares each setting with
:func:`setting`, which stores a :class:`Setting` in the dataclass field's metadata. The
command line (:mod:`elaswave.cli.flags`) makes the flags of ``elaswave train`` and
``elaswave run`` from them, and the TOML loader (:mod:`elaswave.cli.config_file`) and
RUN_DIR/job.json take the field's name as the key; so a new setting is one field, and
nothing else needs to know of it.

The checks below (:func:`check`, :func:`check_positive_int`, :func:`choose`)
raise ValueError with the message a user sees: the setting's name, the value, and what
would be valid.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

SETTING = "elaswave.setting"
"""The metadata key under which a field keeps its :class:`Setting`."""


@dataclass(frozen=True, kw_only=True)
class Alias:
    """A second flag for the same setting, with its own help (``--nproc-per-node``)."""

    flag: str
    help: str


@dataclass(frozen=True, kw_only=True)
class Setting:
    """How a setting appears on the command line."""

    help: str
    """The flag's help text (the field's docstring says what the value means)."""
    flag: str | None = None
    """The flag; None: derived from the field's name (:func:`flag_of`)."""
    metavar: str | None = None
    """The flag's value in ``--help`` (argparse's default: the flag in capitals)."""
    aliases: tuple[Alias, ...] = ()
    """Other flags that set it."""
    set_by: str | None = None
    """What sets it instead of a flag of its own (``--resume RUN_DIR``), when it is
    derived from another argument; it then has no flag."""


def setting(
    default: Any,
    *,
    help: str,
    flag: str | None = None,
    metavar: str | None = None,
    aliases: tuple[Alias, ...] = (),
    set_by: str | None = None,
) -> Any:
    """A dataclass field with ``default`` and its :class:`Setting`."""
    spec = Setting(help=help, flag=flag, metavar=metavar, aliases=aliases, set_by=set_by)
    return dataclasses.field(default=default, metadata={SETTING: spec})


def settings_of(section: type) -> Iterator[tuple[dataclasses.Field[Any], Setting]]:
    """The fields of a section class with their settings, in declaration order."""
    for f in dataclasses.fields(section):
        yield f, f.metadata[SETTING]


def flag_of(f: dataclasses.Field[Any]) -> str | None:
    """The flag of setting ``f``: its own, or its name with dashes, without the unit of a
    duration (``comm_timeout_s``: ``--comm-timeout``), ``--no-`` before a switch that is
    on by default; None for a setting another argument sets."""
    spec: Setting = f.metadata[SETTING]
    if spec.set_by is not None:
        return None
    if spec.flag is not None:
        return spec.flag
    name = re.sub(r"_s$", "", f.name).replace("_", "-")
    return f"--no-{name}" if f.default is True else f"--{name}"


# ----------------------------------------------------------------------------- checks


def is_int(value: object) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """An int or a float that is not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def check(owner: object, name: str, ok: Callable[[Any], bool], must: str) -> None:
    """Raise ``NAME = VALUE: MUST`` unless ``ok(VALUE)``."""
    value = getattr(owner, name)
    if not ok(value):
        raise ValueError(f"{name} = {value!r}: {must}")


def check_positive_int(owner: object, *names: str) -> None:
    """Each of ``names`` is an integer of at least 1."""
    for name in names:
        check(owner, name, lambda v: is_int(v) and v >= 1, "must be a positive integer")


def choose(owner: object, name: str, vocabulary: type[enum.StrEnum], valid: str) -> None:
    """Make ``name`` a member of ``vocabulary`` (it may be given as its string); a value
    outside raises ``NAME = VALUE: VALID``."""
    value = getattr(owner, name)
    try:
        member = vocabulary(value)
    except ValueError:
        raise ValueError(f"{name} = {value!r}: {valid}") from None
    object.__setattr__(owner, name, member)


def listed(vocabulary: type[enum.StrEnum]) -> str:
    """The values of ``vocabulary``, comma-separated, in declaration order."""
    return ", ".join(member.value for member in vocabulary)
