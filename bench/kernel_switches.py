"""Kernel switches for A/B runs: the token bounds under which pagedd's small-batch kernels
replace the general path, set for this process only (benchmarks, not a configuration).

- ``--fp8-gemv-max-tokens N``: FP8 linear layers of at most N rows run ``ops.fp8_gemv``
  instead of ``torch._scaled_mm`` (pydaemon/quantization/fp8.py, FP8_GEMV_MAX_TOKENS);
- ``--fp8-swap-ab-max-tokens N``: FP8 linear layers of at most N rows call ``torch._scaled_mm``
  with the operands swapped (``scaled_mm_swapped``, FP8_SWAP_AB_MAX_TOKENS);
- ``--moe-decode-max-slots N``: MoE layers of at most N token x top_k slots run the two decode
  kernels instead of the grouped GEMMs (pydaemon/layers/moe/experts.py, MOE_DECODE_MAX_SLOTS);
- ``--moe-backend grouped|triton``: the GEMMs of MoE steps the decode kernels do not take:
  ``torch._grouped_mm`` or the Triton fused-MoE kernels (pydaemon/layers/moe/triton_moe.py;
  experts.MOE_BACKEND), the latter for steps of at most ``--moe-triton-max-tokens N`` tokens
  (MOE_TRITON_MAX_TOKENS);
- ``--moe-fp8-backend triton|grouped``: the GEMMs of FP8 MoE layers: the FP8 Triton fused-MoE
  kernels (pydaemon/layers/moe/triton_moe_fp8.py) or ``torch._scaled_grouped_mm``
  (pydaemon/layers/moe/fp8.py, FP8_MOE_BACKEND); ``--fp8-w8a16-max-tokens N``: FP8 MoE steps of
  at most N tokens keep bf16 activations (w8a16), larger ones quantize them (w8a8)
  (triton_moe_fp8.W8A16_MAX_TOKENS);
- ``--lora-kernel-max-tokens N``: LoRA deltas of at most N tokens run the BGMV kernels
  (pydaemon/layers/lora/punica.py, LORA_KERNEL_MAX_TOKENS);
- ``--lora-overlap 0|1``: LoRA layers captured in CUDA graphs run their shrink on a side stream
  beside the base GEMM (pydaemon/layers/lora/punica.py, LORA_OVERLAP_SHRINK).
- ``--lora-grouped 0|1``: LoRA deltas above the BGMV kernels' bound (bf16, Hopper/Blackwell)
  run the grouped GEMMs of pydaemon/layers/lora/punica_grouped.py instead of the dense torch
  path (LORA_GROUPED); ``--lora-grouped-min-tokens N``: only steps of at least N tokens do
  (LORA_GROUPED_MIN_TOKENS).
- ``--lora-triton 0|1``: LoRA deltas above the BGMV kernels' bound (fp16/bf16 on CUDA) run the
  Triton SGMV kernels of pydaemon/layers/lora/punica_triton.py, before the grouped GEMMs
  (LORA_TRITON).

Applied before the engine is built (CUDA graphs capture the path of their shapes); an engine
whose core runs in other processes (tensor parallelism) does not see them.
"""

from __future__ import annotations

import argparse

# flag -> (module, constant)
SWITCHES = {
    "fp8_gemv_max_tokens": ("pydaemon.quantization.fp8", "FP8_GEMV_MAX_TOKENS"),
    "fp8_swap_ab_max_tokens": ("pydaemon.quantization.fp8", "FP8_SWAP_AB_MAX_TOKENS"),
    "moe_decode_max_slots": ("pydaemon.layers.moe.experts", "MOE_DECODE_MAX_SLOTS"),
    "moe_triton_max_tokens": ("pydaemon.layers.moe.experts", "MOE_TRITON_MAX_TOKENS"),
    "fp8_w8a16_max_tokens": ("pydaemon.layers.moe.triton_moe_fp8", "W8A16_MAX_TOKENS"),
    "lora_kernel_max_tokens": ("pydaemon.layers.lora.punica", "LORA_KERNEL_MAX_TOKENS"),
    "lora_grouped_min_tokens": ("pydaemon.layers.lora.punica_grouped", "LORA_GROUPED_MIN_TOKENS"),
}
# flag -> (module, constant, choices): one of named choices
CHOICES = {
    "moe_backend": ("pydaemon.layers.moe.experts", "MOE_BACKEND", ("grouped", "triton")),
    "moe_fp8_backend": ("pydaemon.layers.moe.fp8", "FP8_MOE_BACKEND", ("triton", "grouped")),
}
# flag -> (module, constant): on/off switches, given as 0 or 1
TOGGLES = {
    "lora_overlap": ("pydaemon.layers.lora.punica", "LORA_OVERLAP_SHRINK"),
    "lora_grouped": ("pydaemon.layers.lora.punica_grouped", "LORA_GROUPED"),
    "lora_triton": ("pydaemon.layers.lora.punica_triton", "LORA_TRITON"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("kernel switches (A/B, this process only)")
    for name, (module, constant) in SWITCHES.items():
        group.add_argument(
            "--" + name.replace("_", "-"),
            type=int,
            default=None,
            help=f"{module}.{constant} for this run (default: the code's value)",
        )
    for name, (module, constant, choices) in CHOICES.items():
        group.add_argument(
            "--" + name.replace("_", "-"),
            choices=choices,
            default=None,
            help=f"{module}.{constant} for this run (default: the code's value)",
        )
    for name, (module, constant) in TOGGLES.items():
        group.add_argument(
            "--" + name.replace("_", "-"),
            type=int,
            choices=(0, 1),
            default=None,
            help=f"{module}.{constant} off (0) or on (1) for this run (default: the code's)",
        )


def apply(args: argparse.Namespace) -> dict[str, int | bool | str]:
    """Sets the switches given on the command line; -> every switch's value in effect."""
    import importlib

    values: dict[str, int | bool | str] = {}
    for name, (module_name, constant) in SWITCHES.items():
        module = importlib.import_module(module_name)
        value = getattr(args, name, None)
        if value is not None:
            if value < 0:
                raise SystemExit(f"--{name.replace('_', '-')} must be >= 0, got {value}")
            setattr(module, constant, value)
        values[name] = getattr(module, constant)
    for name, (module_name, constant, _) in CHOICES.items():
        module = importlib.import_module(module_name)
        value = getattr(args, name, None)
        if value is not None:
            setattr(module, constant, value)
        values[name] = getattr(module, constant)
    for name, (module_name, constant) in TOGGLES.items():
        module = importlib.import_module(module_name)
        value = getattr(args, name, None)
        if value is not None:
            setattr(module, constant, bool(value))
        values[name] = bool(getattr(module, constant))
    return values
