"""How a checkpoint stores its quantized linear weights (parsed by
pydaemon/quantization/config.py from config.json's ``quantization_config``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CheckpointQuantization:
    """How a checkpoint stores its linear weights: FP8 e4m3 with scales."""

    quant_method: str  # "fp8" | "compressed-tensors"
    strategy: str  # "tensor" | "channel" | "block": the granularity of the weight scales
    block_size: tuple[int, int] | None  # (rows, columns) of a scale block, for "block"
