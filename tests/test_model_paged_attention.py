"""The torch paged-attention path against a dense float64 reference, with scrambled
(non-sequential) block tables and a mix of full prefills, chunked prefills and decodes; with
sliding windows, logit soft-capping and attention sinks (and the same through the CUDA
kernels on a GPU)."""

from __future__ import annotations

import math

import pytest
import torch

from pydaemon.layers.attention import PagedAttention
from pydaemon.layers.attention_metadata import AttentionMetadata
from pydaemon.layers.paged_attention_torch import write_kv_cache_torch


def _reference(q, k, v, scale, sliding_window=None, softcap=None, sinks=None):
    # q: [q_len, Hq, D]; k, v: [s_len, Hkv, D] (whole context), float64, causal at the end;
    # with a window, query position p sees keys (p - sliding_window, p]; softcap bends the
    # scaled scores; sinks [Hq] join each row's softmax as a dropped column.
    q_len, num_heads, _ = q.shape
    s_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = torch.arange(s_len - q_len, s_len)[:, None]
    k_pos = torch.arange(s_len)[None, :]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    if sliding_window is not None:
        scores = scores.masked_fill(k_pos <= q_pos - sliding_window, float("-inf"))
    if sinks is None:
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    col = sinks.double()[:, None, None].expand(num_heads, q_len, 1)
    probs = torch.cat([scores, col], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, v)


@pytest.mark.parametrize("sliding_window", [None, 6, 24])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (4, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
            ],
        ),
    ],
)
def test_paged_attention_matches_dense(
    block_size, num_heads, num_kv_heads, dtype, device, sliding_window
):
    _check_against_dense(block_size, num_heads, num_kv_heads, dtype, device, sliding_window)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("sliding_window", [None, 6])
def test_windowed_layer_where_kernels_apply(sliding_window):
    """head_dim 64 in bf16 on CUDA: the kernels write the cache and apply the window."""
    _check_against_dense(16, 8, 2, torch.bfloat16, "cuda", sliding_window, head_dim=64)


@pytest.mark.parametrize("sliding_window", [None, 6])
@pytest.mark.parametrize("softcap,sinks", [(0.8, False), (None, True), (0.8, True)])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize(
    "device,dtype,head_dim",
    [
        ("cpu", torch.float32, 32),
        ("cpu", torch.bfloat16, 32),
        pytest.param(
            "cuda", torch.bfloat16, 64,  # the kernels' path
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
            ],
        ),
    ],
)  # fmt: skip
def test_softcap_and_sinks_match_dense(
    device, dtype, head_dim, num_heads, num_kv_heads, softcap, sinks, sliding_window
):
    _check_against_dense(
        8, num_heads, num_kv_heads, dtype, device, sliding_window, head_dim, softcap, sinks
    )


def _check_against_dense(
    block_size,
    num_heads,
    num_kv_heads,
    dtype,
    device,
    sliding_window,
    head_dim=32,
    softcap=None,
    use_sinks=False,
):
    torch.manual_seed(0)
    num_blocks = 64
    # (seq_len, query_len): full prefills, a chunked prefill, then decodes.
    specs = [(19, 19), (40, 7), (1, 1), (33, 1), (5, 1), (64, 1), (17, 1)]
    num_prefills = 3
    perm = torch.randperm(num_blocks).tolist()  # scrambled physical block ids
    tables, contexts, queries = [], [], []
    for s_len, q_len in specs:
        n = -(-s_len // block_size)
        tables.append([perm.pop() for _ in range(n)])
        contexts.append(
            (
                torch.randn(s_len, num_kv_heads, head_dim, dtype=torch.float64),
                torch.randn(s_len, num_kv_heads, head_dim, dtype=torch.float64),
            )
        )
        queries.append(torch.randn(q_len, num_heads, head_dim, dtype=torch.float64))
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    value_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    # Earlier context goes in directly; this step's tokens go through the layer's write.
    new_k, new_v, slots = [], [], []
    for (s_len, q_len), table, (k, v) in zip(specs, tables, contexts, strict=True):
        for p in range(s_len):
            slot = table[p // block_size] * block_size + p % block_size
            if p < s_len - q_len:
                pos = torch.tensor([slot], device=device)
                kp, vp = k[p : p + 1].to(device, dtype), v[p : p + 1].to(device, dtype)
                write_kv_cache_torch(kp, vp, key_cache, value_cache, pos)
            else:
                new_k.append(k[p])
                new_v.append(v[p])
                slots.append(slot)
    max_blocks = max(len(t) for t in tables)
    query_lens = [q for _, q in specs]
    seq_lens = [s for s, _ in specs]
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    md = AttentionMetadata(
        num_prefills=num_prefills,
        num_prefill_tokens=sum(query_lens[:num_prefills]),
        num_decode_tokens=len(specs) - num_prefills,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.tensor(
            [t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32, device=device
        ),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        max_seq_len=max(seq_lens),
        max_query_len=max(query_lens),
        seq_lens_cpu=seq_lens,
        query_lens_cpu=query_lens,
    )
    scale = 1 / math.sqrt(head_dim)
    # Sinks comparable to the scores (scores ~ N(0, 1) here): they take real weight.
    sinks = (1.5 * torch.randn(num_heads)).to(dtype) if use_sinks else None
    layer = PagedAttention(num_heads, num_kv_heads, head_dim, scale, sliding_window, softcap)
    out = layer(
        torch.cat(queries).to(device, dtype),
        torch.stack(new_k).to(device, dtype),
        torch.stack(new_v).to(device, dtype),
        key_cache,
        value_cache,
        md,
        sinks=None if sinks is None else sinks.to(device),
    )
    assert out.shape == (sum(query_lens), num_heads * head_dim) and out.dtype == dtype
    # The reference sees the cache's rounding of K/V, so only the attention math differs.
    ref = torch.cat(
        [
            _reference(
                q.to(dtype).double(),
                k.to(dtype).double(),
                v.to(dtype).double(),
                scale,
                sliding_window,
                softcap,
                sinks,
            )
            for q, (k, v) in zip(queries, contexts, strict=True)
        ]
    ).reshape(out.shape)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.cpu().double(), ref, atol=tol, rtol=tol)


def test_negative_slots_are_skipped():
    key_cache = torch.zeros(4, 2, 8, 16)
    value_cache = torch.zeros(4, 2, 8, 16)
    k = torch.ones(3, 2, 16)
    write_kv_cache_torch(k, 2 * k, key_cache, value_cache, torch.tensor([9, -1, 31]))
    assert key_cache[1, :, 1].eq(1).all() and value_cache[3, :, 7].eq(2).all()
    assert key_cache.count_nonzero() == 2 * 2 * 16
