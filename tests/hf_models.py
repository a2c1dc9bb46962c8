"""Hugging Face models the tests write to disk."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers


def saved_with_router_bias(config: Any, directory: Path, *, seed: int) -> Any:
    """``config``'s model, seeded, its routers' bias buffers (DeepSeek's
    ``e_score_correction_bias``) set to random values, saved with its weights to
    ``directory`` as save_pretrained writes them; returns the model."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer))
    model.save_pretrained(directory, safe_serialization=True)
    return model
