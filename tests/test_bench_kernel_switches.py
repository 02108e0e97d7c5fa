"""bench/kernel_switches.py: the A/B flags set the kernels' token bounds for this process and
report every bound in effect; bad values are refused."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import kernel_switches  # noqa: E402
from pydaemon.layers.lora import punica, punica_grouped, punica_triton  # noqa: E402
from pydaemon.layers.moe import experts, triton_moe_fp8  # noqa: E402
from pydaemon.layers.moe import fp8 as moe_fp8  # noqa: E402
from pydaemon.quantization import fp8  # noqa: E402


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    kernel_switches.add_arguments(parser)
    return parser.parse_args(argv)


def test_flags_set_the_bounds_and_report_them(monkeypatch):
    for module, name in ((fp8, "FP8_GEMV_MAX_TOKENS"), (experts, "MOE_DECODE_MAX_SLOTS"),
                         (experts, "MOE_BACKEND"), (experts, "MOE_TRITON_MAX_TOKENS"),
                         (punica, "LORA_KERNEL_MAX_TOKENS"),
                         (punica, "LORA_OVERLAP_SHRINK"),
                         (punica_grouped, "LORA_GROUPED_MIN_TOKENS")):  # fmt: skip
        monkeypatch.setattr(module, name, getattr(module, name))  # restored after the test
    lora_default = punica.LORA_KERNEL_MAX_TOKENS
    swap_default = fp8.FP8_SWAP_AB_MAX_TOKENS
    overlap_default = punica.LORA_OVERLAP_SHRINK
    grouped_default = punica_grouped.LORA_GROUPED
    triton_max_default = experts.MOE_TRITON_MAX_TOKENS
    triton_default = punica_triton.LORA_TRITON
    w8a16_default = triton_moe_fp8.W8A16_MAX_TOKENS
    fp8_backend_default = moe_fp8.FP8_MOE_BACKEND
    argv = ["--fp8-gemv-max-tokens", "16", "--moe-decode-max-slots", "0", "--moe-backend", "triton"]
    got = kernel_switches.apply(_parse([*argv, "--lora-grouped-min-tokens", "128"]))
    assert fp8.FP8_GEMV_MAX_TOKENS == 16 and experts.MOE_DECODE_MAX_SLOTS == 0
    assert experts.MOE_BACKEND == "triton"
    assert punica_grouped.LORA_GROUPED_MIN_TOKENS == 128
    assert got == {"fp8_gemv_max_tokens": 16, "fp8_swap_ab_max_tokens": swap_default,
                   "moe_decode_max_slots": 0,
                   "moe_triton_max_tokens": triton_max_default,
                   "fp8_w8a16_max_tokens": w8a16_default,
                   "moe_backend": "triton",
                   "moe_fp8_backend": fp8_backend_default,
                   "lora_kernel_max_tokens": lora_default,
                   "lora_grouped_min_tokens": 128,
                   "lora_overlap": overlap_default,
                   "lora_grouped": grouped_default,
                   "lora_triton": triton_default}  # fmt: skip
    assert punica.LORA_OVERLAP_SHRINK is overlap_default  # not given: left alone


@pytest.mark.parametrize("value", [1, 0])
def test_toggles_turn_the_lora_overlap_on_and_off(monkeypatch, value):
    monkeypatch.setattr(punica, "LORA_OVERLAP_SHRINK", not value)  # restored after the test
    got = kernel_switches.apply(_parse(["--lora-overlap", str(value)]))
    assert punica.LORA_OVERLAP_SHRINK is bool(value)
    assert got["lora_overlap"] is bool(value)


def test_the_moe_backend_takes_only_its_choices(monkeypatch):
    monkeypatch.setattr(experts, "MOE_BACKEND", experts.MOE_BACKEND)  # restored after the test
    with pytest.raises(SystemExit):
        _parse(["--moe-backend", "cutlass"])
    assert kernel_switches.apply(_parse([]))["moe_backend"] == "triton"  # the default
    assert kernel_switches.CHOICES["moe_backend"][2] == experts.MOE_BACKENDS


def test_the_fp8_moe_switches(monkeypatch):
    monkeypatch.setattr(moe_fp8, "FP8_MOE_BACKEND", moe_fp8.FP8_MOE_BACKEND)  # restored after
    monkeypatch.setattr(triton_moe_fp8, "W8A16_MAX_TOKENS", triton_moe_fp8.W8A16_MAX_TOKENS)
    got = kernel_switches.apply(
        _parse(["--moe-fp8-backend", "grouped", "--fp8-w8a16-max-tokens", "0"])
    )
    assert moe_fp8.FP8_MOE_BACKEND == "grouped" and triton_moe_fp8.W8A16_MAX_TOKENS == 0
    assert got["moe_fp8_backend"] == "grouped" and got["fp8_w8a16_max_tokens"] == 0
    assert kernel_switches.CHOICES["moe_fp8_backend"][2] == moe_fp8.FP8_MOE_BACKENDS
    with pytest.raises(SystemExit):
        _parse(["--moe-fp8-backend", "cutlass"])


@pytest.mark.parametrize("value", [1, 0])
def test_toggles_turn_the_grouped_lora_path_on_and_off(monkeypatch, value):
    monkeypatch.setattr(punica_grouped, "LORA_GROUPED", not value)  # restored after the test
    got = kernel_switches.apply(_parse(["--lora-grouped", str(value)]))
    assert punica_grouped.LORA_GROUPED is bool(value)
    assert got["lora_grouped"] is bool(value)


@pytest.mark.parametrize("value", [1, 0])
def test_toggles_turn_the_triton_lora_path_on_and_off(monkeypatch, value):
    monkeypatch.setattr(punica_triton, "LORA_TRITON", not value)  # restored after the test
    got = kernel_switches.apply(_parse(["--lora-triton", str(value)]))
    assert punica_triton.LORA_TRITON is bool(value)
    assert got["lora_triton"] is bool(value)


def test_toggles_take_only_0_or_1():
    with pytest.raises(SystemExit):
        _parse(["--lora-overlap", "2"])


def test_negative_bounds_are_refused():
    with pytest.raises(SystemExit, match="--lora-kernel-max-tokens must be >= 0"):
        kernel_switches.apply(_parse(["--lora-kernel-max-tokens", "-1"]))
