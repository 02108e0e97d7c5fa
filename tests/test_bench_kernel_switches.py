"""bench/kernel_switches.py: the A/B flags set the kernels' token bounds for this process and
report every bound in effect; bad values are refused."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import kernel_switches  # noqa: E402
from pydaemon.layers.lora import punica  # noqa: E402
from pydaemon.layers.moe import experts  # noqa: E402
from pydaemon.quantization import fp8  # noqa: E402


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    kernel_switches.add_arguments(parser)
    return parser.parse_args(argv)


def test_flags_set_the_bounds_and_report_them(monkeypatch):
    for module, name in ((fp8, "FP8_GEMV_MAX_TOKENS"), (experts, "MOE_DECODE_MAX_SLOTS"),
                         (punica, "LORA_KERNEL_MAX_TOKENS")):  # fmt: skip
        monkeypatch.setattr(module, name, getattr(module, name))  # restored after the test
    lora_default = punica.LORA_KERNEL_MAX_TOKENS
    got = kernel_switches.apply(
        _parse(["--fp8-gemv-max-tokens", "16", "--moe-decode-max-slots", "0"])
    )
    assert fp8.FP8_GEMV_MAX_TOKENS == 16 and experts.MOE_DECODE_MAX_SLOTS == 0
    assert got == {"fp8_gemv_max_tokens": 16, "moe_decode_max_slots": 0,
                   "lora_kernel_max_tokens": lora_default}  # fmt: skip


def test_negative_bounds_are_refused():
    with pytest.raises(SystemExit, match="--lora-kernel-max-tokens must be >= 0"):
        kernel_switches.apply(_parse(["--lora-kernel-max-tokens", "-1"]))
