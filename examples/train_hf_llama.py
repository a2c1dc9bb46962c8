"""Train a Hugging Face Llama with your own script and dataset, elastically.

    .venv/bin/elaswave run --dp 2 --pp 2 --steps 20 --out runs/hf examples/train_hf_llama.py
    # the same, with a worker killed in its backward pass at step 5 (recovered in-process):
    .venv/bin/elaswave run --dp 2 --pp 2 --steps 20 --out runs/hf-kill \\
        --fault kill:1@5:backward examples/train_hf_llama.py

Every worker process runs this script. The model is the tiny Llama of
examples/models/tiny-llama (config.json only, so its weights are initialised per layer
from the job's seed; put safetensors files beside it to start from trained weights). The
dataset is any sequence of token windows of seq_len + 1 ids addressed by index; here a
small synthetic corpus of counting patterns, the same in every process.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from counting import CountingCorpus

import elaswave

MODEL = Path(__file__).resolve().parent / "models" / "tiny-llama"


def main(model: str = f"hf:{MODEL}") -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=4096, help="dataset size")
    args = parser.parse_args()
    job = elaswave.job(
        model=model,
        dataset=CountingCorpus(args.samples, seq_len=32, vocab=128),
    )

    def log_step(out) -> None:  # every rank runs it; the last stage has the loss
        if out.loss is not None and job.replica == 0:
            note = " (after a recovery)" if out.recovered else ""
            print(f"rank {job.rank}: step {out.step} loss {out.loss:.4f}{note}", flush=True)

    job.on_step_end(log_step)
    job.subscribe(
        lambda ev: print(f"rank {job.rank}: {type(ev).__name__} {ev.ranks}", flush=True),
        kinds=[elaswave.EventKind.FAILURE_DETECTED],
    )
    while not job.done:
        job.train_step()


if __name__ == "__main__":
    main()
