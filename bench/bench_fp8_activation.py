"""The kernels that quantize an FP8 layer's input, against their bf16 counterparts.

For each token count M (a decode batch, a prefill chunk), times on the GPU, Llama-3-8B widths:
- SiLU-and-multiply of the gate/up output [M, 2 x 14,336] with per-token FP8 quantization of
  the product (``ops.silu_and_mul_fp8_quant``: the input of an FP8 ``down``), and the bf16
  ``ops.silu_and_mul`` (the same reads, a bf16 write) as its memory floor;
- residual-add + RMSNorm [M, 4,096] with FP8 quantization (``ops.rms_norm_fp8_quant``);
- the standalone per-token quantization of [M, 14,336] (``ops.per_token_fp8_quant``).
A 32-layer model runs the first and the third once per layer, RMSNorm twice. Prints one line
per M and writes JSON (``--out``).

    PYTHONPATH=. python bench/bench_fp8_activation.py --out fp8_activation.json
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.timing import bench_ms

HIDDEN, INTERMEDIATE = 4096, 14336


def time_row(m: int) -> dict[str, float]:
    """Median microseconds of each kernel at M = m tokens."""
    from pydaemon import ops

    gate_up = torch.randn(m, 2 * INTERMEDIATE, device="cuda", dtype=torch.bfloat16)
    hidden = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(hidden)
    weight = torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16)
    product = torch.randn(m, INTERMEDIATE, device="cuda", dtype=torch.bfloat16)
    calls = {
        "silu_and_mul_fp8_quant": lambda: ops.silu_and_mul_fp8_quant(gate_up),
        "silu_and_mul_bf16": lambda: ops.silu_and_mul(gate_up),
        "rms_norm_fp8_quant": lambda: ops.rms_norm_fp8_quant(hidden, weight, 1e-5, residual),
        "per_token_fp8_quant": lambda: ops.per_token_fp8_quant(product),
    }
    return {f"{name}_us": bench_ms(call)["median_ms"] * 1e3 for name, call in calls.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="512,4096", help="comma-separated M values")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    rows = []
    for m in (int(t) for t in args.tokens.split(",")):
        row = {"tokens": m, **time_row(m)}
        rows.append(row)
        print(f"M {m:5d} " + " | ".join(f"{k} {v:7.1f}" for k, v in row.items() if k != "tokens"))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
