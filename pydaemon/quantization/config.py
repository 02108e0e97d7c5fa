"""Which quantization a model runs with: what its checkpoint says (config.json's
``quantization_config``) and what the engine asks for (``EngineConfig.quantization``).

Checkpoint formats read (FP8 e4m3 weights only):

- Hugging Face / DeepSeek ``quant_method: "fp8"``: with ``weight_block_size`` [bn, bk] each
  linear ``W`` comes with ``W_scale_inv`` [ceil(N / bn), ceil(K / bk)] (w = wq * scale of
  its block); without it, with ``weight_scale`` (per tensor, as AutoFP8 wrote them).
  ``activation_scheme`` "dynamic" or "static".
- compressed-tensors (``quant_method: "compressed-tensors"``, format "float-quantized" or
  "naive-quantized"): ``config_groups`` whose weights are ``num_bits: 8, type: float`` with
  ``strategy`` "tensor" (``weight_scale`` [1] or []), "channel" ([N, 1]) or "block"
  (``block_structure`` [bn, bk], ``weight_scale`` as the block scales above).

Whatever the checkpoint's activation scheme, activations are quantized dynamically per
token; a static ``input_scale`` is read past and unused. Layers a checkpoint leaves
unquantized (its ``ignore`` / ``modules_to_not_convert`` list) stay in the activation dtype
(ignored_layers.py); so do the LM head and the embeddings, always.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pydaemon.config.checkpoint_format import (  # noqa: F401 - parse_... re-exported
    CheckpointQuantization,
    parse_quantization_config,
)
from pydaemon.quantization.fp8 import MIN_CAPABILITY, Fp8LinearMethod

QUANTIZATIONS = ("fp8", "fp8_emulated")
SCALE_NAMES = ("weight_scale", "weight_scale_inv")


@dataclass(frozen=True)
class Fp8Config:
    """The model runs FP8 linear layers (all but the LM head and those the checkpoint's list
    leaves unquantized); ``checkpoint`` says how the checkpoint stores them (None:
    unquantized weights, quantized at load)."""

    checkpoint: CheckpointQuantization | None
    emulate: bool

    def linear_method(self) -> Fp8LinearMethod:
        return Fp8LinearMethod(self.emulate, self.checkpoint)


def check_fp8_supported(device: torch.device, why: str = "") -> None:
    """ValueError unless ``device`` is a CUDA GPU with FP8 tensor cores (sm_89+)."""
    fix = (
        "; quantization='fp8_emulated' runs the same FP8 weights through dequantized "
        "matmuls instead (any device, slow: meant for tests)"
    )
    if device.type != "cuda":
        raise ValueError(
            f"{why}quantization='fp8' needs a CUDA GPU of compute capability "
            f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (FP8 GEMMs through "
            f"torch._scaled_mm); this model runs on {device.type}{fix}"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise ValueError(
            f"{why}quantization='fp8' needs a CUDA GPU of compute capability "
            f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (FP8 tensor cores); "
            f"{torch.cuda.get_device_name(device)} is sm_{capability[0]}{capability[1]}{fix}"
        )


def resolve_quantization(
    requested: str | None, checkpoint: CheckpointQuantization | None, device: torch.device
) -> Fp8Config | None:
    """The engine's ``quantization`` (None: whatever the checkpoint is) and the checkpoint's
    -> how the model runs. A FP8 checkpoint runs in FP8 even when nothing was asked for."""
    if requested is not None and requested not in QUANTIZATIONS:
        raise ValueError(
            f"unsupported quantization {requested!r}: expected one of {', '.join(QUANTIZATIONS)}"
        )
    if requested is None and checkpoint is None:
        return None
    emulate = requested == "fp8_emulated"
    if not emulate:
        why = (
            f"this checkpoint is FP8-quantized (quant_method {checkpoint.quant_method!r}): "
            if checkpoint is not None and requested is None
            else ""
        )
        check_fp8_supported(device, why)
    return Fp8Config(checkpoint, emulate)
