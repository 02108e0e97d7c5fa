"""The paged attention layer: rotates q/k (when given the step's cos/sin), writes new K/V
through the slot mapping, then attends through the block table. Backend selection lives here
and only here:

- CUDA with the pagedd kernels (fp16/bf16): ``rotary_embedding_and_cache`` (rotary and cache
  write in one launch; ``reshape_and_cache`` when the caller rotated already), then ONE
  attention launch per layer: the tensor-core paged prefill kernel when the step has
  prefill work; for decode-only steps, the split-KV tensor-core decode kernel (up to 16 query
  heads per kv head, MHA included), else the split-KV CUDA-core decode kernel
  (``decode_kernel``). A mixed step takes two launches: prefill chunks and decode rows each
  to its kernel (decode rows of a CUDA-core model ride along in the prefill launch). No
  Python loop over sequences, no host-device sync.
- otherwise (CPU, float32, or a build without kernels): the plain torch path
  (``apply_rotary_qk``, then ``write_kv_cache_torch``).

Per-layer score modifiers reach every kernel and the torch path alike: a sliding window
(Mistral, Qwen2/3, Gemma's local and gpt-oss's windowed layers; the kernels skip the KV
blocks wholly before it, they never read them), logit soft-capping (Gemma 2) and attention
sinks (gpt-oss: a learned logit per query head in the softmax's denominator). A layer without
them runs the kernels' plain instances (compile-time switches: no cost to the others).

An FP8 cache (``--kv-cache-dtype fp8``, see kv_cache_fp8.py) takes the same routes: the kernels
quantize on write and dequantize in registers; the torch path quantizes and dequantizes around
its gathers. ``k_scale`` / ``v_scale`` are this layer's scales (1.0 unless the checkpoint has
them, or measured by ``--calculate-kv-scales``: pydaemon/worker/kv_scale_calibration.py); a cache in
the model's dtype ignores them.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import nn

from pydaemon.layers.attention_metadata import AttentionMetadata
from pydaemon.layers.paged_attention_torch import paged_attention_torch, write_kv_cache_torch
from pydaemon.layers.rotary_embedding import apply_rotary_qk
from pydaemon.ops.paged_decode_tc import DECODE_TC_HEAD_DIMS, DECODE_TC_MAX_GROUP
from pydaemon.quantization.kv_cache_fp8 import FP8_DTYPE, measure_kv_scales

# "auto": the CUDA kernels where they apply; "torch": always the torch path (debugging, A/B).
BACKEND = os.environ.get("PAGEDD_ATTENTION_BACKEND", "auto")
KERNEL_DTYPES = (torch.float16, torch.bfloat16)
KERNEL_CACHE_DTYPES = (*KERNEL_DTYPES, FP8_DTYPE)
KERNEL_HEAD_DIMS = (64, 80, 96, 128, 256)


@functools.cache
def _kernels_available() -> bool:
    from pydaemon import ops

    return ops.is_available()


def uses_kernels(cache: torch.Tensor) -> bool:
    """True when this cache tensor is served by the CUDA kernels (an fp8 cache also needs an
    fp16/bf16 model: ``forward`` checks the query)."""
    return (
        BACKEND != "torch"
        and cache.is_cuda
        and cache.dtype in KERNEL_CACHE_DTYPES
        and cache.shape[-1] in KERNEL_HEAD_DIMS
        and _kernels_available()
    )


def decode_kernel(group: int, head_dim: int) -> str:
    """The kernel of a decode-only step: "tensor_cores" (ops.paged_attention_decode_tc, the
    query heads of a kv head as the rows of one mma atom, split-KV) for 1 to
    DECODE_TC_MAX_GROUP query heads per kv head at a head size it is built for, else
    "cuda_cores" (ops.paged_attention_decode, the split-KV CUDA-core kernel).

    MHA (one query row per kv head, an mma atom 1/16 used) runs on tensor cores too: decode
    is memory-bound, and on the H200 (bench/results/h200_2026-12-01d_prefill_ws.md, MHA 32/32,
    bf16) the tensor-core kernel is faster at every measured shape: 13.1 against 22.4 us at
    batch 1 x 512, 3,780 against 3,939 us at batch 256 x 4k (106 % of copy bandwidth).
    """
    if 1 <= group <= DECODE_TC_MAX_GROUP and head_dim in DECODE_TC_HEAD_DIMS:
        return "tensor_cores"
    return "cuda_cores"


class PagedAttention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        """``softcap``: scores s become ``softcap * tanh(s / softcap)`` (s already scaled)."""
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window  # tokens a query sees (itself included); None: all
        if softcap is not None and not softcap > 0:
            raise ValueError(f"softcap must be > 0, got {softcap}")
        self.softcap = softcap
        # FP8 cache scales: K is stored as k / k_scale and read as e4m3 * k_scale (V alike).
        self.k_scale = 1.0
        self.v_scale = 1.0
        # calculate_kv_scales: (K, V) scales to measure on the next forward, before its cache
        # write; the model runner arms them for its first step only.
        self.kv_scales_to_calculate = (False, False)
        # Per-layer-group tables (core/kv_groups.py): the group whose tables this layer reads
        # (attn_metadata.groups); set by the model runner.
        self.kv_group = 0

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
        value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
        attn_metadata: AttentionMetadata,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,  # cos, sin: [T, rotary_dim] f32
        sinks: torch.Tensor | None = None,  # [num_heads], query's dtype (gpt-oss)
    ) -> torch.Tensor:  # [T, num_heads * head_dim]
        """``rotary``: rotate query and key (rotate_half convention) before the cache write;
        None when the caller has rotated them already (or the model has no rotary).
        ``sinks``: each head's sink logit, joining its softmax's denominator."""
        if self.kv_group:
            attn_metadata = attn_metadata.groups[self.kv_group]
        if self.kv_scales_to_calculate != (False, False):
            if rotary is not None:  # measure K as it is stored: rotated (first step only)
                query, key = apply_rotary_qk(query, key, *rotary)
                rotary = None
            self._calculate_kv_scales(key, value, attn_metadata.slot_mapping)
        if uses_kernels(key_cache) and query.dtype in KERNEL_DTYPES:
            out = self._forward_cuda(
                query, key, value, key_cache, value_cache, attn_metadata, rotary, sinks
            )
        else:
            if rotary is not None:
                query, key = apply_rotary_qk(query, key, *rotary)
            write_kv_cache_torch(
                key, value, key_cache, value_cache, attn_metadata.slot_mapping, *self._scales()
            )
            out = self._attend_torch(query, key_cache, value_cache, attn_metadata, sinks)
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)

    def _calculate_kv_scales(self, key, value, slot_mapping) -> None:
        k_scale, v_scale = measure_kv_scales(key, value, slot_mapping)  # syncs: this step only
        calculate_k, calculate_v = self.kv_scales_to_calculate
        if calculate_k:
            self.k_scale = k_scale
        if calculate_v:
            self.v_scale = v_scale
        self.kv_scales_to_calculate = (False, False)

    def _scales(self) -> tuple[float, float]:
        return self.k_scale, self.v_scale

    def _attend_torch(self, query, key_cache, value_cache, md: AttentionMetadata, sinks):
        k_scale, v_scale = self._scales()
        return paged_attention_torch(
            query, key_cache, value_cache, md, self.scale, self.sliding_window, k_scale, v_scale,
            softcap=self.softcap, sinks=sinks,
        )  # fmt: skip

    def _forward_cuda(
        self, query, key, value, key_cache, value_cache, md: AttentionMetadata, rotary, sinks
    ):
        from pydaemon import ops

        k_scale, v_scale = self._scales()
        if rotary is not None:
            # One launch: q/k rotated in place, the rotated k and v stored in the cache.
            cos, sin = rotary
            ops.rotary_embedding_and_cache(
                query,
                key,
                value,
                key_cache,
                value_cache,
                md.slot_mapping,
                cos,
                sin,
                k_scale,
                v_scale,
            )
        else:
            ops.reshape_and_cache(
                key, value, key_cache, value_cache, md.slot_mapping, k_scale, v_scale
            )
        group = query.shape[1] // key_cache.shape[1]  # this rank's heads, under TP
        tc_decode = decode_kernel(group, self.head_dim) == "tensor_cores"
        scales = {
            "scale": self.scale,
            "k_scale": k_scale,
            "v_scale": v_scale,
            "sliding_window": self.sliding_window,
            "softcap": self.softcap,
            "sinks": sinks,
        }
        if md.num_prefills > 0 and md.num_decode_tokens > 0 and tc_decode:
            # A mixed step: the prefill chunks through the prefill kernel, the decode rows
            # (after them, one token each) through the decode kernel, into one output. In the
            # prefill kernel a decode row would take a whole 128-row tile of its own.
            out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
            p, s = md.num_prefill_tokens, md.num_prefills  # host ints
            ops.paged_attention_prefill(
                query[:p],
                key_cache,
                value_cache,
                md.block_tables[:s],
                md.seq_lens[:s],
                md.query_start_loc[: s + 1],
                md.max_query_len,  # host int: no device read-back
                out=out[:p],
                **scales,
            )
            ops.paged_attention_decode_tc(
                query[p:],
                key_cache,
                value_cache,
                md.block_tables[s:],
                md.seq_lens[s:],
                md.max_seq_len,  # an upper bound for the decode rows: host int
                out=out[p:],
                **scales,
            )
            return out
        if md.num_prefills > 0:
            # Prefill chunks (and any decode rows riding along): one tensor-core launch.
            return ops.paged_attention_prefill(
                query,
                key_cache,
                value_cache,
                md.block_tables,
                md.seq_lens,
                md.query_start_loc,
                md.max_query_len,  # host int: no device read-back
                **scales,
            )
        decode = ops.paged_attention_decode_tc if tc_decode else ops.paged_attention_decode
        return decode(
            query,
            key_cache,
            value_cache,
            md.block_tables,
            md.seq_lens,
            md.max_seq_len,  # host int, computed once per step: no device read-back
            **scales,
        )
