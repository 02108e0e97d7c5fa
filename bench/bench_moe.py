"""The MoE layer alone on the GPU: FusedMoE forward (routing, align, the expert GEMMs,
SiLU-and-mul, combine) per token count, bf16 and FP8 (per-channel or 128 x 128 block scales),
on a model's expert shape; also the routing and the align alone at the same size. Times are
CUDA-graph replays (as a decode step runs them), median of ``--iters``; TFLOP/s counts the
routed experts' GEMMs only, GB/s the expert weights the step touches (distinct experts hit,
at least once each), "floor" is the time those bytes take at ``--hbm-tbs`` (bench/README.md's
measured copy ceiling by default) and "of floor" the floor over the time.

The routing is uniform by construction: random normal router logits, fresh per token count
(the experts hit are reported; at 64 tokens of a top-8-of-128 model nearly all are).

    PYTHONPATH=. python bench/bench_moe.py --shape qwen3-30b-a3b --tokens 1,8,64,256,1024,4096 \\
        --out bench/results/moe_layer_qwen3_30b_a3b_h200_<date>.json
    PYTHONPATH=. python bench/bench_moe.py --shape mixtral-8x7b --quantization fp8
    PYTHONPATH=. python bench/bench_moe.py --quantization fp8-block   # 128 x 128 block scales
    PYTHONPATH=. python bench/bench_moe.py --quantization fp8 --moe-fp8-backend grouped  # before
    PYTHONPATH=. python bench/bench_moe.py --quantization fp8 --fp8-w8a16-max-tokens 0  # all w8a8
    PYTHONPATH=. python bench/bench_moe.py --tokens 1,2,4,8 --decode-max-slots 64  # decode kernels
    PYTHONPATH=. python bench/bench_moe.py --moe-backend triton --decode-max-slots 0  # Triton GEMMs

With the Triton paths (bf16 ``--moe-backend triton``, FP8 ``--moe-fp8-backend triton``, the
defaults) the align column times the Triton align kernel (padded per expert to the step's
BLOCK_M) instead of the grouped path's; ``--triton-tile`` replaces the table of the path the
quantization takes (bf16: triton_moe.TILE_CONFIGS, FP8: triton_moe_fp8.FP8_TILE_CONFIGS).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.loadgen_env import environment, write_json  # noqa: E402

SHAPES = {  # num_experts, top_k, hidden, intermediate, renormalize
    "qwen3-30b-a3b": (128, 8, 2048, 768, True),
    "mixtral-8x7b": (8, 2, 4096, 14336, True),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_moe", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    p.add_argument("--tokens", default="1,8,64,256,1024,4096")
    p.add_argument("--quantization", choices=("none", "fp8", "fp8-block"), default="none",
                   help="fp8: per-channel weight scales; fp8-block: 128 x 128 block scales "
                   "(HF FP8 checkpoints)")  # fmt: skip
    p.add_argument("--hbm-tbs", type=float, default=4.27,
                   help="the copy ceiling the floor is computed at, TB/s (bench/README.md: 4.27)")  # fmt: skip
    p.add_argument("--iters", type=int, default=50)
    p.add_argument(
        "--decode-max-slots",
        type=int,
        default=None,
        help="experts.MOE_DECODE_MAX_SLOTS for this run: steps of at most this many token x "
        "top_k slots run the two MoE decode kernels (0: never); default: the code's value",
    )
    p.add_argument(
        "--moe-backend",
        choices=("grouped", "triton"),
        default=None,
        help="experts.MOE_BACKEND for this run (bf16 layers); default: the code's value",
    )
    p.add_argument(
        "--moe-fp8-backend",
        choices=("triton", "grouped"),
        default=None,
        help="fp8.FP8_MOE_BACKEND for this run (FP8 layers); default: the code's value",
    )
    p.add_argument(
        "--fp8-w8a16-max-tokens",
        type=int,
        default=None,
        help="triton_moe_fp8.W8A16_MAX_TOKENS for this run; default: the code's value",
    )
    p.add_argument(
        "--triton-tile",
        default=None,
        metavar="BM,BN,BK,GROUP_M,WARPS,STAGES",
        help="this one tile config at every token count instead of the Triton path's table "
        "(to tune it; spread over the SMs as the table's configs are)",
    )
    p.add_argument("--out", default=None)
    return p


def _time_graph(fn, iters: int) -> float:
    """Median ms of one replay of fn captured in a CUDA graph."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _fill(layer, quant: str, e: int) -> None:
    """Random weights (std 0.02), quantized per channel or per 128 x 128 block for FP8."""
    import torch

    from pydaemon.quantization.fp8 import quantize_per_channel, to_fp8

    if quant == "none":
        layer.w13_weight.data = torch.randn_like(layer.w13_weight, dtype=torch.bfloat16) * 0.02
        layer.w2_weight.data = torch.randn_like(layer.w2_weight, dtype=torch.bfloat16) * 0.02
        return
    for name in ("w13", "w2"):
        wq, sc = getattr(layer, f"{name}_weight"), getattr(layer, f"{name}_weight_scale")
        for x in range(e):
            w = torch.randn(wq.shape[1:], device="cuda") * 0.02
            if quant == "fp8":
                q, scale = quantize_per_channel(w)
            else:  # 128 x 128 blocks (the sizes are multiples of 128)
                n, k = w.shape
                blocks = w.view(n // 128, 128, k // 128, 128)
                scale = blocks.abs().amax(dim=(1, 3)) / 448.0
                q = to_fp8(w / scale.repeat_interleave(128, 0).repeat_interleave(128, 1))
            wq.data[x].copy_(q)
            sc.data[x].copy_(scale)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from pydaemon.config.checkpoint_format import CheckpointQuantization
    from pydaemon.layers.moe import FusedMoE, experts, triton_moe, triton_moe_fp8
    from pydaemon.layers.moe import fp8 as moe_fp8
    from pydaemon.layers.moe.align import moe_align
    from pydaemon.layers.moe.router import select_experts
    from pydaemon.quantization.config import Fp8Config

    if args.decode_max_slots is not None:  # A/B knobs of this process only
        experts.MOE_DECODE_MAX_SLOTS = args.decode_max_slots
    if args.moe_backend is not None:
        experts.MOE_BACKEND = args.moe_backend
    if args.moe_fp8_backend is not None:
        moe_fp8.FP8_MOE_BACKEND = args.moe_fp8_backend
    if args.fp8_w8a16_max_tokens is not None:
        triton_moe_fp8.W8A16_MAX_TOKENS = args.fp8_w8a16_max_tokens
    fp8 = args.quantization != "none"
    if args.triton_tile:
        tile = triton_moe.TileConfig(*(int(v) for v in args.triton_tile.split(",")))
        if fp8:
            triton_moe_fp8.FP8_TILE_CONFIGS = ((1 << 62, tile),)
        else:
            triton_moe.TILE_CONFIGS = ((1 << 62, tile),)
    e, k, h, i, renorm = SHAPES[args.shape]
    quant = None
    if fp8:
        blocks = CheckpointQuantization("fp8", "block", (128, 128))
        quant = Fp8Config(blocks if args.quantization == "fp8-block" else None, emulate=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        layer = FusedMoE(e, k, h, i, renormalize=renorm, quant_config=quant)
        _fill(layer, args.quantization, e)
    triton_path = (moe_fp8.FP8_MOE_BACKEND if fp8 else experts.MOE_BACKEND) == "triton"
    bytes_per_expert = 3 * h * i * (1 if fp8 else 2)
    rows = []
    for t in [int(x) for x in args.tokens.split(",")]:
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(t, e, device="cuda", dtype=torch.bfloat16)
        with torch.inference_mode():
            total = _time_graph(lambda x=x, logits=logits: layer(x, logits), args.iters)
            route = _time_graph(
                lambda logits=logits: select_experts(logits, k, "softmax", renorm), args.iters
            )
            _, ids = select_experts(logits, k, "softmax", renorm)
            if triton_path:
                table = triton_moe_fp8.fp8_tile_config if fp8 else triton_moe.tile_config
                bm = table(t).block_m
                align = _time_graph(
                    lambda ids=ids, bm=bm: triton_moe.moe_align_blocks(ids, e, bm), args.iters
                )
            else:
                align = _time_graph(lambda ids=ids: moe_align(ids, e), args.iters)
        hit = ids.unique().numel()
        flops = 2 * t * k * 3 * h * i
        floor_ms = hit * bytes_per_expert / (args.hbm_tbs * 1e9)
        row = {
            "tokens": t,
            "total_ms": total,
            "route_ms": route,
            "align_ms": align,
            "experts_hit": hit,
            "tflops": flops / (total * 1e9),
            "weight_gbs": hit * bytes_per_expert / (total * 1e6),
            "weight_floor_ms": floor_ms,
            "of_floor": floor_ms / total,
        }
        rows.append(row)
        print(f"T {t:5}: {total * 1e3:9.1f} us (route {route * 1e3:6.1f}, align "
              f"{align * 1e3:6.1f})  {row['tflops']:7.1f} TFLOP/s  {row['weight_gbs']:7.0f} GB/s "
              f"({hit} experts; floor {floor_ms * 1e3:7.1f} us, {row['of_floor']:5.1%})")  # fmt: skip
    report = {
        "meta": {
            **environment(["bench/bench_moe.py", *(argv or sys.argv[1:])]),
            "benchmark": "bench_moe",
        },  # fmt: skip
        "shape": dict(
            zip(("experts", "top_k", "hidden", "intermediate"), SHAPES[args.shape], strict=False)
        ),
        "quantization": args.quantization,
        "hbm_tbs": args.hbm_tbs,
        "decode_max_slots": experts.MOE_DECODE_MAX_SLOTS,
        "moe_backend": experts.MOE_BACKEND,
        "moe_fp8_backend": moe_fp8.FP8_MOE_BACKEND,
        "fp8_w8a16_max_tokens": triton_moe_fp8.W8A16_MAX_TOKENS,
        "triton_tile_configs": [
            [b, list(c)]
            for b, c in (triton_moe_fp8.FP8_TILE_CONFIGS if fp8 else triton_moe.TILE_CONFIGS)
        ]
        if triton_path
        else None,
        "rows": rows,
    }
    if args.out:
        write_json(Path(args.out), report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
