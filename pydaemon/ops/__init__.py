"""GPU kernels of ``pydaemon._core`` (cpp/cuda/) behind torch-facing wrappers.

    from pydaemon import ops
    if ops.is_available():
        out = ops.paged_attention_decode(query, key_cache, value_cache, block_tables,
                                         seq_lens, max_seq_len)
        out = ops.paged_attention_decode_tc(query, key_cache, value_cache, block_tables,
                                            seq_lens, max_seq_len)  # GQA, tensor cores
        out = ops.paged_attention_prefill(query, key_cache, value_cache, block_tables,
                                          seq_lens, query_start_loc, max_query_len)
        out = ops.fused_add_rms_norm(x, residual, weight, eps)  # residual updated in place
        out = ops.silu_and_mul(gate_up)
        out = ops.gated_act_and_mul(gate_up, "gelu_tanh")  # or "swigluoai" (gpt-oss)
        ops.rotary_embedding(q, k, cos, sin)  # in place (cos: [T, rotary_dim] <= head_dim)
        ops.rotary_embedding_and_cache(q, k, v, key_cache, value_cache, slot_mapping, cos, sin)
        xq, x_scale = ops.per_token_fp8_quant(x)  # FP8 e4m3, one scale per token
        xq, x_scale = ops.silu_and_mul_fp8_quant(gate_up)  # the two above in one kernel
        y = ops.fp8_gemv(xq, x_scale, wq, w_scale)  # FP8 scaled product, 1 to 16 rows
        weights, ids = ops.topk_route(router_logits, top_k, softmax, renormalize)  # MoE
        sorted_token_ids, inverse, expert_offsets = ops.moe_align(ids, num_experts)
        out = ops.moe_combine(expert_out, inverse, weights)
        act = ops.moe_decode_gate_up(x, ids, w13)  # a few tokens: the experts in two kernels
        out = ops.moe_decode_down_combine(act, ids, weights, w2)
        xa = ops.lora_shrink(x, lora_a, token_slots)  # batched LoRA, a slot per token
        ops.lora_expand(y, xa, lora_b, part_starts, token_slots)  # y += xa @ B, in place

``is_available()`` is False (and ``unavailable_reason()`` says why) when ``_core`` was built
without CUDA kernels or no CUDA device is visible; every wrapper then raises RuntimeError.
"""

from pydaemon.ops._core_ext import LAYER_KERNEL_DTYPES, core, is_available, unavailable_reason
from pydaemon.ops.activation import gated_act_and_mul, silu_and_mul
from pydaemon.ops.cache_ops import copy_blocks, reshape_and_cache, swap_blocks
from pydaemon.ops.fp8_gemm import FP8_GEMV_MAX_ROWS, fp8_gemv, fp8_gemv_available
from pydaemon.ops.fp8_quant import (
    per_token_fp8_quant,
    rms_norm_fp8_quant,
    silu_and_mul_fp8_quant,
)
from pydaemon.ops.layernorm import fused_add_rms_norm, rms_norm
from pydaemon.ops.lora import lora_expand, lora_shrink
from pydaemon.ops.moe import (
    MOE_DECODE_MAX_HIDDEN,
    moe_align,
    moe_combine,
    moe_decode_down_combine,
    moe_decode_down_combine_fp8,
    moe_decode_fp8_kernels_available,
    moe_decode_gate_up,
    moe_decode_gate_up_fp8,
    moe_decode_kernels_available,
    moe_kernels_available,
    topk_route,
)
from pydaemon.ops.paged_attention import (
    PARTITION_SIZE,
    decode_span,
    num_partitions,
    paged_attention_decode,
)
from pydaemon.ops.paged_decode_tc import (
    DECODE_TC_HEAD_DIMS,
    DECODE_TC_MAX_GROUP,
    decode_tc_partition_size,
    paged_attention_decode_tc,
)
from pydaemon.ops.paged_prefill import paged_attention_prefill
from pydaemon.ops.rotary import rotary_embedding, rotary_embedding_and_cache

__all__ = [
    "DECODE_TC_HEAD_DIMS",
    "DECODE_TC_MAX_GROUP",
    "FP8_GEMV_MAX_ROWS",
    "LAYER_KERNEL_DTYPES",
    "MOE_DECODE_MAX_HIDDEN",
    "PARTITION_SIZE",
    "copy_blocks",
    "core",
    "decode_span",
    "decode_tc_partition_size",
    "fp8_gemv",
    "fp8_gemv_available",
    "fused_add_rms_norm",
    "gated_act_and_mul",
    "is_available",
    "lora_expand",
    "lora_shrink",
    "moe_align",
    "moe_combine",
    "moe_decode_down_combine",
    "moe_decode_down_combine_fp8",
    "moe_decode_fp8_kernels_available",
    "moe_decode_gate_up",
    "moe_decode_gate_up_fp8",
    "moe_decode_kernels_available",
    "moe_kernels_available",
    "num_partitions",
    "paged_attention_decode",
    "paged_attention_decode_tc",
    "paged_attention_prefill",
    "per_token_fp8_quant",
    "reshape_and_cache",
    "rms_norm",
    "rms_norm_fp8_quant",
    "rotary_embedding",
    "rotary_embedding_and_cache",
    "silu_and_mul",
    "silu_and_mul_fp8_quant",
    "swap_blocks",
    "topk_route",
    "unavailable_reason",
]
