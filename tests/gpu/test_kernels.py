"""CUDA kernels against float64 torch references on fresh random inputs (outputs poisoned)."""

from __future__ import annotations

import pytest
import torch

from pydaemon import ops

from .kv_factory import make_paged_batch, reference_decode

TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
# (num_q_heads, num_kv_heads): GQA ratios 1, 4, 8
HEADS = [(8, 8), (16, 4), (16, 2)]
# Very unequal lengths around the partition (256) and block boundaries.
MIXED_LENS = [1, 7, 256, 257, 1000, 33, 2049, 512]


def run_decode(batch, num_q_heads: int, head_dim: int, dtype: torch.dtype, max_seq_len=None):
    num_seqs = len(batch.seq_lens_cpu)
    query = torch.randn(num_seqs, num_q_heads, head_dim, device="cuda", dtype=dtype)
    out = torch.full_like(query, float("nan"))  # poison: every element must be written
    scale = head_dim**-0.5
    ops.paged_attention_decode(
        query,
        batch.key_cache,
        batch.value_cache,
        batch.block_tables,
        batch.seq_lens,
        max(batch.seq_lens_cpu) if max_seq_len is None else max_seq_len,
        scale=scale,
        out=out,
    )
    return out, reference_decode(query, batch, scale)


def assert_close_per_seq(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert not torch.isnan(out).any(), "NaN in output (unwritten or bad)"
    for s in range(out.shape[0]):
        err = (out[s].double() - ref[s]).norm() / ref[s].norm()
        assert err < tol, f"sequence {s}: relative error {err:.2e} >= {tol:.0e}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"q{h[0]}kv{h[1]}")
def test_decode_matches_reference(dtype, head_dim, block_size, heads):
    num_q_heads, num_kv_heads = heads
    batch = make_paged_batch(MIXED_LENS, num_kv_heads, head_dim, block_size, dtype)
    out, ref = run_decode(batch, num_q_heads, head_dim, dtype)
    assert_close_per_seq(out, ref, TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [(32, 8), (32, 32), (64, 8)], ids=lambda h: f"q{h[0]}kv{h[1]}")
def test_decode_long_context_16k(dtype, heads):
    num_q_heads, num_kv_heads = heads
    batch = make_paged_batch([16384, 3, 9000], num_kv_heads, 128, 16, dtype)
    out, ref = run_decode(batch, num_q_heads, 128, dtype)
    assert_close_per_seq(out, ref, TOL[dtype])


@pytest.mark.parametrize("heads", [(12, 4), (40, 4), (24, 1)], ids=lambda h: f"q{h[0]}kv{h[1]}")
def test_decode_odd_group_sizes(heads):
    """Groups of 3 (padded pass), 10 and 24 (several passes of 8 heads)."""
    num_q_heads, num_kv_heads = heads
    batch = make_paged_batch([5, 300, 1500], num_kv_heads, 128, 16, torch.bfloat16)
    out, ref = run_decode(batch, num_q_heads, 128, torch.bfloat16)
    assert_close_per_seq(out, ref, TOL[torch.bfloat16])


def test_decode_single_partition_and_larger_max_seq_len():
    """max_seq_len <= 256 takes the one-kernel path; a generous max_seq_len is still exact."""
    batch = make_paged_batch([1, 100, 256], 2, 64, 8, torch.float16)
    out, ref = run_decode(batch, 8, 64, torch.float16)
    assert_close_per_seq(out, ref, TOL[torch.float16])
    batch = make_paged_batch([1, 100, 256], 2, 64, 8, torch.float16, extra_blocks=200)
    batch.block_tables = torch.cat(
        [batch.block_tables, torch.zeros(3, 200, dtype=torch.int32, device="cuda")], dim=1
    )
    out, ref = run_decode(batch, 8, 64, torch.float16, max_seq_len=1500)
    assert_close_per_seq(out, ref, TOL[torch.float16])


def test_decode_empty_sequence_gives_zeros_and_too_long_gives_nan():
    batch = make_paged_batch([0, 600], 2, 64, 16, torch.bfloat16)
    out, ref = run_decode(batch, 4, 64, torch.bfloat16)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert_close_per_seq(out[1:], ref[1:], TOL[torch.bfloat16])
    # max_seq_len understated: the long sequence is flagged with NaN, not truncated.
    out, _ = run_decode(batch, 4, 64, torch.bfloat16, max_seq_len=300)
    assert torch.isnan(out[1]).all()


def test_decode_contiguous_standalone_cache_and_strided_query():
    """A [num_blocks, H, bs, D] cache of its own, and a query that is a strided view."""
    batch = make_paged_batch([40, 700], 4, 128, 32, torch.float16, num_layers=1, layer=0)
    qkv = torch.randn(2, 3 * 8, 128, device="cuda", dtype=torch.float16)
    query = qkv[:, 8:16]  # stride(0) = 24 * 128
    out = ops.paged_attention_decode(
        query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens, 700
    )
    ref = reference_decode(query, batch, 128**-0.5)
    assert_close_per_seq(out, ref, TOL[torch.float16])


# ---------------------------------------------------------------- cache writes and block moves


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_reshape_and_cache_exact_and_skips_negative_slots(dtype, head_dim):
    num_blocks, num_layers, num_kv_heads, block_size, num_tokens = 10, 3, 4, 16, 50
    kv_cache = torch.randn(
        num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim, device="cuda"
    ).to(dtype)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[::7] = -1  # padding tokens
    key = torch.randn(num_tokens, num_kv_heads, head_dim, device="cuda").to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, device="cuda").to(dtype)
    expected = kv_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[slot // block_size, 1, 0, :, slot % block_size] = key[t]
            expected[slot // block_size, 1, 1, :, slot % block_size] = value[t]
    ops.reshape_and_cache(key, value, kv_cache[:, 1, 0], kv_cache[:, 1, 1], slots.cuda())
    assert torch.equal(kv_cache, expected)


def test_reshape_and_cache_strided_key_value():
    """key/value as views into a fused qkv tensor (token stride != heads * head_dim)."""
    kv_cache = torch.randn(4, 1, 2, 2, 8, 64, device="cuda", dtype=torch.bfloat16)
    qkv = torch.randn(5, 8, 64, device="cuda", dtype=torch.bfloat16)
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    slots = torch.tensor([3, -1, 8, 31, 0], device="cuda")
    expected = kv_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[slot // 8, 0, 0, :, slot % 8] = key[t]
            expected[slot // 8, 0, 1, :, slot % 8] = value[t]
    ops.reshape_and_cache(key, value, kv_cache[:, 0, 0], kv_cache[:, 0, 1], slots)
    assert torch.equal(kv_cache, expected)


def test_copy_blocks_all_layers_exact():
    kv_cache = torch.randn(12, 4, 2, 2, 16, 64, device="cuda", dtype=torch.bfloat16)
    pairs = [(0, 5), (3, 7), (11, 2), (4, 9)]
    expected = kv_cache.clone()
    for src, dst in pairs:
        expected[dst] = expected[src]
    ops.copy_blocks(kv_cache, pairs)
    assert torch.equal(kv_cache, expected)
    ops.copy_blocks(kv_cache, torch.tensor([[1, 10]], device="cuda"))
    expected[10] = expected[1]
    assert torch.equal(kv_cache, expected)


def test_swap_blocks_round_trip_exact():
    gpu = torch.randn(16, 2, 2, 2, 16, 64, device="cuda", dtype=torch.float16)
    cpu = torch.zeros(8, 2, 2, 2, 16, 64, dtype=torch.float16).pin_memory()
    out_pairs = [(3, 0), (4, 1), (5, 2), (9, 6), (0, 7)]  # a run of 3 and singles
    ops.swap_blocks(gpu, cpu, out_pairs)
    torch.cuda.synchronize()
    for g, c in out_pairs:
        assert torch.equal(cpu[c], gpu[g].cpu())
    expected = gpu.clone()
    in_pairs = [(0, 10), (1, 11), (6, 15), (7, 12)]
    for c, g in in_pairs:
        expected[g] = cpu[c].cuda()
    ops.swap_blocks(cpu, gpu, in_pairs)
    torch.cuda.synchronize()
    assert torch.equal(gpu, expected)


# ---------------------------------------------------------------- validation errors


def _small_decode_args():
    batch = make_paged_batch([10, 20], 2, 64, 16, torch.float16)
    query = torch.randn(2, 4, 64, device="cuda", dtype=torch.float16)
    return query, batch


def test_decode_rejects_wrong_dtype():
    query, b = _small_decode_args()
    with pytest.raises(TypeError, match="query must be float16 or bfloat16"):
        ops.paged_attention_decode(
            query.float(), b.key_cache, b.value_cache, b.block_tables, b.seq_lens, 20
        )
    with pytest.raises(TypeError, match="block_tables must be int32"):
        ops.paged_attention_decode(
            query, b.key_cache, b.value_cache, b.block_tables.long(), b.seq_lens, 20
        )
    with pytest.raises(TypeError, match="key_cache must have the dtype of query"):
        ops.paged_attention_decode(
            query, b.key_cache.bfloat16(), b.value_cache, b.block_tables, b.seq_lens, 20
        )


def test_decode_rejects_wrong_device_and_shapes():
    query, b = _small_decode_args()
    with pytest.raises(ValueError, match="(query|out) must be a CUDA tensor"):
        ops.paged_attention_decode(
            query.cpu(), b.key_cache, b.value_cache, b.block_tables, b.seq_lens, 20
        )
    with pytest.raises(ValueError, match="seq_lens.shape\\[0\\]"):
        ops.paged_attention_decode(
            query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens[:1], 20
        )
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ops.paged_attention_decode(
            query[:, :3], b.key_cache, b.value_cache, b.block_tables, b.seq_lens, 20
        )
    with pytest.raises(ValueError, match="head_dim"):
        ops.paged_attention_decode(
            query[..., :32], b.key_cache, b.value_cache, b.block_tables, b.seq_lens, 20
        )
    with pytest.raises(ValueError, match="max_seq_len"):
        ops.paged_attention_decode(
            query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, 10_000
        )
    with pytest.raises(ValueError, match="out must be contiguous"):
        out = torch.empty(2, 64, 4, device="cuda", dtype=torch.float16).transpose(1, 2)
        ops.paged_attention_decode(
            query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, 20, out=out
        )


def test_cache_ops_reject_bad_arguments():
    kv_cache = torch.zeros(4, 1, 2, 2, 8, 64, device="cuda", dtype=torch.float16)
    key = torch.zeros(3, 2, 64, device="cuda", dtype=torch.float16)
    slots = torch.zeros(3, dtype=torch.int64, device="cuda")
    with pytest.raises(TypeError, match="slot_mapping must be int64"):
        ops.reshape_and_cache(key, key, kv_cache[:, 0, 0], kv_cache[:, 0, 1], slots.int())
    with pytest.raises(ValueError, match="slot_mapping.shape\\[0\\]"):
        ops.reshape_and_cache(key, key, kv_cache[:, 0, 0], kv_cache[:, 0, 1], slots[:2])
    with pytest.raises(TypeError, match="value must have the dtype of key"):
        ops.reshape_and_cache(key, key.float(), kv_cache[:, 0, 0], kv_cache[:, 0, 1], slots)
    with pytest.raises(ValueError, match="block_mapping.shape\\[1\\]"):
        ops.copy_blocks(kv_cache, torch.zeros(2, 3, dtype=torch.int64, device="cuda"))
    cpu = torch.zeros(4, 1, 2, 2, 8, 64, dtype=torch.float16).pin_memory()
    with pytest.raises(ValueError, match="out of range"):
        ops.swap_blocks(kv_cache, cpu, [(0, 4)])
    with pytest.raises(ValueError, match="src or dst must be on the GPU"):
        ops.swap_blocks(cpu, cpu.clone(), [(0, 1)])
