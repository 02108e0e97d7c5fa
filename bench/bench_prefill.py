"""Paged prefill attention vs torch SDPA's flash kernel (shapes: bench/README.md), TFLOP/s.

    PYTHONPATH=. python bench/bench_prefill.py --out bench/results/prefill.json
    # windowed prefill (Mistral-7B's 4096 window on 16k prompts; gpt-oss's 128 with sinks):
    PYTHONPATH=. python bench/bench_prefill.py --backend auto,mma --sliding-window 4096 \
        --q-lens 4096 16384 --tokens 16384 --decode-batches
    PYTHONPATH=. python bench/bench_prefill.py --backend mma,wgmma --heads 64 8 --head-dim 64 \
        --sliding-window 128 --sinks --q-lens 1024 4096 --decode-batches

FLOPs counted per call: 4 * head_dim * num_q_heads * (keys each query token sees), i.e. the
causal half only (a query at position p sees p + 1 keys, the cached prefix included). The
peer is aten's flash-attention forward (the kernel SDPA's flash backend runs) on the same
tokens stored contiguously, [batch, heads, len, head_dim], causal aligned to the lower right
(so a chunk after a cached prefix sees the whole prefix), grouped K/V heads passed as such.
``--sdpa-backends flash efficient cudnn`` also times torch SDPA on each backend alone (K/V
expanded to every query head) and reports the fastest peer, bench/README.md's bar.
A second table times decode steps (one query token per sequence) through the prefill kernel
against the split-KV decode kernel, to pick per shape. ``--kv-cache-dtype fp8``: the paged
cache is e4m3 (scale 1; decode bytes counted at 1 byte an element), the peer reads the
dequantized K/V in the query dtype. ``--backend auto,mma,wgmma``: the prefill kernels to time
(mma: each of --tiles; auto: the default tile; wgmma: each of --wgmma-block-n), each with its
x flash. ``--sliding-window W``: ours attend over each query's last W keys (tiles before the
window skipped), FLOPs count min(p + 1, W) keys at position p, and the peer is aten's flash
forward with window_size_left = W - 1; ``--sinks`` / ``--softcap C`` add those to ours only.
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
from pydaemon.ops.paged_prefill import wgmma_unavailable_reason  # noqa: E402
from pydaemon.quantization.kv_cache_fp8 import quantize_fp8  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def make_step(dtype, num_q_heads, num_kv_heads, head_dim, block_size, batch, prefix, q_len,
              kv_fp8=False):  # fmt: skip
    """A paged cache holding prefix + q_len tokens per sequence, shuffled block tables."""
    ctx = prefix + q_len
    blocks_per_seq = -(-ctx // block_size)
    num_blocks = batch * blocks_per_seq
    kv_cache = torch.randn(
        num_blocks, 1, 2, num_kv_heads, block_size, head_dim, device="cuda", dtype=dtype
    )
    if kv_fp8:
        kv_cache = quantize_fp8(kv_cache, 1.0)
    block_tables = torch.randperm(num_blocks, device="cuda").view(batch, blocks_per_seq).int()
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    starts = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * q_len
    query = torch.randn(batch * q_len, num_q_heads, head_dim, device="cuda", dtype=dtype)
    return kv_cache, block_tables, seq_lens, starts, query


def contiguous_kv(cache, block_tables, ctx, dtype):
    """[num_blocks, H, bs, D] paged -> [batch, H, ctx, D] contiguous, in ``dtype``."""
    g = cache[block_tables.long()]  # [batch, blocks, H, bs, D]
    b, nb, h, bs, d = g.shape
    return g.permute(0, 2, 1, 3, 4).reshape(b, h, nb * bs, d)[:, :, :ctx].to(dtype).contiguous()


def flash_peer(q4, k, v, scale, window=None):
    """aten flash forward, causal lower-right; GQA heads natively, else expanded K/V. With a
    window: aten's _flash_attention_forward with window_size_left = window - 1 (its layout
    [batch, len, heads, dim])."""

    def run(kk, vv):
        if window:
            out = torch.ops.aten._flash_attention_forward(
                q4.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2), None, None,
                q4.shape[2], kk.shape[2], 0.0, True, False, scale=scale,
                window_size_left=window - 1, window_size_right=0,
            )[0]  # fmt: skip
            return out.transpose(1, 2)
        return torch.ops.aten._scaled_dot_product_flash_attention(
            q4, kk, vv, 0.0, True, False, scale=scale
        )[0]

    try:
        run(k, v)
        return (lambda: run(k, v)), "flash (gqa native)"
    except RuntimeError:
        g = q4.shape[1] // k.shape[1]
        ke, ve = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        return (lambda: run(ke, ve)), "flash (kv expanded)"


SDPA_BACKENDS = ("flash", "efficient", "cudnn")


def sdpa_peers(q4, k, v, scale, prefix: int, names) -> dict:
    """name -> a call of torch SDPA on that backend alone (``sdpa_kernel``), causal aligned
    lower right (a chunk after a cached prefix sees it all), K/V expanded to every query head;
    backends that refuse the shape are left out."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    g = q4.shape[1] // k.shape[1]
    ke, ve = (k, v) if g == 1 else (k.repeat_interleave(g, 1), v.repeat_interleave(g, 1))
    mask = causal_lower_right(q4.shape[2], k.shape[2]) if prefix else None
    peers = {}
    for name in names:
        backend = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                   "cudnn": SDPBackend.CUDNN_ATTENTION}[name]  # fmt: skip

        def run(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q4, ke, ve, attn_mask=mask,
                                                      is_causal=mask is None, scale=scale)  # fmt: skip

        try:
            run()
        except RuntimeError:  # this backend does not take the shape (or the mask)
            continue
        peers[name] = run
    return peers


def bench_prefill_shape(dtype, hq, hkv, head_dim, block_size, batch, prefix, q_len, tiles,
                        kv_fp8=False, backends=("mma",), wgmma_block_n=(0,),
                        sdpa=(), mods=None):  # fmt: skip
    """Times the peer, the mma kernel at each tile (when "mma" is in backends), "auto" with
    the default tile and "wgmma" at each of wgmma_block_n; row keys f"{name}_..." with the
    names of other_runs. mods: the score modifiers ours get (sliding_window, softcap,
    sinks: True for random ones), or None."""
    mods = dict(mods or {})
    if mods.pop("sinks", False):
        mods["sinks"] = torch.randn(hq, device="cuda").to(dtype)
    window = mods.get("sliding_window")
    kv_cache, tables, seq_lens, starts, query = make_step(
        dtype, hq, hkv, head_dim, block_size, batch, prefix, q_len, kv_fp8
    )
    key_cache, value_cache = kv_cache[:, 0, 0], kv_cache[:, 0, 1]
    scale = head_dim**-0.5
    out = torch.empty_like(query)
    ctx = prefix + q_len
    k, v = (contiguous_kv(c, tables, ctx, dtype) for c in (key_cache, value_cache))
    q4 = query.view(batch, q_len, hq, head_dim).transpose(1, 2).contiguous()
    peer, peer_mode = flash_peer(q4, k, v, scale, window)
    ref = peer().transpose(1, 2).reshape(batch * q_len, hq, head_dim).float()
    if window:  # the query at position p sees min(p + 1, window) keys
        seen = torch.arange(prefix, ctx, dtype=torch.int64).add(1).clamp(max=window)
        keys_seen = batch * int(seen.sum())
    else:
        keys_seen = batch * (q_len * prefix + q_len * (q_len + 1) // 2)
    flops = 4 * head_dim * hq * keys_seen
    row = {"peer": peer_mode, "flops": flops}
    t_peer = bench_ms(peer)["median_ms"]
    row.update(peer_ms=t_peer, peer_tflops=flops / (t_peer * 1e9))
    # torch SDPA, each backend alone: the fastest is bench/README.md's bar (no window in SDPA's API)
    best_peer_ms = t_peer
    for name, call in sdpa_peers(q4, k, v, scale, prefix, () if window else sdpa).items():
        t = bench_ms(call)["median_ms"]
        row[f"sdpa_{name}_tflops"] = flops / (t * 1e9)
        best_peer_ms = min(best_peer_ms, t)
    row.update(best_peer_ms=best_peer_ms, best_peer_tflops=flops / (best_peer_ms * 1e9))
    best = None
    runs = [(tile, "mma", tile) for tile in tiles] if "mma" in backends else []
    runs += other_runs(backends, wgmma_block_n)
    for name, backend, tile in runs:
        bm, bn = (int(x) for x in tile.split("x"))

        def ours(bm=bm, bn=bn, backend=backend):
            ops.paged_attention_prefill(
                query, key_cache, value_cache, tables, seq_lens, starts, q_len,
                scale=scale, out=out, block_m=bm, block_n=bn, backend=backend, **mods,
            )  # fmt: skip

        out.fill_(float("nan"))
        ours()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        t = bench_ms(ours)["median_ms"]
        row[f"{name}_ms"] = t
        row[f"{name}_tflops"] = flops / (t * 1e9)
        row[f"{name}_rel_err_vs_peer"] = err
        row[f"{name}_x_peer"] = t_peer / t
        if backend == "mma" and (best is None or t < row[f"{best}_ms"]):
            best = name
    if best is not None:
        row.update(best_tile=best, mma_ms=row[f"{best}_ms"], mma_tflops=row[f"{best}_tflops"])
        row["mma_x_peer"] = t_peer / row["mma_ms"]
    fastest = min((n for n, _, _ in runs), key=lambda n: row[f"{n}_ms"])
    row.update(ours=fastest, ours_ms=row[f"{fastest}_ms"])
    row.update(ours_tflops=flops / (row["ours_ms"] * 1e9), speedup_vs_peer=t_peer / row["ours_ms"])
    row["speedup_vs_best_peer"] = best_peer_ms / row["ours_ms"]
    return row


def other_runs(backends, wgmma_block_n):
    """(name, backend, tile) of the runs besides the mma tiles: auto at the default tile,
    wgmma at each block_n (0 = its default, named plain "wgmma")."""
    runs = [("auto", "auto", "0x0")] if "auto" in backends else []
    if "wgmma" in backends:
        runs += [
            ("wgmma" if bn == 0 else f"wgmma-k{bn}", "wgmma", f"0x{bn}") for bn in wgmma_block_n
        ]
    return runs


def bench_decode_shape(dtype, hq, hkv, head_dim, block_size, batch, ctx, tile, kv_fp8=False):
    kv_cache, tables, seq_lens, starts, query = make_step(
        dtype, hq, hkv, head_dim, block_size, batch, ctx - 1, 1, kv_fp8
    )
    key_cache, value_cache = kv_cache[:, 0, 0], kv_cache[:, 0, 1]
    out_p, out_d = torch.empty_like(query), torch.empty_like(query)

    bm, bn = (int(x) for x in tile.split("x"))

    def via_prefill():
        ops.paged_attention_prefill(
            query, key_cache, value_cache, tables, seq_lens, starts, 1, out=out_p,
            block_m=bm, block_n=bn,
        )  # fmt: skip

    def via_decode():
        ops.paged_attention_decode(query, key_cache, value_cache, tables, seq_lens, ctx, out=out_d)

    via_prefill(), via_decode()
    err = ((out_p.float() - out_d.float()).norm() / out_d.float().norm()).item()
    num_bytes = 2 * batch * ctx * hkv * head_dim * kv_cache.element_size() + 2 * query.numel() * 2
    t_p, t_d = bench_ms(via_prefill)["median_ms"], bench_ms(via_decode)["median_ms"]
    return {"prefill_kernel_ms": t_p, "decode_kernel_ms": t_d, "bytes": num_bytes,
            "prefill_kernel_gbs": num_bytes / (t_p * 1e6),
            "decode_kernel_gbs": num_bytes / (t_d * 1e6), "rel_diff": err}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="JSON output path")
    ap.add_argument("--commit", default=None, help="commit to record (default: git HEAD)")
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--q-lens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    ap.add_argument("--tokens", type=int, default=16384, help="new tokens per call (batch = "
                    "tokens // q_len, at least 1)")  # fmt: skip
    ap.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("HQ", "HKV"))
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--tiles", nargs="+", default=["128x64", "128x32", "64x64"],
                    help="block_m x block_n shapes of the prefill kernel to time")  # fmt: skip
    ap.add_argument("--backend", default="mma",
                    help="comma list of prefill backends to time: auto, mma (each of --tiles), "
                    "wgmma (Hopper, sm_90a build)")  # fmt: skip
    ap.add_argument("--wgmma-block-n", type=int, nargs="+", default=[0],
                    help="key tiles of the wgmma kernel to time (0 = its default; 64, 128)")  # fmt: skip
    ap.add_argument("--sdpa-backends", nargs="*", default=[], choices=SDPA_BACKENDS,
                    help="also time torch SDPA on each of these backends alone (K/V expanded): "
                    "rows get sdpa_<name>_tflops, best_peer_tflops and speedup_vs_best_peer")  # fmt: skip
    ap.add_argument("--decode-heads", nargs="*", default=["32/8", "32/32"])
    ap.add_argument("--decode-batches", type=int, nargs="*", default=[8, 32, 64, 256])
    ap.add_argument("--decode-contexts", type=int, nargs="*", default=[512, 4096, 16384])
    ap.add_argument("--decode-tile", default="64x64", help="prefill-kernel tile for decodes")
    ap.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                    help="fp8: the paged cache in e4m3 (scale 1)")  # fmt: skip
    ap.add_argument("--sliding-window", type=int, default=None,
                    help="ours (and the flash peer) attend over each query's last W keys")  # fmt: skip
    ap.add_argument("--softcap", type=float, default=None, help="logit soft-cap for ours")
    ap.add_argument("--sinks", action="store_true", help="attention sinks for ours (random)")
    args = ap.parse_args()
    mods = {"sliding_window": args.sliding_window, "softcap": args.softcap, "sinks": args.sinks}
    if not ops.is_available():
        sys.exit(f"GPU kernels unavailable: {ops.unavailable_reason()}")
    hq, hkv = args.heads
    kv_fp8 = args.kv_cache_dtype == "fp8"
    backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    if not backends or any(b not in ("auto", "mma", "wgmma") for b in backends):
        sys.exit(f"--backend: a comma list of auto, mma, wgmma; got {args.backend!r}")
    if "wgmma" in backends:
        why = wgmma_unavailable_reason(args.head_dim, kv_fp8)
        if why is not None:
            sys.exit(f"--backend wgmma: {why}")
    rows, decode_rows = [], []
    # columns: one per mma tile, then one per other backend; x flash per backend
    others = [name for name, _, _ in other_runs(backends, args.wgmma_block_n)]
    names = (list(args.tiles) if "mma" in backends else []) + others
    x_names = (["mma"] if "mma" in backends else []) + others
    tile_hdr = " ".join(f"{n + ' TF':>10}" for n in names)
    x_hdr = " ".join(f"{'x ' + n:>8}" for n in x_names)
    print(f"{'dtype':5} {'q_len':>5} {'prefix':>6} {'batch':>5} {tile_hdr} {'peer TF':>8} "
          f"{x_hdr} {'err':>8}", flush=True)  # fmt: skip
    for dname in args.dtypes:
        for q_len in args.q_lens:
            for prefix in (0, q_len):
                batch = max(1, args.tokens // q_len)
                r = bench_prefill_shape(DTYPES[dname], hq, hkv, args.head_dim, args.block_size,
                                        batch, prefix, q_len, args.tiles, kv_fp8,
                                        backends, args.wgmma_block_n,
                                        args.sdpa_backends, mods)  # fmt: skip
                r.update(dtype=dname, q_len=q_len, prefix=prefix, batch=batch,
                         kv_cache_dtype=args.kv_cache_dtype,
                         num_q_heads=hq, num_kv_heads=hkv, head_dim=args.head_dim,
                         block_size=args.block_size, sliding_window=args.sliding_window,
                         softcap=args.softcap, sinks=args.sinks)  # fmt: skip
                rows.append(r)
                tf = " ".join(f"{r[f'{n}_tflops']:10.1f}" for n in names)
                xs = " ".join(f"{r[f'{n}_x_peer']:8.2f}" for n in x_names)
                err = max(r[f"{n}_rel_err_vs_peer"] for n in names)
                print(f"{dname:5} {q_len:5} {prefix:6} {batch:5} {tf} "
                      f"{r['peer_tflops']:8.1f} {xs} {err:8.1e}"
                      f"  [{r['peer']}; best SDPA {r['best_peer_tflops']:.1f} TF, ours "
                      f"{r['speedup_vs_best_peer']:.2f}x]", flush=True)  # fmt: skip
    if args.decode_batches:
        print(
            f"\ndecode steps (bf16): prefill kernel ({args.decode_tile}) vs split-KV decode kernel"
        )
        print(f"{'heads':6} {'batch':>5} {'ctx':>6} {'prefill us':>10} {'GB/s':>6} "
              f"{'decode us':>10} {'GB/s':>6} {'diff':>8}")  # fmt: skip
    for heads in args.decode_heads:
        dq, dkv = (int(x) for x in heads.split("/"))
        for batch in args.decode_batches:
            for ctx in args.decode_contexts:
                if 2 * batch * ctx * dkv * args.head_dim * 2 > 40e9:
                    continue  # over 40 GB of K/V
                d = bench_decode_shape(torch.bfloat16, dq, dkv, args.head_dim, args.block_size,
                                       batch, ctx, args.decode_tile, kv_fp8)  # fmt: skip
                d.update(heads=heads, batch=batch, context=ctx, tile=args.decode_tile,
                         kv_cache_dtype=args.kv_cache_dtype)  # fmt: skip
                decode_rows.append(d)
                print(f"{heads:6} {batch:5} {ctx:6} {d['prefill_kernel_ms'] * 1e3:10.1f} "
                      f"{d['prefill_kernel_gbs']:6.0f} {d['decode_kernel_ms'] * 1e3:10.1f} "
                      f"{d['decode_kernel_gbs']:6.0f} {d['rel_diff']:8.1e}", flush=True)  # fmt: skip
    result = {
        "benchmark": "paged prefill attention",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "commit": args.commit or git_commit(),
        "command": " ".join(sys.argv),
        "torch": torch.__version__,
        "rows": rows,
        "decode_rows": decode_rows,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
