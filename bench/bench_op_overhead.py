"""Host cost of one call of each kernel wrapper in pydaemon.ops, fast kernel arguments on and off.

At one token (Llama-3-8B's layer shapes, batch 1) a kernel runs for a few microseconds, so an
eager step is bound by the host: the wrappers' Python, nanobind's argument import and the
launch. This times ``--calls`` back-to-back calls of each wrapper without waiting for the GPU
(host time per call), alternating the two argument paths of pydaemon/ops/_core_ext.py
(``set_fast_kernel_args``: DLPack capsules and the raw stream handle, or the plain path
through ``Tensor.__dlpack__``) for ``--rounds`` rounds; medians per path, and their ratio.
The sum over one layer's calls is what an eager step pays per layer on the host.

    PYTHONPATH=. python bench/bench_op_overhead.py --out /tmp/op_overhead.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.loadgen_env import environment, write_json  # noqa: E402


def build_calls(num_tokens: int, context: int) -> dict:
    """name -> zero-argument callable, on Llama-3-8B layer shapes (bf16, block 16)."""
    import torch

    from pydaemon import ops

    dev, bf16 = torch.device("cuda"), torch.bfloat16
    hidden, inter, heads, kv_heads, head_dim, block = 4096, 14336, 32, 8, 128, 16
    blocks_per_seq = -(-(context + num_tokens) // block)
    num_blocks = blocks_per_seq + 1
    x = torch.randn(num_tokens, hidden, dtype=bf16, device=dev)
    residual = torch.randn_like(x)
    weight = torch.ones(hidden, dtype=bf16, device=dev)
    gate_up = torch.randn(num_tokens, 2 * inter, dtype=bf16, device=dev)
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, dtype=bf16, device=dev)
    q = qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(
        num_tokens, kv_heads, head_dim
    )
    v = qkv[:, (heads + kv_heads) * head_dim :].view(num_tokens, kv_heads, head_dim)
    cache = torch.zeros(num_blocks, 2, kv_heads, block, head_dim, dtype=bf16, device=dev)
    key_cache, value_cache = cache[:, 0], cache[:, 1]
    cos = torch.ones(num_tokens, head_dim, dtype=torch.float32, device=dev)
    sin = torch.zeros_like(cos)
    slots = torch.arange(context, context + num_tokens, dtype=torch.int64, device=dev)
    block_tables = torch.arange(blocks_per_seq, dtype=torch.int32, device=dev).view(1, -1)
    seq_len = context + num_tokens
    seq_lens = torch.tensor([seq_len], dtype=torch.int32, device=dev)
    qsl = torch.tensor([0, num_tokens], dtype=torch.int32, device=dev)
    calls = {
        "fused_add_rms_norm": lambda: ops.fused_add_rms_norm(x, residual, weight, 1e-5),
        "rms_norm": lambda: ops.rms_norm(x, weight, 1e-5),
        "silu_and_mul": lambda: ops.silu_and_mul(gate_up),
        "rotary_embedding_and_cache": lambda: ops.rotary_embedding_and_cache(
            q, k, v, key_cache, value_cache, slots, cos, sin
        ),
        "paged_attention_prefill": lambda: ops.paged_attention_prefill(
            q, key_cache, value_cache, block_tables, seq_lens, qsl, num_tokens
        ),
        "per_token_fp8_quant": lambda: ops.per_token_fp8_quant(x),
    }
    if num_tokens == 1:
        calls["paged_attention_decode_tc"] = lambda: ops.paged_attention_decode_tc(
            q, key_cache, value_cache, block_tables, seq_lens, seq_len
        )
    return calls


def host_us_per_call(fn, calls: int) -> float:
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host / calls * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_op_overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--num-tokens", type=int, default=1, help="tokens per call (1: a decode row)")
    p.add_argument("--context", type=int, default=1024, help="keys already in the cache")
    p.add_argument("--calls", type=int, default=200, help="back-to-back calls per timing")
    p.add_argument("--rounds", type=int, default=7, help="alternating rounds per path")
    p.add_argument("--out", default=None, help="JSON file to write")
    args = p.parse_args(argv)
    from pydaemon import ops
    from pydaemon.ops import _core_ext

    if not ops.is_available():
        print(f"bench_op_overhead: {ops.unavailable_reason()}", file=sys.stderr)
        return 2
    calls = build_calls(args.num_tokens, args.context)
    paths = {"fast": True, "plain": False}
    times: dict[str, dict[str, list[float]]] = {n: {m: [] for m in paths} for n in calls}
    for name, fn in calls.items():
        for fast in paths.values():  # warm-up: lazy set-up, allocator
            _core_ext.set_fast_kernel_args(fast)
            host_us_per_call(fn, 20)
        for _ in range(args.rounds):
            for mode, fast in paths.items():
                _core_ext.set_fast_kernel_args(fast)
                times[name][mode].append(host_us_per_call(fn, args.calls))
    _core_ext.set_fast_kernel_args(True)
    results = {
        name: {
            **{f"{m}_us": statistics.median(v) for m, v in per.items()},
            "plain_over_fast": statistics.median(per["plain"]) / statistics.median(per["fast"]),
            "runs_us": per,
        }
        for name, per in times.items()
    }
    print(f"{'wrapper':28} {'fast us':>8} {'plain us':>9} {'plain/fast':>10}")
    for name, r in results.items():
        print(f"{name:28} {r['fast_us']:8.1f} {r['plain_us']:9.1f} {r['plain_over_fast']:10.2f}")
    if args.out:
        report = {"meta": {**environment(), "benchmark": "op_overhead"},
                  "config": vars(args), "results": results}  # fmt: skip
        write_json(args.out, report)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
