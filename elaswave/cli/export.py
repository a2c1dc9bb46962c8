"""``elaswave export RUN_DIR OUT_DIR``: a finished Hugging Face run as a directory that
transformers' ``from_pretrained`` loads.

OUT_DIR gets the model's ``config.json`` (the one the run trained, as transformers
writes it), its trained parameters as ``model.safetensors`` under the model's own names
(a tied weight once, as transformers saves it), and the tokenizer files of the model's
directory when it has them. Nothing is written unless the run's parameters are all
there; OUT_DIR must not exist yet or be empty.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

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
        help="write a finished Hugging Face run as a model directory from_pretrained loads",
        description="Write RUN_DIR's trained parameters and its model's config.json into "
        "OUT_DIR (config.json, model.safetensors, the model directory's tokenizer files), "
        "for transformers' AutoModelForCausalLM.from_pretrained(OUT_DIR). Runs of "
        "--model hf:DIR only.",
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

    from elaswave.model.hf import TIED_PARAMS, load_hf_config, to_hf_state_dict
    from elaswave.runtime.core.compare import load_params
    from elaswave.runtime.job.config import JobSpec

    if not (run_dir / rundir.JOB).is_file():
        raise ValueError(f"{str(run_dir)!r} is not a run directory (no {rundir.JOB})")
    model = JobSpec.read(run_dir).config.model
    if not model.source.startswith("hf:"):
        raise ValueError(
            f"{str(run_dir)!r} trained {model.source or 'the built-in model'!r}; export "
            "writes Hugging Face models: train with --model hf:DIR"
        )
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(f"{str(out_dir)!r} exists and is not an empty directory")
    try:
        params = load_params(run_dir)
    except FileNotFoundError:
        raise ValueError(f"{str(run_dir)!r} has no trained parameters (did it finish?)") from None
    missing = sorted(set(range(model.num_layers)) - set(params))
    if missing:
        raise ValueError(f"{str(run_dir)!r} lacks the parameters of layers {missing}")
    state = to_hf_state_dict(params, model.num_layers)
    if model.tie_embeddings:  # one tensor, as transformers saves a tied weight
        state.pop(f"{TIED_PARAMS[1]}")
    source = Path(model.source[3:])
    config = load_hf_config(source)
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out_dir)
    tensors = {name: t.detach().contiguous() for name, t in state.items()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, out_dir / name)
    return out_dir
