"""FP8 against bf16 on the linear layers of Llama-3-8B: where the FP8 speed-up goes.

For each projection (qkv, o, gate_up, down) and each token count M (a decode batch, a
prefill chunk), times on the GPU:
- bf16 ``x @ w.t()``;
- the FP8 path as the model runs it: the per-token activation quantization kernel plus
  ``torch._scaled_mm`` with row-wise scales (pydaemon/quantization/fp8.py);
- the GEMM alone with row-wise scales and with one tensor-wide scale (the quantization
  left out), so the cost of each part shows.
TFLOP/s = 2 M N K / time. Prints a table and writes JSON (``--out``).

    python bench/bench_fp8_gemm.py --out fp8_gemm.json
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.timing import bench_ms

# (name, N, K) per tensor-parallel rank 1, Llama-3-8B.
SHAPES = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="512,4096", help="comma-separated M values")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    from pydaemon import ops
    from pydaemon.quantization.fp8 import (
        quantize_per_channel,
        quantize_per_token,
        scaled_mm,
        scaled_mm_swapped,
    )

    torch.manual_seed(0)
    rows = []
    for m in (int(t) for t in args.tokens.split(",")):
        for name, n, k in SHAPES:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            wq, w_scale = quantize_per_channel(w)
            xq, x_scale = quantize_per_token(x)
            one = torch.ones((), device="cuda", dtype=torch.float32)
            flops = 2.0 * m * n * k
            times = {
                "bf16": bench_ms(lambda x=x, w=w: x @ w.t()),
                "fp8 (quant + rowwise gemm)": bench_ms(
                    lambda x=x, wq=wq, s=w_scale: scaled_mm(*quantize_per_token(x), wq, s)
                ),
                "fp8 rowwise gemm": bench_ms(
                    lambda xq=xq, xs=x_scale, wq=wq, s=w_scale: scaled_mm(xq, xs, wq, s)
                ),
                "fp8 tensorwise gemm": bench_ms(
                    lambda xq=xq, wq=wq, one=one: torch._scaled_mm(
                        xq, wq.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16
                    )
                ),
                "quant only": bench_ms(lambda x=x: quantize_per_token(x)),
            }
            if m <= 64:  # cuBLASLt with the operands swapped (off by default: FP8_SWAP_AB_*)
                times["fp8 swap-AB gemm"] = bench_ms(
                    lambda xq=xq, xs=x_scale, wq=wq, s=w_scale: scaled_mm_swapped(xq, xs, wq, s)
                )
            if m <= 16 and ops.fp8_gemv_available():  # pagedd's decode kernel (off by default)
                times["fp8 gemv"] = bench_ms(
                    lambda xq=xq, xs=x_scale, wq=wq, s=w_scale: ops.fp8_gemv(xq, xs, wq, s)
                )
            row = {"tokens": m, "layer": name, "n": n, "k": k}
            if "fp8 swap-AB gemm" in times:  # the same product? (a wrong one is no speed-up)
                diff = scaled_mm_swapped(xq, x_scale, wq, w_scale) - scaled_mm(
                    xq, x_scale, wq, w_scale
                )
                row["swap-AB max abs diff"] = float(diff.abs().max())
            for label, t in times.items():
                row[label + " ms"] = t["median_ms"]
                if label != "quant only":
                    row[label + " TFLOP/s"] = flops / t["median_ms"] / 1e9
                    weight_bytes = n * k * (2 if label == "bf16" else 1)
                    row[label + " weight GB/s"] = weight_bytes / t["median_ms"] / 1e6
            row["speed-up (as run)"] = (
                times["bf16"]["median_ms"] / times["fp8 (quant + rowwise gemm)"]["median_ms"]
            )
            rows.append(row)
            print(
                f"M {m:5d} {name:8s} bf16 {row['bf16 TFLOP/s']:6.0f} TF | fp8 as run "
                f"{row['fp8 (quant + rowwise gemm) TFLOP/s']:6.0f} TF | rowwise gemm "
                f"{row['fp8 rowwise gemm TFLOP/s']:6.0f} TF | tensorwise "
                f"{row['fp8 tensorwise gemm TFLOP/s']:6.0f} TF | quant "
                f"{row['quant only ms'] * 1e3:6.1f} us | x{row['speed-up (as run)']:.2f}"
                + (
                    f" | weights: bf16 {row['bf16 weight GB/s']:5.0f}, fp8 gemm "
                    f"{row['fp8 rowwise gemm weight GB/s']:5.0f}, gemv "
                    f"{row['fp8 gemv weight GB/s']:5.0f}, swap-AB "
                    f"{row['fp8 swap-AB gemm weight GB/s']:5.0f} GB/s"
                    if "fp8 gemv ms" in row
                    else ""
                )
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
