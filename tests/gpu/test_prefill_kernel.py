"""Paged prefill kernel against a float64 torch reference (fresh random inputs, poisoned out)."""

from __future__ import annotations

import pytest
import torch

from pydaemon import ops

from .kv_factory import make_paged_batch, reference_decode, reference_prefill

TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
# (num_q_heads, num_kv_heads): GQA ratios 1, 4, 8
HEADS = [(8, 8), (16, 4), (16, 2)]
# (cached prefix, new tokens): empty prefixes, prefixes inside / across blocks, chunks that
# start and end off block and tile boundaries, single tokens (decode rows) mixed in.
CHUNKS = [(0, 1), (0, 17), (5, 64), (16, 100), (37, 129), (0, 300), (250, 1), (1000, 33),
          (64, 64), (3, 513)]  # fmt: skip


def run_prefill(chunks, heads, head_dim, block_size, dtype, tile=(0, 0), max_query_len=None,
                backend="mma"):  # fmt: skip
    """The mma.sync kernel unless ``backend`` says otherwise (tests/gpu/test_prefill_sm90.py
    runs these cases on the wgmma kernel)."""
    num_q_heads, num_kv_heads = heads
    query_lens = [q for _, q in chunks]
    batch = make_paged_batch([p + q for p, q in chunks], num_kv_heads, head_dim, block_size, dtype)
    query = torch.randn(sum(query_lens), num_q_heads, head_dim, device="cuda", dtype=dtype)
    starts = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    out = torch.full_like(query, float("nan"))  # poison: every element must be written
    scale = head_dim**-0.5
    ops.paged_attention_prefill(
        query,
        batch.key_cache,
        batch.value_cache,
        batch.block_tables,
        batch.seq_lens,
        starts.cuda(),
        max(query_lens) if max_query_len is None else max_query_len,
        scale=scale,
        out=out,
        block_m=tile[0],
        block_n=tile[1],
        backend=backend,
    )
    return out, query, batch, query_lens


def assert_close_per_seq(out, ref, query_lens, tol):
    assert not torch.isnan(out).any(), "NaN in output (unwritten or bad)"
    start = 0
    for s, q_len in enumerate(query_lens):
        o, r = out[start : start + q_len].double(), ref[start : start + q_len]
        err = (o - r).norm() / r.norm()
        assert err < tol, f"sequence {s} (query_len {q_len}): relative error {err:.2e}"
        start += q_len


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"q{h[0]}kv{h[1]}")
def test_prefill_matches_reference(dtype, head_dim, block_size, heads):
    out, query, batch, query_lens = run_prefill(CHUNKS, heads, head_dim, block_size, dtype)
    ref = reference_prefill(query, batch, query_lens, head_dim**-0.5)
    assert_close_per_seq(out, ref, query_lens, TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"q{h[0]}kv{h[1]}")
@pytest.mark.parametrize("tile", [(128, 64), (64, 64)], ids=lambda t: f"tile{t[0]}x{t[1]}")
def test_prefill_other_tile_shapes(dtype, head_dim, heads, tile):
    out, query, batch, query_lens = run_prefill(CHUNKS, heads, head_dim, 16, dtype, tile)
    ref = reference_prefill(query, batch, query_lens, head_dim**-0.5)
    assert_close_per_seq(out, ref, query_lens, TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_16k_prompt_and_long_chunk_after_prefix(dtype):
    chunks = [(0, 16384), (6000, 3001), (2, 1)]
    out, query, batch, query_lens = run_prefill(chunks, (16, 4), 128, 16, dtype)
    ref = reference_prefill(query, batch, query_lens, 128**-0.5)
    assert_close_per_seq(out, ref, query_lens, TOL[dtype])


@pytest.mark.parametrize("heads", [(12, 4), (40, 4), (24, 1)], ids=lambda h: f"q{h[0]}kv{h[1]}")
def test_prefill_odd_group_sizes(heads):
    """Groups of 3, 10 and 24: packed rows of a token straddle tile boundaries."""
    out, query, batch, query_lens = run_prefill(CHUNKS, heads, 128, 16, torch.bfloat16)
    ref = reference_prefill(query, batch, query_lens, 128**-0.5)
    assert_close_per_seq(out, ref, query_lens, TOL[torch.bfloat16])


def test_prefill_decode_rows_agree_with_decode_kernel():
    """A whole step of decode rows through the prefill kernel equals the decode kernel."""
    chunks = [(n - 1, 1) for n in (1, 16, 17, 300, 2049, 5000)]
    out, query, batch, query_lens = run_prefill(chunks, (32, 8), 128, 16, torch.bfloat16)
    ref = reference_decode(query, batch, 128**-0.5)
    assert_close_per_seq(out, ref, query_lens, TOL[torch.bfloat16])
    dec = ops.paged_attention_decode(
        query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens, 5000
    )
    assert ((dec.double() - out.double()).norm() / ref.norm()) < 1e-2


def test_prefill_flags_bad_metadata_with_nan():
    """max_query_len understated, or a query longer than its context: NaN rows, not garbage."""
    out, *_ = run_prefill([(0, 200), (10, 5)], (8, 2), 64, 16, torch.float16, max_query_len=64)
    assert torch.isnan(out[64:200]).all() and not torch.isnan(out[:64]).any()
    assert not torch.isnan(out[200:]).any()
    batch = make_paged_batch([4], 2, 64, 16, torch.float16)
    query = torch.randn(6, 8, 64, device="cuda", dtype=torch.float16)
    starts = torch.tensor([0, 6], dtype=torch.int32, device="cuda")
    out = ops.paged_attention_prefill(
        query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens, starts, 6
    )
    assert torch.isnan(out).all()


def test_prefill_rejects_bad_arguments():
    batch = make_paged_batch([10, 20], 2, 64, 16, torch.float16)
    query = torch.randn(30, 4, 64, device="cuda", dtype=torch.float16)
    starts = torch.tensor([0, 10, 30], dtype=torch.int32, device="cuda")
    args = (batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens)
    with pytest.raises(TypeError, match="query_start_loc must be int32"):
        ops.paged_attention_prefill(query, *args, starts.long(), 20)
    with pytest.raises(ValueError, match="query_start_loc.shape\\[0\\]"):
        ops.paged_attention_prefill(query, *args, starts[:2], 20)
    with pytest.raises(ValueError, match="max_query_len"):
        ops.paged_attention_prefill(query, *args, starts, 0)
    with pytest.raises(ValueError, match="block_m x block_n = 32 x 0 is not built"):
        ops.paged_attention_prefill(query, *args, starts, 20, block_m=32)
    with pytest.raises(ValueError, match="block_m x block_n = 64 x 32 is not built"):
        ops.paged_attention_prefill(query, *args, starts, 20, block_m=64, block_n=32)
    with pytest.raises(ValueError, match="block_m x block_n = 0 x 48 is not built"):
        ops.paged_attention_prefill(query, *args, starts, 20, block_n=48)
    with pytest.raises(TypeError, match="query must be float16 or bfloat16"):
        ops.paged_attention_prefill(query.float(), *args, starts, 20)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ops.paged_attention_prefill(query[:, :3], *args, starts, 20)


def run_layer_step(chunks, num_q_heads, num_kv_heads, head_dim=128, bs=16):
    """PagedAttention on CUDA for one step of (cached prefix, new tokens) sequences, prefill
    chunks first: writes the new K/V through slot_mapping, then attends. Returns (out [T, Hq,
    D], float64 reference, metadata)."""
    from pydaemon.layers.attention import PagedAttention, uses_kernels
    from pydaemon.layers.attention_metadata import AttentionMetadata

    dtype = torch.bfloat16
    query_lens = [q for _, q in chunks]
    seq_lens = [p + q for p, q in chunks]
    batch = make_paged_batch(seq_lens, num_kv_heads, head_dim, bs, dtype)
    tables = batch.block_tables.cpu()
    slots = [
        int(tables[s, pos // bs]) * bs + pos % bs
        for s, (p, q) in enumerate(chunks)
        for pos in range(p, p + q)
    ]
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, num_q_heads, head_dim, device="cuda", dtype=dtype)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, device="cuda", dtype=dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, device="cuda", dtype=dtype)
    num_prefills = sum(1 for q in query_lens if q > 1)
    num_prefill_tokens = sum(query_lens[:num_prefills])
    starts = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
    md = AttentionMetadata(
        num_prefills=num_prefills,
        num_prefill_tokens=num_prefill_tokens,
        num_decode_tokens=num_tokens - num_prefill_tokens,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device="cuda"),
        block_tables=batch.block_tables,
        seq_lens=batch.seq_lens,
        query_start_loc=starts.cuda(),
        max_seq_len=max(seq_lens),
        max_query_len=max(query_lens),
        seq_lens_cpu=seq_lens,
        query_lens_cpu=query_lens,
    )
    assert uses_kernels(batch.key_cache)
    layer = PagedAttention(num_q_heads, num_kv_heads, head_dim, head_dim**-0.5)
    out = layer(query, key, value, batch.key_cache, batch.value_cache, md)
    out = out.view(num_tokens, num_q_heads, head_dim)
    ref = reference_prefill(query, batch, query_lens, head_dim**-0.5)  # cache holds new K/V
    return out, ref, md, query, batch


def test_attention_layer_mixed_step_one_launch_matches_reference_and_torch_path():
    """Cache writes, then one prefill-kernel launch for prefill chunks and decode rows; equal
    to the float64 reference and to the torch path."""
    from pydaemon.layers.paged_attention_torch import paged_attention_torch

    chunks = [(0, 40), (20, 77), (99, 1), (15, 1)]  # two prefill chunks, then two decodes
    out, ref, md, query, batch = run_layer_step(chunks, 16, 4)
    query_lens = md.query_lens_cpu
    assert_close_per_seq(out, ref, query_lens, TOL[torch.bfloat16])
    torch_out = paged_attention_torch(query, batch.key_cache, batch.value_cache, md, 128**-0.5)
    assert_close_per_seq(torch_out, ref, query_lens, TOL[torch.bfloat16])


@pytest.mark.parametrize(
    "num_seqs,ctx,heads",
    [
        (40, 700, (32, 8)),
        (3, 3000, (32, 8)),
        (5, 300, (32, 8)),
        (9, 900, (16, 16)),
        (9, 900, (32, 1)),
    ],
    ids=["gqa-many", "gqa-long", "gqa-short", "mha-split-kv", "group-32-cuda-cores"],
)
def test_attention_layer_decode_step_either_kernel(num_seqs, ctx, heads):
    """Decode-only steps on either kernel of decode_kernel give the reference."""
    from pydaemon.layers.attention import decode_kernel

    chunks = [(ctx - 1 - 7 * i, 1) for i in range(num_seqs)]
    out, ref, md, *_ = run_layer_step(chunks, *heads)
    expect = "cuda_cores" if heads == (32, 1) else "tensor_cores"
    assert decode_kernel(heads[0] // heads[1], 128) == expect
    assert_close_per_seq(out, ref, md.query_lens_cpu, TOL[torch.bfloat16])
