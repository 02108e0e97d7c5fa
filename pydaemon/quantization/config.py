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
token; a static ``input_scale`` is read past and unused. Layers a checkpoint leaves in
bf16 (its ``ignore`` / ``modules_to_not_convert`` list) are quantized at load like a bf16
checkpoint; the LM head and the embeddings always stay in the activation dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pydaemon.quantization.checkpoint_format import CheckpointQuantization
from pydaemon.quantization.fp8 import MIN_CAPABILITY, Fp8LinearMethod

QUANTIZATIONS = ("fp8", "fp8_emulated")
SCALE_NAMES = ("weight_scale", "weight_scale_inv")
_CT_FORMATS = ("float-quantized", "naive-quantized")
_CT_STRATEGIES = ("tensor", "channel", "block")


@dataclass(frozen=True)
class Fp8Config:
    """The model runs FP8 linear layers (all but the LM head); ``checkpoint`` says how the
    checkpoint stores them (None: unquantized weights, quantized at load)."""

    checkpoint: CheckpointQuantization | None
    emulate: bool

    def linear_method(self) -> Fp8LinearMethod:
        return Fp8LinearMethod(self.emulate, self.checkpoint)


def parse_quantization_config(raw: Any) -> CheckpointQuantization | None:
    """config.json's ``quantization_config`` (None when absent) -> its FP8 layout, or a
    ValueError naming what is not supported."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"config.json quantization_config must be an object, got {raw!r}")
    method = raw.get("quant_method")
    if method == "fp8":
        return _parse_hf_fp8(raw)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(raw)
    raise ValueError(
        f"unsupported quant_method {method!r} in config.json quantization_config "
        "(supported: 'fp8', 'compressed-tensors' with FP8 weights)"
    )


def _block_size(value: Any, where: str) -> tuple[int, int]:
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        raise ValueError(
            f"unsupported block size {where} = {value!r}: expected [rows, columns], two "
            "positive integers (e.g. [128, 128])"
        )
    return int(value[0]), int(value[1])


def _parse_hf_fp8(raw: dict[str, Any]) -> CheckpointQuantization:
    scheme = raw.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(
            f"unsupported activation_scheme {scheme!r} in quantization_config "
            "(expected 'dynamic' or 'static')"
        )
    block = raw.get("weight_block_size")
    if block is None:
        return CheckpointQuantization("fp8", "tensor", None)
    return CheckpointQuantization("fp8", "block", _block_size(block, "weight_block_size"))


def _parse_compressed_tensors(raw: dict[str, Any]) -> CheckpointQuantization:
    fmt = raw.get("format", "float-quantized")
    if fmt not in _CT_FORMATS:
        raise ValueError(
            f"unsupported compressed-tensors format {fmt!r} (supported: {', '.join(_CT_FORMATS)})"
        )
    groups = raw.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    layouts = set()
    for group_name, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(weights, dict):
            raise ValueError(f"compressed-tensors config group {group_name!r} has no 'weights'")
        bits, kind = weights.get("num_bits"), weights.get("type")
        if bits != 8 or kind != "float":
            raise ValueError(
                f"compressed-tensors config group {group_name!r} quantizes weights to "
                f"num_bits={bits!r} type={kind!r}: only FP8 (num_bits 8, type 'float') is "
                "supported"
            )
        strategy = weights.get("strategy", "tensor")
        if strategy not in _CT_STRATEGIES:
            raise ValueError(
                f"unsupported weight strategy {strategy!r} in compressed-tensors config group "
                f"{group_name!r} (supported: {', '.join(_CT_STRATEGIES)})"
            )
        block = None
        if strategy == "block":
            block = _block_size(weights.get("block_structure"), f"{group_name}.block_structure")
        layouts.add((strategy, block))
    if len(layouts) != 1:
        raise ValueError(
            f"compressed-tensors config groups use different weight layouts {sorted(layouts)}: "
            "only one per checkpoint is supported"
        )
    strategy, block = layouts.pop()
    return CheckpointQuantization("compressed-tensors", strategy, block)


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
