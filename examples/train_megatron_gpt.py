"""Train megatron-core's GPT pieces with your own script and dataset, elastically.

    .venv/bin/elaswave run --dp 2 --pp 2 --steps 20 --out runs/megatron \\
        examples/train_megatron_gpt.py
    # the same, with a worker killed in its backward pass at step 5 (recovered in-process):
    .venv/bin/elaswave run --dp 2 --pp 2 --steps 20 --out runs/megatron-kill \\
        --fault kill:1@5:backward examples/train_megatron_gpt.py

Every worker process runs this script. The model is a tiny megatron-core GPT
(Llama-style: RMSNorm, SwiGLU, rotary) whose shape is examples/models/tiny-megatron-gpt.json,
its layers built from megatron's local layer spec (elaswave/model/megatron.py). The
dataset is a small synthetic corpus of counting patterns, the same in every process.
"""

from __future__ import annotations

from pathlib import Path

from train_hf_llama import main  # the same script and dataset; only the model differs

MODEL = Path(__file__).resolve().parent / "models" / "tiny-megatron-gpt.json"

if __name__ == "__main__":
    main(model=f"megatron:{MODEL}")
