"""The weights of a LoRA adapter in PEFT's format (checked first by pydaemon/config/lora.py)."""

from __future__ import annotations

import torch
from safetensors import safe_open

from pydaemon.config.lora import LORA_KEY, WEIGHTS_FILE, LoRAAdapterConfig, LoRAAdapterError


def load_lora_weights(
    config: LoRAAdapterConfig, dtype: torch.dtype
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """-> (layer index, module name) -> (lora_A [r, in], lora_B [out, r] times the module's
    scaling), on the CPU in ``dtype`` (the scaling applied in float32 first)."""
    pairs: dict[tuple[int, str], list] = {}
    with safe_open(str(config.path / WEIGHTS_FILE), framework="pt") as f:
        for key in f.keys():
            match = LORA_KEY.match(key)
            if match is None:
                raise LoRAAdapterError(f"LoRA adapter {str(config.path)!r}: unexpected {key!r}")
            pair = pairs.setdefault((int(match[1]), match[2]), [None, None])
            pair[0 if match[3] == "A" else 1] = f.get_tensor(key)
    weights = {}
    for key, (lora_a, lora_b) in pairs.items():
        scaling = config.scaling(lora_a.shape[0])
        weights[key] = (lora_a.to(dtype), (lora_b.float() * scaling).to(dtype))
    return weights
