"""The rotary embedding fused with the KV-cache write against the two kernels it replaces
(``rotary_embedding`` then ``reshape_and_cache``), on one layer of a model shape, GB/s.

    PYTHONPATH=. python bench/bench_rotary_cache.py --out bench/results/rotary_cache.json

Shape: Llama-3-8B (32 query heads, 8 KV heads, head dim 128), q/k/v as views of the fused QKV
output, block size 16, one slot per token in a shuffled cache. Bytes counted for the fused
kernel: q and k read and written, v read, k and v written to the cache (1 byte an element
for ``--kv-cache-dtype fp8``), cos and sin read; the separate pair moves k through memory
once more. Both report the fused kernel's byte count, so GB/s compare as time ratios.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.bench_attention import git_commit  # noqa: E402
from bench.timing import bench_ms  # noqa: E402
from pydaemon import ops  # noqa: E402
from pydaemon.quantization.kv_cache_fp8 import FP8_DTYPE  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def make_inputs(num_tokens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, kv_fp8):
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, device="cuda", dtype=dtype)
    q, k, v = (t.view(num_tokens, -1, head_dim) for t in qkv.split([q_size, kv_size, kv_size], -1))
    num_blocks = -(-num_tokens // block_size) + 1
    kv_cache = torch.randn(num_blocks, 1, 2, num_kv_heads, block_size, head_dim, device="cuda")
    kv_cache = kv_cache.to(FP8_DTYPE if kv_fp8 else dtype)
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:num_tokens]
    pos = torch.arange(num_tokens, device="cuda", dtype=torch.float32)[:, None]
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device="cuda") / head_dim))
    emb = torch.cat([pos * inv_freq, pos * inv_freq], dim=-1)
    return q, k, v, kv_cache[:, 0, 0], kv_cache[:, 0, 1], slots, emb.cos(), emb.sin()


def fused_bytes(num_tokens, num_q_heads, num_kv_heads, head_dim, elem, cache_elem) -> int:
    qk = (num_q_heads + num_kv_heads) * head_dim * elem * 2  # read + write in place
    v = num_kv_heads * head_dim * elem
    cache = 2 * num_kv_heads * head_dim * cache_elem
    return num_tokens * (qk + v + cache + 2 * head_dim * 4 + 8)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    parser.add_argument("--tokens", default="1,8,64,256,512,2048,8192")
    parser.add_argument("--heads", default="32,8,128", help="num_q_heads,num_kv_heads,head_dim")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not ops.is_available():
        print(f"needs the CUDA kernels: {ops.unavailable_reason()}")
        return 1
    dtype, kv_fp8 = DTYPES[args.dtype], args.kv_cache_dtype == "fp8"
    hq, hk, d = (int(x) for x in args.heads.split(","))
    rows = []
    for t in (int(x) for x in args.tokens.split(",")):
        q, k, v, kc, vc, slots, cos, sin = make_inputs(t, hq, hk, d, 16, dtype, kv_fp8)

        def separate(q=q, k=k, v=v, kc=kc, vc=vc, slots=slots, cos=cos, sin=sin):
            ops.rotary_embedding(q, k, cos, sin)
            ops.reshape_and_cache(k, v, kc, vc, slots)

        def fused(q=q, k=k, v=v, kc=kc, vc=vc, slots=slots, cos=cos, sin=sin):
            ops.rotary_embedding_and_cache(q, k, v, kc, vc, slots, cos, sin)

        num_bytes = fused_bytes(t, hq, hk, d, dtype.itemsize, 1 if kv_fp8 else dtype.itemsize)
        sep_ms, fused_ms = bench_ms(separate)["median_ms"], bench_ms(fused)["median_ms"]
        rows.append({"num_tokens": t, "separate_us": sep_ms * 1e3, "fused_us": fused_ms * 1e3,
                     "fused_gbs": num_bytes / fused_ms / 1e6, "speedup": sep_ms / fused_ms})  # fmt: skip
    print(f"{args.dtype}, kv cache {args.kv_cache_dtype}, heads {hq}/{hk}, head_dim {d}")
    print(f"{'tokens':>7} {'separate us':>12} {'fused us':>9} {'fused GB/s':>11} {'speedup':>8}")
    for r in rows:
        print(f"{r['num_tokens']:>7} {r['separate_us']:>12.2f} {r['fused_us']:>9.2f} "
              f"{r['fused_gbs']:>11.0f} {r['speedup']:>8.2f}")  # fmt: skip
    if args.out:
        meta = {"commit": git_commit(), "date": datetime.date.today().isoformat(),
                "device": torch.cuda.get_device_name(), "dtype": args.dtype,
                "kv_cache_dtype": args.kv_cache_dtype, "heads": [hq, hk, d]}  # fmt: skip
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
