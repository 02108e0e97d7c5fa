"""The Hopper (wgmma, sm_90a) prefill kernel against the float64 reference and the mma.sync
kernel, on the cases of test_prefill_kernel.py; skipped unless this build has the kernel and
the GPU is compute capability 9.0.

A failure names the case and where the error sits (sequence, token, head, dims), since the
usual wgmma bugs have signatures: only dims 64..127 wrong -> the V slab stride (LBO); every
row g + 8 wrong -> accumulator / A-fragment layout; errors in every 8th key or scattered
over all dims -> the 128-byte swizzle; only rows past 64 of a tile -> the second warpgroup.
"""

from __future__ import annotations

import pytest
import torch

from pydaemon import ops
from pydaemon.ops.paged_prefill import wgmma_unavailable_reason

from .kv_factory import make_paged_batch, reference_prefill
from .test_prefill_kernel import CHUNKS, HEADS, TOL, run_prefill


@pytest.fixture(autouse=True)
def _needs_wgmma() -> None:
    why = wgmma_unavailable_reason(128)
    if why is not None:
        pytest.skip(why)


def describe_error(out, ref, query_lens, group) -> str:
    """Where the largest errors of out vs ref sit: per sequence relative error, the worst
    element (sequence, token, head, dim), and which dims / row parities / heads are bad."""
    err = (out.double() - ref).abs()  # [T, Hq, D]
    scale = ref.abs().max().clamp_min(1e-30)
    bad = err > 0.05 * scale
    lines = []
    start = 0
    for s, q_len in enumerate(query_lens):
        o, r = out[start : start + q_len].double(), ref[start : start + q_len]
        rel = ((o - r).norm() / r.norm().clamp_min(1e-30)).item()
        lines.append(f"  seq {s} (query_len {q_len}): relative error {rel:.2e}")
        start += q_len
    flat = int(err.argmax())
    t, h, d = (
        flat // (err.shape[1] * err.shape[2]),
        (flat // err.shape[2]) % err.shape[1],
        flat % err.shape[2],
    )
    lines.append(
        f"  worst |err| {err.max().item():.3e} at token {t}, head {h}, dim {d} "
        f"(got {out[t, h, d].item():.4f}, want {ref[t, h, d].item():.4f})"
    )
    if bad.any():
        dims = bad.any(0).any(0).nonzero().flatten().tolist()
        heads = bad.any(0).any(1).nonzero().flatten().tolist()
        # packed row of (token, head) in its sequence: token * group + head % group
        tok, hd = bad.any(2).nonzero(as_tuple=True)
        local = torch.cat([torch.arange(q, device=tok.device) for q in query_lens])
        rows = local[tok] * group + hd % group
        lines.append(
            f"  {bad.sum().item()} elements off by > 5% of max|ref|: dims {dims[:8]}.."
            f"{dims[-4:]} ({len(dims)} of {err.shape[2]}), heads {heads}, packed rows mod 16 "
            f"{sorted(set((rows % 16).tolist()))}, tile-row half (row % 128 >= 64) "
            f"{sorted(set(((rows % 128) >= 64).tolist()))}"
        )
    return "\n".join(lines)


def check(out, ref, query_lens, tol, case: str, group: int) -> None:
    nan = torch.isnan(out)
    assert not nan.any(), (
        f"{case}: NaN in output at tokens {nan.any(2).any(1).nonzero()[:8].flatten().tolist()}"
    )
    start = 0
    for q_len in query_lens:
        o, r = out[start : start + q_len].double(), ref[start : start + q_len]
        if ((o - r).norm() / r.norm()) >= tol:
            pytest.fail(
                f"{case}: error over {tol:g}\n" + describe_error(out, ref, query_lens, group)
            )
        start += q_len


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"q{h[0]}kv{h[1]}")
@pytest.mark.parametrize("block_n", [64, 128], ids=lambda n: f"keys{n}")
def test_wgmma_matches_reference_and_mma(dtype, head_dim, block_size, heads, block_n):
    """Cached prefixes of 0..many blocks, unaligned chunks, decode rows, GQA 1/4/8, shuffled
    block tables, both key tiles; equal to float64 and, within the same tolerance, to the
    mma.sync kernel."""
    case = f"{dtype} head {head_dim} block {block_size} heads {heads} block_n {block_n}"
    torch.manual_seed(0)
    out, query, batch, query_lens = run_prefill(CHUNKS, heads, head_dim, block_size, dtype,
                                                tile=(0, block_n), backend="wgmma")  # fmt: skip
    ref = reference_prefill(query, batch, query_lens, head_dim**-0.5)
    group = heads[0] // heads[1]
    check(out, ref, query_lens, TOL[dtype], f"wgmma vs float64, {case}", group)
    mma = torch.full_like(out, float("nan"))
    ops.paged_attention_prefill(
        query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
        torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32).cuda(),
        max(query_lens), out=mma, backend="mma",
    )  # fmt: skip
    check(out, mma.double(), query_lens, TOL[dtype], f"wgmma vs mma, {case}", group)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_wgmma_16k_prompt_and_long_chunk_after_prefix(dtype):
    """The default tile at this length is 128 keys (prefill_wgmma_block_n)."""
    chunks = [(0, 16384), (6000, 3001), (2, 1)]
    out, query, batch, query_lens = run_prefill(chunks, (16, 4), 128, 16, dtype, backend="wgmma")
    ref = reference_prefill(query, batch, query_lens, 128**-0.5)
    check(out, ref, query_lens, TOL[dtype], f"16k prompt {dtype}", 4)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("block_n", [64, 128], ids=lambda n: f"keys{n}")
def test_wgmma_ignores_nan_past_the_end(block_size, block_n):
    """Every cache slot that holds no token of a sequence (its last block's tail, unused
    blocks) filled with NaN: the kernel loads whole pages, and none of it reaches the output."""
    chunks = [(0, 17), (37, 129), (3, 513), (250, 1), (0, 128)]
    torch.manual_seed(2)
    query_lens = [q for _, q in chunks]
    batch = make_paged_batch([p + q for p, q in chunks], 4, 128, block_size, torch.bfloat16)
    holds_token = torch.zeros(batch.kv_cache.shape[0], block_size, dtype=torch.bool)
    tables = batch.block_tables.cpu()
    for s, n in enumerate(batch.seq_lens_cpu):
        for t in range(n):
            holds_token[tables[s, t // block_size], t % block_size] = True
    slots = batch.kv_cache.permute(0, 4, 1, 2, 3, 5)  # [blocks, slot, layer, k/v, head, dim]
    slots[~holds_token.cuda()] = float("nan")
    query = torch.randn(sum(query_lens), 16, 128, device="cuda", dtype=torch.bfloat16)
    starts = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    out = ops.paged_attention_prefill(
        query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
        starts.cuda(), max(query_lens), block_n=block_n, backend="wgmma",
    )  # fmt: skip
    ref = reference_prefill(query, batch, query_lens, 128**-0.5)
    check(out, ref, query_lens, TOL[torch.bfloat16], f"NaN past the end, block {block_size}", 4)


@pytest.mark.parametrize("heads", [(12, 4), (40, 4), (24, 1)], ids=lambda h: f"q{h[0]}kv{h[1]}")
def test_wgmma_odd_group_sizes(heads):
    """Groups of 3, 10 and 24: a token's packed rows straddle warpgroups and tiles."""
    out, query, batch, query_lens = run_prefill(CHUNKS, heads, 128, 16, torch.bfloat16,
                                                backend="wgmma")  # fmt: skip
    ref = reference_prefill(query, batch, query_lens, 128**-0.5)
    check(out, ref, query_lens, TOL[torch.bfloat16], f"heads {heads}", heads[0] // heads[1])


def test_wgmma_decode_only_step():
    """A step of single tokens (max_query_len 1) forced onto wgmma still matches float64."""
    chunks = [(n - 1, 1) for n in (1, 16, 17, 300, 2049)]
    out, query, batch, query_lens = run_prefill(chunks, (32, 8), 128, 16, torch.bfloat16,
                                                backend="wgmma")  # fmt: skip
    ref = reference_prefill(query, batch, query_lens, 128**-0.5)
    check(out, ref, query_lens, TOL[torch.bfloat16], "decode-only step", 4)


def test_wgmma_flags_bad_metadata_with_nan():
    """max_query_len understated, or a query longer than its context: NaN rows, as mma."""
    out, *_ = run_prefill([(0, 200), (10, 5)], (8, 2), 128, 16, torch.float16,
                          max_query_len=64, backend="wgmma")  # fmt: skip
    assert torch.isnan(out[64:200]).all() and not torch.isnan(out[:64]).any()
    assert not torch.isnan(out[200:]).any()
    batch = make_paged_batch([4], 2, 128, 16, torch.float16)
    query = torch.randn(6, 8, 128, device="cuda", dtype=torch.float16)
    starts = torch.tensor([0, 6], dtype=torch.int32, device="cuda")
    out = ops.paged_attention_prefill(
        query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens, starts, 6,
        backend="wgmma",
    )  # fmt: skip
    assert torch.isnan(out).all()


@pytest.mark.parametrize(
    "chunks,expect",
    [([(0, 600), (40, 64), (9, 1)], "wgmma"), ([(0, 511), (5, 1)], "mma")],
    ids=["prefill-uses-wgmma", "short-uses-mma"],
)
def test_auto_backend_choice(chunks, expect):
    """auto = wgmma at head 128 for max_query_len >= 512 (bit-identical to forcing it), else
    mma; both kernels are deterministic, and they differ in rounding."""
    torch.manual_seed(1)
    query_lens = [q for _, q in chunks]
    batch = make_paged_batch([p + q for p, q in chunks], 4, 128, 16, torch.bfloat16)
    query = torch.randn(sum(query_lens), 16, 128, device="cuda", dtype=torch.bfloat16)
    starts = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    args = (query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
            starts.cuda(), max(query_lens))  # fmt: skip
    outs = {b: ops.paged_attention_prefill(*args, backend=b) for b in ("auto", "mma", "wgmma")}
    other = "mma" if expect == "wgmma" else "wgmma"
    assert torch.equal(outs["auto"], outs[expect])
    assert not torch.equal(outs["auto"], outs[other])


def test_wgmma_rejects_what_it_cannot_run():
    batch = make_paged_batch([10, 20], 2, 96, 16, torch.float16)
    query = torch.randn(30, 4, 96, device="cuda", dtype=torch.float16)
    starts = torch.tensor([0, 10, 30], dtype=torch.int32, device="cuda")
    args = (batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens, starts, 20)
    with pytest.raises(ValueError, match="backend 'wgmma' is unavailable: .*head_dim 64 and 128"):
        ops.paged_attention_prefill(query, *args, backend="wgmma")
    batch = make_paged_batch([10, 20], 2, 128, 16, torch.float16)
    query = torch.randn(30, 4, 128, device="cuda", dtype=torch.float16)
    args = (batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens, starts, 20)
    with pytest.raises(ValueError, match="128 x 32 is not built for backend 'wgmma'"):
        ops.paged_attention_prefill(query, *args, block_m=128, block_n=32, backend="wgmma")
    with pytest.raises(ValueError, match="backend must be one of"):
        ops.paged_attention_prefill(query, *args, backend="fa3")
    fp8 = batch.key_cache.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="backend 'wgmma' is unavailable: .*not fp8"):
        ops.paged_attention_prefill(query, fp8, fp8, *args[2:], backend="wgmma")
