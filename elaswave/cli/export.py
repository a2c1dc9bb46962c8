"""``elaswave export RUN_DIR OUT_DIR``: a finished run as its framework's own model files.

A Hugging Face run (``--model hf:DIR``): a directory that transformers'
``from_pretrained`` loads. OUT_DIR gets the model's ``config.json`` (the one the run
trained, as transformers writes it), its trained parameters as ``model.safetensors``
under the names the model's checkpoints have (a tied weight once; a mixture of experts'
experts one tensor each, as ``save_pretrained`` writes them), with the persistent
buffers the model directory's files hold (a router's bias: they do not train), and the
tokenizer files of the model's directory when it has them.

A megatron-core run (``--model megatron:FILE``): a Megatron checkpoint in the ``torch``
format (``--ckpt-format torch``): ``OUT_DIR/latest_checkpointed_iteration.txt`` and
``OUT_DIR/iter_NNNNNNN/mp_rank_00/model_optim_rng.pt``, whose ``model`` is the state
dict of megatron's ``GPTModel`` (the local layer spec, tensor parallelism 1) under its
own names (``load_state_dict`` strict), with ``iteration`` the steps trained; and the
model file, ``gpt.json``.

Nothing is written unless the run's parameters are all there; OUT_DIR must not exist
yet or be empty.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

from elaswave import rundir

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
"""Files of a model directory that describe its tokenizer, copied along."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="write a finished run as a Hugging Face model directory or a megatron checkpoint",
        description="Write RUN_DIR's trained parameters into OUT_DIR: for --model hf:DIR "
        "runs config.json, model.safetensors and the model directory's tokenizer files, "
        "for transformers' AutoModelForCausalLM.from_pretrained(OUT_DIR); for --model "
        "megatron:FILE runs a Megatron checkpoint (torch format: "
        "iter_NNNNNNN/mp_rank_00/model_optim_rng.pt, latest_checkpointed_iteration.txt) "
        "of megatron-core's GPTModel, and the model file.",
    )
    p.add_argument("run_dir", type=Path)
    p.add_argument("out_dir", type=Path)


def run(args: argparse.Namespace) -> int:
    out = export(args.run_dir, args.out_dir)
    print(f"elaswave: exported {args.run_dir} to {out}")
    return 0


def export(run_dir: Path, out_dir: Path) -> Path:
    """Write ``run_dir``'s model into ``out_dir``; ValueError naming what is wrong."""
    from safetensors.torch import save_file

    from elaswave.model.hf import (
        TIED_PARAMS,
        load_hf_config,
        skeleton,
        source_buffers,
        to_hf_state_dict,
    )
    from elaswave.model.hf_checkpoint import to_hub_layout
    from elaswave.runtime.core.compare import load_params
    from elaswave.runtime.job.config import JobSpec

    if not (run_dir / rundir.JOB).is_file():
        raise ValueError(f"{str(run_dir)!r} is not a run directory (no {rundir.JOB})")
    model = JobSpec.read(run_dir).config.model
    if not model.source.startswith(("hf:", "megatron:")):
        raise ValueError(
            f"{str(run_dir)!r} trained {model.source or 'the built-in model'!r}; export "
            "writes Hugging Face models and megatron-core checkpoints: train with --model "
            "hf:DIR or megatron:FILE"
        )
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(f"{str(out_dir)!r} exists and is not an empty directory")
    blocking = next((p for p in out_dir.parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise ValueError(f"{str(out_dir)!r} cannot be made: {str(blocking)!r} is not a directory")
    try:
        params = load_params(run_dir)
    except FileNotFoundError:
        raise ValueError(f"{str(run_dir)!r} has no trained parameters (did it finish?)") from None
    missing = sorted(set(range(model.num_layers)) - set(params))
    if missing:
        raise ValueError(f"{str(run_dir)!r} lacks the parameters of layers {missing}")
    if model.source.startswith("megatron:"):
        return _megatron(run_dir, out_dir, model.source, params)
    try:
        state = to_hf_state_dict(params, model.num_layers)
    except KeyError as exc:  # a parameter name the model does not have
        raise ValueError(f"{str(run_dir)!r}: {exc.args[0]}") from None
    if model.tie_embeddings:  # one tensor, as transformers saves a tied weight
        state.pop(f"{TIED_PARAMS[1]}")
    source = Path(model.source[3:])
    config = load_hf_config(source)
    hf = skeleton(config, str(source / "config.json"))
    _check_shapes(run_dir, state, hf)
    state = to_hub_layout({**source_buffers(source, hf), **state}, config.model_type)
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out_dir)
    tensors = {name: t.detach().contiguous() for name, t in state.items()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, out_dir / name)
    return out_dir


def _check_shapes(run_dir: Path, state: dict, model: Any) -> None:
    """Refuse parameters whose shapes are not those of ``model`` (on the meta device)."""
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    for name, tensor in state.items():
        if name in shapes and tuple(tensor.shape) != shapes[name]:
            raise ValueError(
                f"{str(run_dir)!r}: parameter {name} has shape {tuple(tensor.shape)}, the "
                f"model's is {shapes[name]}"
            )


MEGATRON_CHECKPOINT_VERSION = 3.0
"""The ``checkpoint_version`` Megatron writes in a torch-format checkpoint (the current
one, whose attention weights are in the layout megatron-core's modules hold)."""


PARALLEL_LINEARS = ("linear_", "output_layer")
"""Modules of megatron's GPTModel that are its Column/RowParallelLinear: their state dict
holds an ``_extra_state`` (None on the local layer spec), which a strict load expects."""


def _megatron(run_dir: Path, out_dir: Path, source: str, params: dict) -> Path:
    """A Megatron torch-format checkpoint of ``params`` (megatron's GPTModel names) at the
    run's last step, and the model file beside it."""
    import torch

    from elaswave.model.megatron import to_gpt_state_dict
    from elaswave.runtime.job.results import read_summary

    iteration = read_summary(run_dir).steps_completed
    state: dict[str, torch.Tensor | None] = {
        k: t.detach().contiguous() for k, t in to_gpt_state_dict(params, len(params)).items()
    }
    for key in list(state):  # megatron's parallel linears keep an (empty) extra state
        module, _, leaf = key.rpartition(".")
        if leaf == "weight" and module.rpartition(".")[2].startswith(PARALLEL_LINEARS):
            state[f"{module}._extra_state"] = None
    where = out_dir / f"iter_{iteration:07d}" / "mp_rank_00"
    where.mkdir(parents=True)
    torch.save(
        {"model": state, "iteration": iteration, "checkpoint_version": MEGATRON_CHECKPOINT_VERSION},
        where / "model_optim_rng.pt",
    )
    (out_dir / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")
    model_file = Path(source.removeprefix("megatron:"))
    if model_file.is_file():
        shutil.copy2(model_file, out_dir / "gpt.json")
    return out_dir
