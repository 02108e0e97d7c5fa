"""Paged attention in plain torch: runs on CPU and on CUDA tensors.

Reads K/V only through the block table, exactly as the CUDA kernels do, so it is also the
reference the kernels are tested against. Prefill sequences (full or chunked, possibly with a
cached prefix) are handled one by one with SDPA; all decode sequences of the step are batched
into one padded gather + masked softmax. Only the host lists of the metadata
(``seq_lens_cpu``, ``query_lens_cpu``) drive Python control flow, so no device tensor is read
back.

``sliding_window`` (Mistral, Qwen2/3, Gemma's local and gpt-oss's windowed layers): a query at
position ``p`` sees only the keys at positions ``(p - sliding_window, p]``, as transformers'
sliding-window mask does. ``softcap`` (Gemma 2): each scaled score ``s`` becomes ``softcap *
tanh(s / softcap)`` before the mask. ``sinks`` (gpt-oss): a learned logit per query head that
joins each row's softmax as one more column whose value is dropped, so the weights of the real
keys sum to less than one (transformers' eager gpt-oss attention).

An FP8 cache (float8_e4m3fn, kv_cache_fp8.py) is written as saturate(x / scale) and read back
as e4m3 * scale in the query's dtype right after each gather: on the CPU this emulates the
CUDA kernels' numbers (same storage, same rounding), it does not make anything faster.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pydaemon.layers.attention_metadata import AttentionMetadata
from pydaemon.quantization.kv_cache_fp8 import dequantize_fp8, is_fp8, quantize_fp8


def write_kv_cache_torch(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64, slot of each token; negative: skip
    k_scale: float = 1.0,  # fp8 cache only: stores key / k_scale
    v_scale: float = 1.0,
) -> None:
    block_size = key_cache.shape[2]
    slots = slot_mapping.to(torch.int64)
    # Boolean indexing syncs with a CUDA device; the CUDA path uses the reshape_and_cache
    # kernel instead, this fallback only has to be correct there.
    valid = slots >= 0
    slots, key, value = slots[valid], key[valid], value[valid]
    block_ids = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots % block_size
    # key_cache[block_ids, :, offsets] has shape [T, num_kv_heads, head_dim].
    if is_fp8(key_cache.dtype):
        key, value = quantize_fp8(key, k_scale), quantize_fp8(value, v_scale)
    key_cache[block_ids, :, offsets] = key.to(key_cache.dtype)
    value_cache[block_ids, :, offsets] = value.to(value_cache.dtype)


def _gather_kv(
    cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    block_tables: torch.Tensor,  # [N, num_blocks_per_seq] int32
    max_len: int,
    dtype: torch.dtype,
    scale: float,
) -> torch.Tensor:
    """-> [N, num_kv_heads, max_len, head_dim] in ``dtype`` (positions past a sequence's end:
    garbage); an fp8 cache is dequantized with ``scale`` after the gather."""
    n, nb = block_tables.shape
    blocks = cache[block_tables.to(torch.int64)]  # [N, nb, Hkv, bs, D]
    h, bs, d = cache.shape[1], cache.shape[2], cache.shape[3]
    blocks = blocks.permute(0, 2, 1, 3, 4).reshape(n, h, nb * bs, d)[:, :, :max_len]
    return dequantize_fp8(blocks, scale, dtype) if is_fp8(cache.dtype) else blocks


@dataclass(frozen=True)
class ScoreMods:
    """What a layer does to its attention scores besides the causal mask."""

    sliding_window: int | None = None
    softcap: float | None = None
    # Per query head, any float dtype, shaped to broadcast against the scores but for their
    # last dim: [num_heads, 1, 1] for [num_heads, q_len, L] scores.
    sinks: torch.Tensor | None = None

    @property
    def needs_explicit_softmax(self) -> bool:
        """SDPA has no soft-cap and no sinks."""
        return self.softcap is not None or self.sinks is not None


def paged_attention_torch(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    attn_metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,  # fp8 cache only: K = e4m3 * k_scale
    v_scale: float = 1.0,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads]
) -> torch.Tensor:
    """Causal attention of the step's query tokens over their sequences' cached K/V.

    Sequence ``i`` has its ``query_lens_cpu[i]`` query tokens at positions
    ``[seq_lens_cpu[i] - query_lens_cpu[i], seq_lens_cpu[i])``; its K/V (including this step's,
    already written) are read through ``block_tables[i]``. Returns [T, num_heads, head_dim].
    """
    out = torch.empty_like(query)
    kv_scales = (k_scale, v_scale)
    mods = ScoreMods(sliding_window, softcap, None if sinks is None else sinks.view(-1, 1, 1))
    num_prefill_tokens = paged_prefill_torch(
        query, key_cache, value_cache, attn_metadata, scale, out, mods, kv_scales
    )
    paged_decode_torch(
        query,
        key_cache,
        value_cache,
        attn_metadata,
        scale,
        out,
        num_prefill_tokens,
        mods,
        kv_scales,
    )
    return out


def _softmax_with_mods(
    scores: torch.Tensor,  # [..., Hq, q_len, L] float32, already scaled
    masked: torch.Tensor,  # broadcastable to scores: True where a key is not attended
    mods: ScoreMods,
) -> torch.Tensor:  # probabilities, float32, same shape as scores
    if mods.softcap is not None:
        scores = torch.tanh(scores / mods.softcap) * mods.softcap
    scores = scores.masked_fill(masked, float("-inf"))
    if mods.sinks is None:
        return torch.softmax(scores, dim=-1)
    sinks = mods.sinks.float().expand(*scores.shape[:-1], 1)
    combined = torch.cat([scores, sinks], dim=-1)
    return torch.softmax(combined, dim=-1)[..., :-1]


def paged_prefill_torch(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    attn_metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor,  # [T, num_heads, head_dim], written for the prefill tokens
    mods: ScoreMods = ScoreMods(),
    kv_scales: tuple[float, float] = (1.0, 1.0),  # fp8 cache: (k_scale, v_scale)
) -> int:
    """Attention of the prefill sequences (the first ``num_prefills``), one SDPA call each.
    Returns the number of prefill tokens written."""
    num_heads = query.shape[1]
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    seq_lens = attn_metadata.seq_lens_cpu
    query_lens = attn_metadata.query_lens_cpu
    start = 0
    for i in range(attn_metadata.num_prefills):
        q_len, s_len = query_lens[i], seq_lens[i]
        num_blocks = -(-s_len // block_size)
        table = attn_metadata.block_tables[i : i + 1, :num_blocks]
        k = _gather_kv(key_cache, table, s_len, query.dtype, kv_scales[0])[0]  # [Hkv, s_len, D]
        v = _gather_kv(value_cache, table, s_len, query.dtype, kv_scales[1])[0]
        if group > 1:
            k = k.repeat_interleave(group, dim=0)
            v = v.repeat_interleave(group, dim=0)
        q = query[start : start + q_len].transpose(0, 1)  # [Hq, q_len, D]
        window = mods.sliding_window
        if mods.needs_explicit_softmax:
            mask = _prefill_mask(q_len, s_len, window, query.device)
            scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # [Hq, q_len, s_len]
            probs = _softmax_with_mods(scores, ~mask, mods).to(v.dtype)
            o = torch.matmul(probs, v)
        elif q_len == s_len and (window is None or window >= s_len):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            mask = _prefill_mask(q_len, s_len, window, query.device)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[start : start + q_len] = o.transpose(0, 1)
        start += q_len
    return start


def _prefill_mask(
    q_len: int, s_len: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor:  # [q_len, s_len] bool, True where attended
    """Query token j sits at position s_len - q_len + j and sees keys [0, that] (within the
    window when there is one)."""
    q_pos = torch.arange(s_len - q_len, s_len, device=device)
    k_pos = torch.arange(s_len, device=device)
    mask = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
    return mask


def paged_decode_torch(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    attn_metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor,  # [T, num_heads, head_dim], written for the decode tokens
    start: int,  # the first decode token
    mods: ScoreMods = ScoreMods(),
    kv_scales: tuple[float, float] = (1.0, 1.0),  # fp8 cache: (k_scale, v_scale)
) -> None:
    """All decode sequences at once: one padded gather and a masked softmax."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    seq_lens = attn_metadata.seq_lens_cpu
    num_prefills = attn_metadata.num_prefills
    num_decodes = attn_metadata.num_seqs - num_prefills
    if num_decodes > 0:
        decode_lens = seq_lens[num_prefills:]
        max_len = max(decode_lens)
        num_blocks = -(-max_len // block_size)
        tables = attn_metadata.block_tables[num_prefills:, :num_blocks]
        k = _gather_kv(key_cache, tables, max_len, query.dtype, kv_scales[0])  # [N, Hkv, L, D]
        v = _gather_kv(value_cache, tables, max_len, query.dtype, kv_scales[1])
        q = query[start : start + num_decodes].view(num_decodes, num_kv_heads, group, head_dim)
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # [N, Hkv, G, L]
        lens = attn_metadata.seq_lens[num_prefills:].to(device=query.device, dtype=torch.int64)
        k_pos = torch.arange(max_len, device=query.device)[None, :]
        pad = k_pos >= lens[:, None]  # [N, L]
        if mods.sliding_window is not None:
            # The query sits at position lens - 1 and sees (lens - 1 - window, lens - 1].
            pad |= k_pos <= lens[:, None] - 1 - mods.sliding_window
        if mods.sinks is not None:  # scores [N, Hkv, G, L]: the sink of head (kv head, g)
            sinks = mods.sinks.view(num_kv_heads, group, 1)
            mods = ScoreMods(mods.sliding_window, mods.softcap, sinks)
        probs = _softmax_with_mods(scores, pad[:, None, None, :], mods).to(v.dtype)
        # Padding slots may hold anything (even NaN/inf in never-written blocks): 0 * NaN = NaN.
        v = v.masked_fill(pad[:, None, :, None], 0.0)
        o = torch.matmul(probs, v)  # [N, Hkv, G, D]
        out[start : start + num_decodes] = o.reshape(num_decodes, num_heads, head_dim)
