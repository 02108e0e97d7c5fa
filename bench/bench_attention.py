"""Paged decode attention vs the device copy bandwidth and torch SDPA (shapes: bench/README.md).

    PYTHONPATH=. python bench/bench_attention.py --out bench/results/attention.json
    # the decode kernels side by side (GQA 32/8 and 32/4, bf16 and fp8 caches):
    PYTHONPATH=. python bench/bench_attention.py --kernel all --heads gqa32/8 gqa32/4 \
        --kv-cache-dtype auto fp8 --batches 1 8 32 64 256 [--quick]
    # windowed decode (Mistral-7B: 4096; gpt-oss: 128 with sinks, head 64), against the same
    # context without a window and SDPA over the window's keys:
    PYTHONPATH=. python bench/bench_attention.py --kernel tc --heads gqa32/8 \
        --sliding-window 4096 --contexts 4096 16384 32768 --batches 1 8 64
    PYTHONPATH=. python bench/bench_attention.py --kernel tc --heads gqa64/8 --head-dim 64 \
        --sliding-window 128 --sinks --contexts 1024 8192 --batches 1 64 256

Kernels (``--kernel``): ``decode`` = the CUDA-core split-KV kernel (ops.paged_attention_decode),
``tc`` = the tensor-core GQA decode kernel (ops.paged_attention_decode_tc, default partition
rule), ``prefill`` = the prefill kernel with 64-row tiles (the former GQA decode route),
``all`` = the three; ``--tc-partition-sizes 256 1024`` adds ``tc@256``, ``tc@1024`` (forced
partition sizes, to tune ops.decode_tc_partition_size). The first kernel listed is "ours" in
the JSON; every kernel's time, GB/s and share of the copy bandwidth are recorded.

Bytes counted per call: every K and V element of every sequence read once, plus the queries
and the outputs. The SDPA peer reads the same K/V stored contiguously ([batch, kv_heads,
context, head_dim]), with enable_gqa for grouped heads. ``--kv-cache-dtype fp8``: our cache is
e4m3 (1 byte an element, counted so); the peer reads the dequantized K/V in the query dtype.
``--sliding-window W``: our kernels skip the keys before the window (counted: min(context, W)
keys a sequence), the peer attends over the last W keys; ``--sinks`` / ``--softcap C`` add the
other score modifiers to ours (the peer has none: its error column is then not comparable).
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.timing import bench_ms, copy_bandwidth_gbs  # noqa: E402
from pydaemon import ops  # noqa: E402
from pydaemon.quantization.kv_cache_fp8 import quantize_fp8  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
HEADS = {"gqa32/8": (32, 8), "gqa32/4": (32, 4), "mha32/32": (32, 32),
         "gqa64/8": (64, 8), "gqa32/16": (32, 16), "gqa16/8": (16, 8)}  # fmt: skip
# gqa64/8: gpt-oss (head 64); gqa32/16: Gemma-3-27B (head 128); gqa16/8: Gemma-2-9B (head 256)
KERNELS = ("decode", "tc", "prefill")


def git_commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def bench_shape(
    dtype, num_q_heads, num_kv_heads, batch, ctx, head_dim, block_size, kv_fp8, kernels, copy_gbs,
    mods=None,
):  # fmt: skip
    """mods: the score modifiers ours get (sliding_window, softcap, sinks), or None."""
    mods = dict(mods or {})
    if mods.pop("sinks", False):
        mods["sinks"] = torch.randn(num_q_heads, device="cuda").to(dtype)
    window = mods.get("sliding_window")
    keys = min(ctx, window) if window else ctx  # what a sequence's decode reads
    blocks_per_seq = ctx // block_size
    num_blocks = batch * blocks_per_seq
    kv_cache = torch.randn(
        num_blocks, 1, 2, num_kv_heads, block_size, head_dim, device="cuda", dtype=dtype
    )
    block_tables = torch.randperm(num_blocks, device="cuda").view(batch, blocks_per_seq).int()
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    starts = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    query = torch.randn(batch, num_q_heads, head_dim, device="cuda", dtype=dtype)
    out = torch.empty_like(query)
    if kv_fp8:
        kv_cache = quantize_fp8(kv_cache, 1.0)
    kv_bytes = kv_cache.element_size()
    key_cache, value_cache = kv_cache[:, 0, 0], kv_cache[:, 0, 1]
    args = (query, key_cache, value_cache, block_tables, seq_lens)
    calls = {
        "decode": lambda: ops.paged_attention_decode(*args, ctx, out=out, **mods),
        "tc": lambda: ops.paged_attention_decode_tc(*args, ctx, out=out, **mods),
        "prefill": lambda: ops.paged_attention_prefill(
            *args, starts, 1, out=out, block_m=64, block_n=64, **mods
        ),
    }
    for name in kernels:  # "tc@P": the tensor-core kernel with P keys per partition
        if name.startswith("tc@"):
            size = int(name[3:])
            calls[name] = lambda size=size: ops.paged_attention_decode_tc(
                *args, ctx, out=out, partition_size=size, **mods
            )

    # The same K/V, contiguous: [batch, num_kv_heads, ctx, head_dim].
    def contiguous(cache):
        g = cache[block_tables.long()]  # [batch, blocks, heads, bs, D]
        return g.permute(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, ctx, head_dim).to(dtype)

    # The window's keys only: the peer reads what ours does.
    k, v = contiguous(key_cache)[:, :, ctx - keys :], contiguous(value_cache)[:, :, ctx - keys :]
    q4 = query.unsqueeze(2)  # [batch, num_q_heads, 1, head_dim]
    gqa = num_q_heads != num_kv_heads

    def sdpa():
        return F.scaled_dot_product_attention(q4, k, v, enable_gqa=gqa)

    ref = sdpa().squeeze(2).float()
    t_sdpa = bench_ms(sdpa)
    num_bytes = 2 * batch * keys * num_kv_heads * head_dim * kv_bytes + 2 * query.numel() * 2
    row = {
        "bytes": num_bytes,
        "sdpa_ms": t_sdpa["median_ms"],
        "sdpa_gbs": num_bytes / (t_sdpa["median_ms"] * 1e6),
    }
    if "tc" in kernels:
        span = ops.decode_span(ctx, window, 16)
        row["tc_partition_size"] = ops.decode_tc_partition_size(batch, num_kv_heads, span, kv_fp8)
    for name in kernels:
        out.fill_(float("nan"))
        calls[name]()
        t = bench_ms(calls[name])
        gbs = num_bytes / (t["median_ms"] * 1e6)
        row.update({
            f"{name}_ms": t["median_ms"], f"{name}_min_ms": t["min_ms"], f"{name}_gbs": gbs,
            f"{name}_fraction_of_copy_bw": gbs / copy_gbs,
            f"{name}_rel_err_vs_sdpa": ((out.float() - ref).norm() / ref.norm()).item(),
        })  # fmt: skip
    ours = kernels[0]
    row.update(
        ours_kernel=ours,
        ours_ms=row[f"{ours}_ms"],
        ours_min_ms=row[f"{ours}_min_ms"],
        ours_gbs=row[f"{ours}_gbs"],
        speedup_vs_sdpa=t_sdpa["median_ms"] / row[f"{ours}_ms"],
        rel_err_vs_sdpa=row[f"{ours}_rel_err_vs_sdpa"],
        fraction_of_copy_bw=row[f"{ours}_fraction_of_copy_bw"],
    )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="JSON output path")
    ap.add_argument("--commit", default=None, help="commit to record (default: git HEAD)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 4096, 16384])
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--heads", nargs="+", default=list(HEADS), choices=list(HEADS))
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-cache-dtype", nargs="+", choices=("auto", "fp8"), default=["auto"],
                    help="fp8: the paged cache in e4m3 (scale 1); several: each in turn")  # fmt: skip
    ap.add_argument("--kernel", nargs="+", default=["decode"], choices=(*KERNELS, "all"),
                    help="decode kernels to time (the first is 'ours'); all = "
                    + " ".join(KERNELS))  # fmt: skip
    ap.add_argument("--tc-partition-sizes", type=int, nargs="*", default=[],
                    help="also time the tensor-core kernel with these partition sizes "
                    "(multiples of 64), to tune decode_tc_partition_size")  # fmt: skip
    ap.add_argument("--quick", action="store_true",
                    help="contexts 1024 and 16384 only, batches 1 8 64 256")  # fmt: skip
    ap.add_argument("--max-gb", type=float, default=90.0, help="skip shapes whose two K/V "
                    "copies (paged + contiguous) exceed this many GB")  # fmt: skip
    ap.add_argument("--sliding-window", type=int, default=None,
                    help="our kernels attend over the last W keys (skipping the others)")  # fmt: skip
    ap.add_argument("--softcap", type=float, default=None, help="logit soft-cap for ours")
    ap.add_argument("--sinks", action="store_true", help="attention sinks for ours (random)")
    args = ap.parse_args()
    if not ops.is_available():
        sys.exit(f"GPU kernels unavailable: {ops.unavailable_reason()}")
    kernels = list(KERNELS) if "all" in args.kernel else list(dict.fromkeys(args.kernel))
    kernels += [f"tc@{p}" for p in args.tc_partition_sizes]
    if args.quick:
        args.contexts, args.batches = [1024, 16384], [1, 8, 64, 256]

    mods = {"sliding_window": args.sliding_window, "softcap": args.softcap, "sinks": args.sinks}
    copy = copy_bandwidth_gbs()
    print(f"device copy bandwidth: {copy['gbs']:.0f} GB/s (read + write)", flush=True)
    rows = []
    cols = " ".join(f"{k + ' us':>10} {'%copy':>6}" for k in kernels)
    print(f"{'dtype':5} {'kv':4} {'heads':9} {'batch':>5} {'ctx':>6} {cols} {'sdpa us':>9} "
          f"{'part':>5} {'err':>8}", flush=True)  # fmt: skip
    for kv_dtype in args.kv_cache_dtype:
        for dname in args.dtypes:
            for hname in args.heads:
                hq, hkv = HEADS[hname]
                for batch in args.batches:
                    for ctx in args.contexts:
                        kv_gb = 2 * batch * ctx * hkv * args.head_dim * 2 * 2 / 1e9
                        if kv_gb > args.max_gb:
                            print(f"{dname:5} {hname:9} {batch:5} {ctx:6}   skipped "
                                  f"({kv_gb:.0f} GB of K/V copies)", flush=True)  # fmt: skip
                            continue
                        torch.cuda.empty_cache()  # the previous shape's tensors are gone
                        r = bench_shape(DTYPES[dname], hq, hkv, batch, ctx, args.head_dim,
                                        args.block_size, kv_dtype == "fp8", kernels,
                                        copy["gbs"], mods)  # fmt: skip
                        r.update(dtype=dname, heads=hname, num_q_heads=hq, num_kv_heads=hkv,
                                 batch=batch, context=ctx, head_dim=args.head_dim,
                                 block_size=args.block_size, kv_cache_dtype=kv_dtype,
                                 sliding_window=args.sliding_window, softcap=args.softcap,
                                 sinks=args.sinks)  # fmt: skip
                        rows.append(r)
                        times = " ".join(
                            f"{r[k + '_ms'] * 1e3:10.1f} {100 * r[k + '_fraction_of_copy_bw']:5.1f}%"
                            for k in kernels
                        )
                        print(f"{dname:5} {kv_dtype:4} {hname:9} {batch:5} {ctx:6} {times} "
                              f"{r['sdpa_ms'] * 1e3:9.1f} {r.get('tc_partition_size', 0):5} "
                              f"{r['rel_err_vs_sdpa']:8.1e}", flush=True)  # fmt: skip
    result = {
        "benchmark": "paged decode attention",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "commit": args.commit or git_commit(),
        "command": " ".join(sys.argv),
        "torch": torch.__version__,
        "partition_size": ops.PARTITION_SIZE,
        "kernels": kernels,
        "copy_bandwidth": copy,
        "rows": rows,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
