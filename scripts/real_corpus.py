"""A real corpus end to end: the Python standard library's own source files tokenised by
a byte-level BPE trained on them, a Llama of about 10M parameters (tied embeddings, as
Llama-3.2 ships) trained with clipping and a cosine schedule on dp2 x pp2 through two
kills and a join, against the same run without faults; the held-out loss of both
against the unigram baseline; the trained model exported and loaded by transformers.

    .venv/bin/python scripts/real_corpus.py [--steps 300] [--out runs/corpus]
        [--grad-reduce-dtype float64|float32]

Writes docs/real_corpus.{md,json} (docs/real_corpus_float32.{md,json} for float32 sums).
Real CPU processes (gloo); the figures compared are
losses, parameters and held-out losses, not timings.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import torch
import transformers

from elaswave.cli.evaluate import evaluate, forward, trained_layers
from elaswave.cli.tokenize import tokenize
from elaswave.runtime.core.compare import compare_runs
from elaswave.runtime.job.results import read_summary

ROOT = Path(__file__).resolve().parents[1]
MODEL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=12,
             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
             tie_word_embeddings=True, rms_norm_eps=1e-5)  # fmt: skip
SEQ = 64
"""Tokens a sample holds."""
RECIPE = """[model]
seq_len = 64

[optim]
lr = 3e-3
warmup_steps = 20
lr_schedule = "cosine"
min_lr = 3e-4
max_grad_norm = 1.0
grad_reduce_dtype = "{sums}"
"""


def _train(out: Path, *args: str) -> None:
    cmd = [sys.executable, "-m", "elaswave.cli.main", "train", "--out", str(out), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")


def export_logits_gap(run_dir: Path, exported: Path, held: Path, dtype: str) -> float:
    """The largest difference between the logits of ElasWave's own layers with the run's
    parameters and transformers' model loaded from the export, on the first 4 held-out
    windows of 64 tokens."""
    ids = np.fromfile(held, dtype=dtype)[: 4 * SEQ].astype(np.int64)
    tokens = torch.from_numpy(ids).view(4, SEQ)
    _, layers = trained_layers(run_dir)
    ours = forward(layers, tokens, list(range(4)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported, local_files_only=True)
    with torch.no_grad():
        return float((ours - hf(tokens).logits).abs().max())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "corpus")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs")
    parser.add_argument(
        "--grad-reduce-dtype", choices=("float32", "float64"), default="float64",
        help="[optim] grad_reduce_dtype of both runs (float64: sums in any order, same bits)",
    )  # fmt: skip
    args = parser.parse_args()
    out = args.out
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    tokens = tokenize(
        stdlib,
        out / "tokens",
        glob="**/*.py",
        exclude=("site-packages/*",),
        vocab=4096,
        held_out=0.02,
    )  # the standard library's own files, not what was installed beside it
    print(f"tokenised: {tokens}", file=sys.stderr, flush=True)
    model_dir = out / "model"
    transformers.LlamaConfig(
        vocab_size=tokens.vocab_size, pad_token_id=None, bos_token_id=0, eos_token_id=0, **MODEL
    ).save_pretrained(model_dir)
    config = out / "recipe.toml"
    config.write_text(RECIPE.format(sums=args.grad_reduce_dtype))
    job = ("--config", str(config), "--model", f"hf:{model_dir}", "--data",
           str(out / "tokens" / "train.bin"), "--data-dtype", tokens.dtype, "--dp", "2",
           "--pp", "2", "--steps", str(args.steps), "--global-batch", "16",
           "--micro-batch", "2")  # fmt: skip
    kill1, join, kill2 = args.steps // 3, args.steps // 2, 2 * args.steps // 3
    faults = (f"kill:1@{kill1}:backward", f"join@{join}", f"kill:2@{kill2}:forward")
    _train(out / "twin", *job)
    print("twin done", file=sys.stderr, flush=True)
    _train(out / "faulted", *job, *(x for f in faults for x in ("--fault", f)))
    print("faulted done", file=sys.stderr, flush=True)
    diff = compare_runs(out / "faulted", out / "twin")
    summary = read_summary(out / "faulted")
    held = out / "tokens" / "heldout.bin"
    losses = {
        name: evaluate(out / name, held, dtype=tokens.dtype, max_samples=512).loss
        for name in ("twin", "faulted")
    }
    export = subprocess.run(
        [sys.executable, "-m", "elaswave.cli.main", "export", str(out / "faulted"),
         str(out / "exported")], capture_output=True, text=True, check=False,
    )  # fmt: skip
    gap = (
        export_logits_gap(out / "faulted", out / "exported", held, tokens.dtype)
        if export.returncode == 0
        else None
    )
    row = {
        "documents": tokens.documents,
        "train_tokens": tokens.train_tokens,
        "heldout_tokens": tokens.heldout_tokens,
        "parameters": sum(
            p.numel()
            for p in transformers.AutoModelForCausalLM.from_pretrained(
                out / "exported"
            ).parameters()
        )
        if export.returncode == 0
        else None,
        "steps": args.steps,
        "faults": list(faults),
        "recoveries": [(str(r.kind), list(r.ranks)) for r in summary.recoveries],
        "loss_rel_diff": diff.loss_rel,
        "param_rel_diff": diff.param_rel,
        "first_loss": summary.loss[0],
        "final_loss": summary.loss[-1],
        "heldout_loss_twin": losses["twin"],
        "heldout_loss_faulted": losses["faulted"],
        "unigram_heldout_loss": tokens.unigram_heldout_loss,
        "export": export.returncode == 0,
        "export_logits_max_abs_diff": gap,
        "grad_reduce_dtype": args.grad_reduce_dtype,
    }
    text = "\n".join(
        [
            "# A real corpus: the Python standard library, end to end",
            "",
            "    .venv/bin/python scripts/real_corpus.py --grad-reduce-dtype "
            f"{args.grad_reduce_dtype}",
            "",
            f"{tokens.documents} files (`**/*.py` of the standard library, site-packages "
            f"left out), byte-level BPE of "
            f"{tokens.vocab_size} tokens trained on them: {tokens.train_tokens} training and "
            f"{tokens.heldout_tokens} held-out tokens. A tied-embedding Llama of "
            f"{row['parameters']} parameters, 64-token samples, global batch 16, "
            f"{args.steps} steps on dp2 x pp2, clipped to 1.0, cosine from 3e-3 to 3e-4, "
            f"gradients summed in {args.grad_reduce_dtype}; "
            f"faults {', '.join(faults)} (CPU, gloo, real processes).",
            "",
            "| figure | value |",
            "|---|---|",
            f"| recoveries | {row['recoveries']} |",
            f"| losses vs the fault-free twin (max rel) | {diff.loss_rel:.2e} |",
            f"| parameters vs the twin (rel) | {diff.param_rel:.2e} |",
            f"| training loss, first / last step | {row['first_loss']:.3f} / "
            f"{row['final_loss']:.3f} |",
            f"| held-out loss, faulted run / twin (nats/token) | {losses['faulted']:.4f} / "
            f"{losses['twin']:.4f} |",
            f"| held-out loss of the unigram model | {tokens.unigram_heldout_loss:.4f} |",
            f"| exported, loaded by transformers | {row['export']} |",
            "| its logits on 4 held-out windows vs ElasWave's (max abs) | "
            + (f"{gap:.2e} |" if gap is not None else "- |"),
        ]
    )
    print(text)
    args.docs.mkdir(exist_ok=True)
    name = "real_corpus" + ("" if args.grad_reduce_dtype == "float64" else "_float32")
    (args.docs / f"{name}.md").write_text(text + "\n")
    (args.docs / f"{name}.json").write_text(json.dumps(row, indent=2) + "\n")
    ok = diff.loss_rel <= 1e-4 and diff.param_rel <= 1e-4 and gap is not None and gap <= 1e-5
    return 0 if ok and losses["faulted"] < tokens.unigram_heldout_loss else 1


if __name__ == "__main__":
    sys.exit(main())
