"""The flags of a job, shared by ``elaswave train`` and ``elaswave run``.

Every training setting has a flag, made here from its field in
:mod:`elaswave.runtime.job.sections` (name, help, metavar, aliases; the type from the
field's type): one argument group per section, and :func:`job_values` reads the parsed
flags back into the sections, where the values are checked. Written by hand here are
only the flags that are not settings of the training sections: the model and data
(``--model``, ``--data``, ``--data-dtype``), and the ones about this command rather
than the job (``--config``, ``--out``, ``--overwrite``, ``--resume``, ``--node-rank``,
``--profile``).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from pathlib import Path
from typing import Any

from elaswave.runtime.job.sections import SECTIONS
from elaswave.runtime.job.setting import Setting, flag_of, settings_of

PROFILE_AUTO = "auto"
PROFILE_CHOICES = (PROFILE_AUTO, "on", "off")


def add_job_flags(p: argparse.ArgumentParser) -> None:
    """The job flags ``elaswave train`` and ``elaswave run`` share."""
    p.add_argument(
        "--config",
        type=Path,
        help="TOML file with [model], [data], [optim] and the training settings, flat in "
        f"[train] or in their sections ({', '.join(f'[{name}]' for name in SECTIONS)})",
    )
    _add_model_flags(p)
    _add_command_flags(p)
    for name, section in SECTIONS.items():
        group = p.add_argument_group(f"{name} settings", (section.__doc__ or "").strip())
        hints = typing.get_type_hints(section)
        for f, spec in settings_of(section):
            flag = flag_of(f)
            if flag is not None:
                _add_setting(group, f, spec, flag, hints[f.name])


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    """The model and data flags (their settings live with the model and the data)."""
    p.add_argument(
        "--model",
        help="model preset (tiny; llama2-* are for the simulator) or hf:DIR, a Hugging Face "
        "decoder directory (config.json, optional *.safetensors; Llama, Mistral, Qwen2/3, "
        "Gemma, Phi-3, OLMo-2, Granite, SmolLM3 and others laid out as they are)",
    )
    p.add_argument("--data", help="pre-tokenised token file (numpy memmap); default synthetic")
    p.add_argument("--data-dtype", help="token dtype of --data: uint16, int32 or int64")
    p.add_argument(
        "--eval-data",
        help="held-out token file for --eval-every (default: the heldout.bin beside "
        "--data's train.bin; synthetic data: other sequences of its chain)",
    )


def _add_command_flags(p: argparse.ArgumentParser) -> None:
    """The flags about this command rather than the job's settings."""
    p.add_argument(
        "--node-rank",
        type=int,
        default=0,
        help="this host's node rank: 0 runs the Core and the store, others run an agent",
    )
    p.add_argument(
        "--profile",
        default=PROFILE_AUTO,
        metavar="{auto,on,off}",
        help="measure every layer's forward, backward and activations before the job starts "
        "and plan with those costs instead of the FLOP formulas (written to "
        "RUN_DIR/profile.json); auto (default): on for a Hugging Face model, off for the "
        "built-in one",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start over in --out even if it holds an unfinished job with checkpoints",
    )
    p.add_argument(
        "--resume",
        type=Path,
        metavar="RUN_DIR",
        help="continue RUN_DIR's job from its latest complete checkpoint, on the "
        "dp x pp the flags give (default: the same) and the checkpoint's tp",
    )
    p.add_argument(
        "--out",
        type=Path,
        help="run directory (default runs/train; with --resume, the resumed run directory)",
    )


def _add_setting(
    group: argparse._ArgumentGroup,
    f: dataclasses.Field[Any],
    spec: Setting,
    flag: str,
    hint: Any,
) -> None:
    """The flag of setting ``f`` (of type ``hint``), and its aliases. Its value stays
    None unless given, so that a config file's or a resumed run's value stands."""
    kwargs: dict[str, Any] = {"dest": f.name, "help": spec.help, "default": None}
    if hint is bool:  # a switch: --verify-snapshots, or --no-snapshots when on by default
        kwargs["action"] = "store_false" if f.default else "store_true"
    elif hint == bool | None:  # --straggler-detection / --no-straggler-detection
        kwargs["action"] = argparse.BooleanOptionalAction
    elif typing.get_origin(hint) is tuple:  # repeatable: --fault SPEC --fault SPEC
        kwargs["action"] = "append"
    else:
        kwargs["type"] = _scalar_type(hint)
    if "action" not in kwargs or kwargs["action"] == "append":  # the flag takes a value
        kwargs["metavar"] = spec.metavar or flag.removeprefix("--").replace("-", "_").upper()
    group.add_argument(flag, **kwargs)
    for alias in spec.aliases:
        group.add_argument(alias.flag, **{**kwargs, "help": alias.help})


def _scalar_type(hint: Any) -> type | None:
    """What argparse converts a flag's value to: int or float; None keeps the string
    (strings, paths, and the choices, which their section checks)."""
    for kind in (int, float):
        if hint is kind or hint == kind | None:
            return kind
    return None


def job_values(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The job's settings given as flags, by section (None: not given)."""
    values: dict[str, dict[str, Any]] = {
        "model": {"preset": args.model},
        "data": {"path": args.data, "dtype": args.data_dtype, "heldout": args.eval_data},
    }
    for name, section in SECTIONS.items():
        values[name] = {
            f.name: getattr(args, f.name) for f, _ in settings_of(section) if flag_of(f)
        }
    return values
