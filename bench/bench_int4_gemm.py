"""The W4A16 Triton kernels (pydaemon/quantization/w4a16.py) against bf16 on the linear layers
of Llama-3-8B, and the 4-bit MoE experts (layers/moe/w4a16_moe.py) on Qwen3-30B-A3B (int4) and
gpt-oss-20b (MXFP4) shapes.

Dense: for each projection (qkv, o, gate_up, down) and token count M, the device time of bf16
``x @ w.t()`` and of the int4 group-128 path as the model runs it (GEMV up to
GEMV_MAX_TOKENS rows, tensor-core GEMM above); achieved bandwidth = bytes read (packed weights,
scales, zero points, activations) + written, over time, also as a fraction of the copy ceiling
measured in the same run; and the speed-up over bf16. Before timing, each shape's output is
checked against the bf16 product of the dequantized weights (relative error printed).

``--sweep``: also times the alternatives (GEMV tiles for M <= 8, GEMM tiles for every M, and
the GEMV against the GEMM at small M) and prints the fastest per (shape, M): the tables of
w4a16.py (GEMV_CONFIG, GEMM_CONFIGS, GEMV_MAX_TOKENS) are to be set from it.
``--moe``: the experts at T tokens (routing from a seeded random router: experts touched per
step reported), int4 / MXFP4 against the bf16 Triton fused-MoE path; bytes = the touched
experts' weights.

    python bench/bench_int4_gemm.py --sweep --moe --out int4_gemm.json
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.timing import bench_ms, copy_bandwidth_gbs  # noqa: E402

SHAPES = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336))
GEMV_SWEEP = [(8, 512, 4), (16, 512, 4), (8, 1024, 8), (16, 1024, 8), (32, 1024, 8),
              (32, 512, 8), (64, 512, 8), (4, 1024, 4)]  # fmt: skip
GEMM_SWEEP = [(16, 64, 128, 8, 4, 4), (16, 128, 128, 8, 4, 4), (16, 64, 64, 8, 4, 5),
              (32, 64, 128, 8, 4, 4), (32, 128, 128, 8, 4, 3), (64, 64, 128, 8, 4, 4),
              (64, 128, 128, 8, 4, 3), (64, 128, 64, 8, 4, 4), (128, 128, 64, 8, 8, 3),
              (128, 256, 64, 8, 8, 3), (128, 128, 128, 8, 8, 3)]  # fmt: skip
# (name, E, H, I, top_k, format)
MOE_SHAPES = (("qwen3-30b-a3b int4", 128, 2048, 768, 8, "int4"),
              ("gpt-oss-20b mxfp4", 32, 2880, 2880, 4, "mxfp4"))  # fmt: skip


def _int4_weights(n: int, k: int, group: int, zero_points: bool):
    from pydaemon.quantization.int4 import pack_int4

    q = torch.randint(0, 16, (n, k), device="cuda", dtype=torch.int32)
    scales = (torch.rand(n, k // group, device="cuda") * 0.01 + 0.001).half()
    zeros = torch.randint(0, 16, (n, k // group), device="cuda", dtype=torch.uint8)
    return pack_int4(q), scales, zeros if zero_points else None


def _bytes(m: int, n: int, k: int, group: int, zero_points: bool) -> int:
    weights = n * k // 2 + n * (k // group) * (2 + (1 if zero_points else 0))
    return weights + m * k * 2 + m * n * 2


def dense(args, ceiling: float) -> list[dict]:
    from pydaemon.quantization import w4a16
    from pydaemon.quantization.int4 import dequantize_int4

    rows = []
    for name, n, k in SHAPES:
        qweight, scales, zeros = _int4_weights(n, k, args.group, args.zero_points)
        w_bf16 = dequantize_int4(qweight, scales, zeros, torch.bfloat16)
        packed = w4a16.PackedWeights(qweight[None], scales[None],
                                     None if zeros is None else zeros[None], None, None, 0,
                                     args.group)  # fmt: skip
        for m in args.tokens:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = x.float() @ w_bf16.float().t()
            got = w4a16.linear(x, qweight, scales, zeros, None).float()
            rel = float((got - want).abs().max() / want.abs().max())
            nbytes = _bytes(m, n, k, args.group, args.zero_points)
            t_bf16 = bench_ms(lambda x=x, w=w_bf16: x @ w.t())["median_ms"]
            run = functools.partial(w4a16.linear, x, qweight, scales, zeros, None)
            t_int4 = bench_ms(run)["median_ms"]
            row = dict(shape=name, n=n, k=k, m=m, bf16_ms=t_bf16, int4_ms=t_int4,
                       speedup=t_bf16 / t_int4, int4_gbs=nbytes / t_int4 / 1e6,
                       bf16_gbs=(n * k * 2 + m * (n + k) * 2) / t_bf16 / 1e6,
                       max_rel_error=rel)  # fmt: skip
            row["int4_fraction_of_ceiling"] = row["int4_gbs"] / ceiling
            if args.sweep:
                row["sweep"] = sweep(x, packed, m, n, k, args.group)
            rows.append(row)
            print(f"{name:8s} M={m:4d}  bf16 {t_bf16 * 1e3:8.1f} us  int4 {t_int4 * 1e3:8.1f} us"
                  f"  x{row['speedup']:.2f}  {row['int4_gbs']:7.0f} GB/s "
                  f"({row['int4_fraction_of_ceiling']:.2f} of copy)  err {rel:.1e}", flush=True)  # fmt: skip
    return rows


def sweep(x, packed, m: int, n: int, k: int, group: int) -> dict:
    from pydaemon.quantization import w4a16

    out = {}
    if m <= 8:
        for bn, bk, nw in GEMV_SWEEP:
            cfg = w4a16.GemvConfig(bn, bk, nw)
            try:
                t = bench_ms(functools.partial(w4a16.launch_gemv, x, packed, m, config=cfg))
                out[f"gemv {cfg}"] = t["median_ms"]
            except Exception as exc:  # a tile that does not compile or fit
                out[f"gemv {cfg}"] = repr(exc)[:80]
    for c in GEMM_SWEEP:
        cfg = w4a16.GemmConfig(*c)
        cfg = cfg._replace(block_k=min(cfg.block_k, group))
        if cfg.block_m > max(16, 2 * m):
            continue
        try:
            t = bench_ms(functools.partial(w4a16.launch_gemm, x, packed, m, cfg))
            out[f"gemm {cfg}"] = t["median_ms"]
        except Exception as exc:
            out[f"gemm {cfg}"] = repr(exc)[:80]
    timed = {key: v for key, v in out.items() if isinstance(v, float)}
    best = min(timed, key=timed.get) if timed else None
    print(f"    sweep M={m}: best {best} {timed.get(best, 0) * 1e3:.1f} us", flush=True)
    return {"best": best, "times_ms": out}


def _expert_weights(fmt: str, e: int, n: int, k: int, gen: torch.Generator):
    """-> (E experts' [n, k] weights packed as ``fmt``, the bytes of one expert)."""
    from pydaemon.layers.moe.w4a16_moe import ExpertWeights
    from pydaemon.quantization.int4 import pack_int4
    from pydaemon.quantization.mxfp4 import quantize_mxfp4

    if fmt == "mxfp4":
        packed, scales = quantize_mxfp4(torch.randn(e, n, k, device="cuda", generator=gen) * 0.02)
        return ExpertWeights(packed, scales, None, None, None, "mxfp4"), n * k // 2 + n * k // 32
    q = torch.randint(0, 16, (e, n, k), device="cuda", dtype=torch.int32, generator=gen)
    scales = (torch.rand(e, n, k // 128, device="cuda", generator=gen) * 0.01).half()
    return ExpertWeights(pack_int4(q), scales, None, None, None, "int4"), n * k // 2 + n * k // 64


def moe(args, ceiling: float) -> list[dict]:
    from pydaemon.layers.activation import SiluAndMul
    from pydaemon.layers.moe import triton_moe, w4a16_moe
    from pydaemon.layers.moe.router import select_experts

    act = SiluAndMul()
    rows = []
    for name, e, h, inter, top_k, fmt in MOE_SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        w13, b13 = _expert_weights(fmt, e, 2 * inter, h, gen)
        w2, b2 = _expert_weights(fmt, e, h, inter, gen)
        w13_bf16 = torch.randn(e, 2 * inter, h, device="cuda", dtype=torch.bfloat16) * 0.02
        w2_bf16 = torch.randn(e, h, inter, device="cuda", dtype=torch.bfloat16) * 0.02
        router = torch.randn(h, e, device="cuda", generator=gen)
        for t in args.moe_tokens:
            x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=gen)
            topk_weights, topk_ids = select_experts(x.float() @ router, top_k, "softmax", True)
            touched = int(torch.unique(topk_ids).numel())
            t4 = bench_ms(functools.partial(w4a16_moe.fused_experts, x, w13, w2, topk_weights,
                                            topk_ids, act))  # fmt: skip
            tb = bench_ms(functools.partial(triton_moe.fused_experts_triton, x, w13_bf16,
                                            w2_bf16, topk_weights, topk_ids))  # fmt: skip
            nbytes = touched * (b13 + b2)
            row = dict(shape=name, tokens=t, experts_touched=touched, quant_ms=t4["median_ms"],
                       bf16_ms=tb["median_ms"], speedup=tb["median_ms"] / t4["median_ms"],
                       quant_gbs=nbytes / t4["median_ms"] / 1e6)  # fmt: skip
            row["quant_fraction_of_ceiling"] = row["quant_gbs"] / ceiling
            rows.append(row)
            print(f"{name:20s} T={t:4d} experts {touched:3d}  bf16 {tb['median_ms'] * 1e3:8.1f} us"
                  f"  {fmt} {t4['median_ms'] * 1e3:8.1f} us  x{row['speedup']:.2f}"
                  f"  {row['quant_gbs']:7.0f} GB/s", flush=True)  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256",
                   help="comma-separated M values")  # fmt: skip
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--zero-points", action="store_true", help="asymmetric (AWQ-like) weights")
    p.add_argument("--sweep", action="store_true", help="time the tile alternatives too")
    p.add_argument("--moe", action="store_true", help="also the MoE expert shapes")
    p.add_argument("--moe-tokens", default="1,8,64,256")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.moe_tokens = [int(t) for t in args.moe_tokens.split(",")]
    torch.manual_seed(0)
    ceiling = copy_bandwidth_gbs()["gbs"]
    print(f"copy ceiling {ceiling:.0f} GB/s", flush=True)
    report = {"copy_ceiling_gbs": ceiling, "group": args.group, "zero_points": args.zero_points,
              "device": torch.cuda.get_device_name(), "dense": dense(args, ceiling)}  # fmt: skip
    if args.moe:
        report["moe"] = moe(args, ceiling)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
