"""Which quantization a model runs with: what its checkpoint says (config.json's
``quantization_config``) and what the engine asks for (``EngineConfig.quantization``).

4-bit checkpoints (AWQ, GPTQ, compressed-tensors pack-quantized: ``Int4Config``; gpt-oss's
MXFP4 experts: ``Mxfp4Config``; formats in pydaemon/config/weight_only_format.py) run as they
are stored; asking for their ``quant_method`` by name (``quantization="awq"``, ...) is only
needed with ``load_format="dummy"``, which then draws random weights in that layout (round-to-
nearest quantized from the unquantized model's draws: group 128, zero points for AWQ).
A checkpoint of one format refuses a request for another.

FP8 checkpoint formats read (FP8 e4m3 weights):

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
from pydaemon.config.weight_only_format import INT4_METHODS, Int4Checkpoint, Mxfp4Checkpoint
from pydaemon.quantization.fp8 import MIN_CAPABILITY, Fp8LinearMethod
from pydaemon.quantization.int4_linear import Int4LinearMethod

QUANTIZATIONS = ("fp8", "fp8_emulated", *INT4_METHODS, "mxfp4")
SCALE_NAMES = ("weight_scale", "weight_scale_inv")
DUMMY_GROUP_SIZE = 128
# The layout load_format="dummy" draws for a 4-bit method named without a checkpoint.
_DUMMY_INT4 = {
    "awq": Int4Checkpoint("awq", DUMMY_GROUP_SIZE, True, False),
    "gptq": Int4Checkpoint("gptq", DUMMY_GROUP_SIZE, False, False, zero_offset=1),
    "compressed-tensors": Int4Checkpoint("compressed-tensors", DUMMY_GROUP_SIZE, False, False),
}


@dataclass(frozen=True)
class Fp8Config:
    """The model runs FP8 linear layers (all but the LM head and those the checkpoint's list
    leaves unquantized); ``checkpoint`` says how the checkpoint stores them (None:
    unquantized weights, quantized at load)."""

    checkpoint: CheckpointQuantization | None
    emulate: bool

    kind = "fp8"

    def linear_method(self, row_parallel: bool = False) -> Fp8LinearMethod:
        return Fp8LinearMethod(self.emulate, self.checkpoint)


@dataclass(frozen=True)
class Int4Config:
    """4-bit integer weights (W4A16) in every linear layer the checkpoint quantizes, and in
    the experts of MoE layers; ``scale_dtype``: the dtype their group scales are kept in
    (the checkpoint's: float16 for AWQ / GPTQ)."""

    checkpoint: Int4Checkpoint
    scale_dtype: torch.dtype
    tp_size: int = 1
    kind = "int4"

    def linear_method(self, row_parallel: bool = False) -> Int4LinearMethod:
        # An act-order row-parallel shard cannot be regrouped: dequantized at load.
        dense = row_parallel and self.tp_size > 1 and self.checkpoint.desc_act
        return Int4LinearMethod(self.checkpoint, self.scale_dtype, dense)


@dataclass(frozen=True)
class Mxfp4Config:
    """MXFP4 experts (gpt-oss); linear layers stay in the model dtype."""

    checkpoint: Mxfp4Checkpoint
    kind = "mxfp4"

    def linear_method(self, row_parallel: bool = False) -> None:
        return None


QuantConfig = Fp8Config | Int4Config | Mxfp4Config


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
    requested: str | None,
    checkpoint: CheckpointQuantization | Int4Checkpoint | Mxfp4Checkpoint | None,
    device: torch.device,
    *,
    model_dtype: torch.dtype = torch.bfloat16,
    checkpoint_dtype: torch.dtype | None = None,
    load_format: str = "auto",
    tp_size: int = 1,
) -> QuantConfig | None:
    """The engine's ``quantization`` (None: whatever the checkpoint is) and the checkpoint's
    -> how the model runs. A quantized checkpoint runs quantized even when nothing was asked
    for. ``checkpoint_dtype``: the dtype config.json names (the scales of compressed-tensors
    checkpoints are in it)."""
    if requested is not None and requested not in QUANTIZATIONS:
        raise ValueError(
            f"unsupported quantization {requested!r}: expected one of {', '.join(QUANTIZATIONS)}"
        )
    if requested is None and checkpoint is None:
        return None
    if isinstance(checkpoint, Int4Checkpoint | Mxfp4Checkpoint) or requested in (
        *INT4_METHODS,
        "mxfp4",
    ):
        return _resolve_weight_only(
            requested, checkpoint, model_dtype, checkpoint_dtype, load_format, tp_size
        )
    emulate = requested == "fp8_emulated"
    if not emulate:
        why = (
            f"this checkpoint is FP8-quantized (quant_method {checkpoint.quant_method!r}): "
            if checkpoint is not None and requested is None
            else ""
        )
        check_fp8_supported(device, why)
    return Fp8Config(checkpoint, emulate)


def _resolve_weight_only(
    requested: str | None,
    checkpoint: CheckpointQuantization | Int4Checkpoint | Mxfp4Checkpoint | None,
    model_dtype: torch.dtype,
    checkpoint_dtype: torch.dtype | None,
    load_format: str,
    tp_size: int,
) -> Int4Config | Mxfp4Config:
    if isinstance(checkpoint, CheckpointQuantization):
        raise ValueError(
            f"quantization={requested!r} asked for, but this checkpoint's weights are FP8 "
            f"(quant_method {checkpoint.quant_method!r}): leave quantization unset, or 'fp8'"
        )
    if checkpoint is not None and requested is not None and requested != checkpoint.quant_method:
        raise ValueError(
            f"quantization={requested!r} asked for, but this checkpoint is quantized with "
            f"quant_method {checkpoint.quant_method!r} (config.json quantization_config): "
            "leave quantization unset to run it as it is stored"
        )
    if checkpoint is None:
        if load_format != "dummy":
            raise ValueError(
                f"quantization={requested!r} reads {requested} checkpoints, and this one is not "
                "quantized (config.json has no quantization_config); with load_format='dummy' "
                "it draws random weights in that layout"
            )
        if requested == "mxfp4":
            return Mxfp4Config(Mxfp4Checkpoint())
        return Int4Config(_DUMMY_INT4[requested], model_dtype, tp_size)
    if isinstance(checkpoint, Mxfp4Checkpoint):
        return Mxfp4Config(checkpoint)
    if checkpoint.quant_method in ("awq", "gptq"):
        scale_dtype = torch.float16  # AutoAWQ / AutoGPTQ / GPTQModel write float16 scales
    elif checkpoint_dtype in (torch.float16, torch.bfloat16, torch.float32):
        scale_dtype = checkpoint_dtype
    else:
        scale_dtype = torch.bfloat16
    if load_format == "dummy":
        scale_dtype = model_dtype
    return Int4Config(checkpoint, scale_dtype, tp_size)
