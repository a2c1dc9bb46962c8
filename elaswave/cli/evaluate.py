"""``elaswave evaluate RUN_DIR --data FILE``: a finished run's loss on held-out tokens.

The run's final parameters (saved whole, whatever its layout) in one process, on the
file's consecutive windows of ``seq_len + 1`` tokens (``elaswave tokenize`` writes
``heldout.bin``), without dropout: the mean cross-entropy per token, in nats. The same
parameters give the same loss on any machine, whatever layout trained them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elaswave import rundir


@dataclass(frozen=True)
class Evaluation:
    loss: float
    """Mean cross-entropy per token (nats)."""
    samples: int
    tokens: int


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "evaluate",
        help="a finished run's loss on held-out tokens",
        description="Run RUN_DIR's final parameters (one process, no dropout) over the "
        "windows of seq_len + 1 tokens of --data (a token file such as elaswave tokenize's "
        "heldout.bin) and print the mean cross-entropy per token.",
    )
    p.add_argument("run_dir", type=Path)
    p.add_argument("--data", type=Path, required=True, help="token file (numpy memmap)")
    p.add_argument("--data-dtype", default="uint16", help="its token dtype (default uint16)")
    p.add_argument("--max-samples", type=int, default=256, help="windows to evaluate at most")
    p.add_argument("--batch", type=int, default=8, help="windows per forward pass")


def run(args: argparse.Namespace) -> int:
    result = evaluate(
        args.run_dir, args.data, dtype=args.data_dtype, max_samples=args.max_samples,
        batch=args.batch,
    )  # fmt: skip
    print(
        f"elaswave: held-out loss {result.loss:.4f} nats/token over {result.samples} samples "
        f"({result.tokens} tokens)"
    )
    return 0


def evaluate(
    run_dir: Path, data: Path, *, dtype: str = "uint16", max_samples: int = 256, batch: int = 8
) -> Evaluation:
    """The run's mean held-out loss; ValueError naming a bad input."""
    import torch

    from elaswave.data.corpus import TokenFile

    if max_samples < 1 or batch < 1:
        raise ValueError(f"--max-samples {max_samples}, --batch {batch}: must be at least 1")
    model, layers = trained_layers(run_dir)
    cfg = model.config
    source = TokenFile(data, dtype=dtype, seq_len=cfg.seq_len, vocab_size=cfg.vocab_size)
    count = min(len(source), max_samples)
    total = 0.0
    with torch.no_grad():
        for start in range(0, count, batch):
            ids = list(range(start, min(count, start + batch)))
            windows = torch.stack([torch.from_numpy(source.window(i)) for i in ids])
            x = forward(layers, windows[:, :-1], ids)
            total += float(model.per_sample_loss(x, windows[:, 1:]).double().sum())
    return Evaluation(loss=total / count, samples=count, tokens=count * cfg.seq_len)


def trained_layers(run_dir: Path) -> tuple[Any, list[Any]]:
    """The run's model and its layers holding the run's final parameters, for
    inference; ValueError naming a bad input."""
    from elaswave.model.protocol import pipeline_model
    from elaswave.runtime.core.compare import load_params
    from elaswave.runtime.job.config import JobSpec

    if not (run_dir / rundir.JOB).is_file():
        raise ValueError(f"{str(run_dir)!r} is not a run directory (no {rundir.JOB})")
    cfg = JobSpec.read(run_dir).config.model
    try:
        params = load_params(run_dir)
    except FileNotFoundError:
        raise ValueError(f"{str(run_dir)!r} has no trained parameters (did it finish?)") from None
    missing = sorted(set(range(cfg.num_layers)) - set(params))
    if missing:
        raise ValueError(f"{str(run_dir)!r} lacks the parameters of layers {missing}")
    model = pipeline_model(cfg)
    layers = []
    for index in range(cfg.num_layers):
        layer = model.build_layer(index, seed=0)
        try:
            layer.load_state_dict(params[index])
        except RuntimeError as exc:  # names or shapes not the model's
            first = str(exc).splitlines()[-1].strip()
            raise ValueError(
                f"{str(run_dir)!r}: the parameters of layer {index} do not fit its model ({first})"
            ) from None
        layers.append(layer.eval())
    return model, layers


def forward(layers: list[Any], tokens: Any, ids: list[int]) -> Any:
    """``layers`` (:func:`trained_layers`) on a batch of token ids (samples ``ids``),
    without dropout or gradients: the last layer's output (the logits)."""
    import torch

    from elaswave.model.llama import StepContext
    from elaswave.model.rng import make_rng

    ctx = StepContext(
        step=0, sample_ids=tuple(ids), rng=make_rng("counter", seed=0, rank=0), training=False
    )
    x = tokens
    with torch.no_grad():
        for layer in layers:
            x = layer(x, ctx)
    return x
