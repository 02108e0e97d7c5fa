"""The MoE layer alone on the GPU: FusedMoE forward (routing, align, the two grouped GEMMs,
SiLU-and-mul, combine) per token count, bf16 and FP8, on a model's expert shape; also each
stage alone at the same size. Times are CUDA-graph replays (as a decode step runs them), median
of ``--iters``; TFLOP/s counts the routed experts' GEMMs only, GB/s the expert weights the
step touches (distinct experts hit, at least once each).

    PYTHONPATH=. python bench/bench_moe.py --shape qwen3-30b-a3b --tokens 1,8,64,256,1024,4096 \\
        --out bench/results/moe_layer_qwen3_30b_a3b_h200_<date>.json
    PYTHONPATH=. python bench/bench_moe.py --shape mixtral-8x7b --quantization fp8
    PYTHONPATH=. python bench/bench_moe.py --tokens 1,2,4,8 --decode-max-slots 64  # decode kernels
    PYTHONPATH=. python bench/bench_moe.py --moe-backend triton --decode-max-slots 0  # Triton GEMMs

With ``--moe-backend triton`` the align column times the Triton path's align kernel (padded
per expert to the step's BLOCK_M) instead of the grouped path's.
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
    p.add_argument("--quantization", choices=("none", "fp8"), default="none")
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
        help="experts.MOE_BACKEND for this run (bf16 only: FP8 layers keep their own GEMMs); "
        "default: the code's value",
    )
    p.add_argument(
        "--triton-tile",
        default=None,
        metavar="BM,BN,BK,GROUP_M,WARPS,STAGES",
        help="with --moe-backend triton: this one tile config at every token count instead "
        "of triton_moe.TILE_CONFIGS (to tune the table)",
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from pydaemon.layers.moe import FusedMoE, experts, triton_moe
    from pydaemon.layers.moe.align import moe_align
    from pydaemon.layers.moe.router import select_experts
    from pydaemon.quantization.config import Fp8Config
    from pydaemon.quantization.fp8 import quantize_per_channel

    if args.decode_max_slots is not None:  # an A/B knob of this process only
        experts.MOE_DECODE_MAX_SLOTS = args.decode_max_slots
    if args.moe_backend is not None:
        experts.MOE_BACKEND = args.moe_backend
    if args.triton_tile:
        tile = triton_moe.TileConfig(*(int(v) for v in args.triton_tile.split(",")))
        triton_moe.TILE_CONFIGS = ((1 << 62, tile),)
    e, k, h, i, renorm = SHAPES[args.shape]
    quant = Fp8Config(None, emulate=False) if args.quantization == "fp8" else None
    torch.manual_seed(0)
    with torch.device("cuda"):
        layer = FusedMoE(e, k, h, i, renormalize=renorm, quant_config=quant)
        if quant is None:
            layer.w13_weight.data = torch.randn(e, 2 * i, h, dtype=torch.bfloat16) * 0.02
            layer.w2_weight.data = torch.randn(e, h, i, dtype=torch.bfloat16) * 0.02
        else:
            for name in ("w13", "w2"):
                wq, sc = getattr(layer, f"{name}_weight"), getattr(layer, f"{name}_weight_scale")
                for x in range(e):
                    q, s = quantize_per_channel(torch.randn(wq.shape[1:], device="cuda") * 0.02)
                    wq.data[x].copy_(q)
                    sc.data[x].copy_(s)
    bytes_per_expert = 3 * h * i * (1 if quant else 2)
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
            if experts.MOE_BACKEND == "triton" and quant is None:
                bm = triton_moe.tile_config(t).block_m
                align = _time_graph(
                    lambda ids=ids, bm=bm: triton_moe.moe_align_blocks(ids, e, bm), args.iters
                )
            else:
                align = _time_graph(lambda ids=ids: moe_align(ids, e), args.iters)
        hit = ids.unique().numel()
        flops = 2 * t * k * 3 * h * i
        row = {
            "tokens": t,
            "total_ms": total,
            "route_ms": route,
            "align_ms": align,
            "experts_hit": hit,
            "tflops": flops / (total * 1e9),
            "weight_gbs": hit * bytes_per_expert / (total * 1e6),
        }
        rows.append(row)
        print(f"T {t:5}: {total * 1e3:9.1f} us (route {route * 1e3:6.1f}, align "
              f"{align * 1e3:6.1f})  {row['tflops']:7.1f} TFLOP/s  {row['weight_gbs']:7.0f} GB/s "
              f"({hit} experts)")  # fmt: skip
    report = {
        "meta": {
            **environment(["bench/bench_moe.py", *(argv or sys.argv[1:])]),
            "benchmark": "bench_moe",
        },  # fmt: skip
        "shape": dict(
            zip(("experts", "top_k", "hidden", "intermediate"), SHAPES[args.shape], strict=False)
        ),
        "quantization": args.quantization,
        "decode_max_slots": experts.MOE_DECODE_MAX_SLOTS,
        "moe_backend": experts.MOE_BACKEND,
        "triton_tile_configs": [[b, list(c)] for b, c in triton_moe.TILE_CONFIGS]
        if experts.MOE_BACKEND == "triton"
        else None,
        "rows": rows,
    }
    if args.out:
        write_json(Path(args.out), report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
