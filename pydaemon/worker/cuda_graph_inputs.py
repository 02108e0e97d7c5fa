"""Which decode steps a CUDA graph serves, and the static input buffer the graphs read.

A graph freezes every launch's grid and every pointer, so a decode step is padded to a
captured shape: its batch up to a **batch bucket**, its longest context up to a **seq-len
tier**.

Batch buckets: 1, 2, 4, 8, then steps of max(8, a quarter of the largest power of two below
the size): 8, 16, ..., 64, 80, ..., 128, 160, ..., 256, 320, ... and ``max_num_seqs`` last.
Below ~100 rows a decode GEMM is bound by reading the weights, so padding rows is almost
free there; above, the padded share stays under a quarter while the number of graphs (each
costs capture time) grows only logarithmically: 23 buckets up to 512.

Seq-len tiers: 512, 2048, 8192, ... (x4) up to ``max_seq_len_to_capture``, which is the last.
The split-KV decode kernels' grids depend on the context (``max_seq_len`` sizes their
partitions and workspaces, and only those host ints): a graph captured at tier ``t`` serves
every batch whose longest context is at most ``t`` (partitions past a sequence's end exit at
once). The tiers keep the number of idle partitions within 4x of the eager launch, and they
are the tensor-core decode kernel's context buckets, so a graph splits every context it serves
as eager does. Batch buckets whose tensor-core decode (up to 16 query heads a kv head,
``decode_kernel``) runs ONE partition at every tier get one graph only: that launch's blocks
each read just their sequence's keys whatever the tier. Longer contexts run eagerly, as in
vLLM.

Padding rows are no-ops for everything the step keeps: token 0 at position 0, slot -1 (the
cache-write kernel and the torch path skip negative slots), context length 1 over block 0
(the runner zeroes block 0 at start; afterwards it only ever holds finite K/V), query length
1. Their attention output is finite, so nothing downstream (norms, a dynamic activation
scale) can be poisoned by a NaN; their hidden rows are dropped before the LM head.

Static buffer layout for a graph of bucket ``b`` and block-table width ``w``: one int64
device tensor, so that a step costs one host-to-device copy:

    int64 words  [0, b)        input_ids        [b, 2b)   positions     [2b, 3b) slot_mapping
    int32 words  [6b, 6b+b*w)  block_tables [b, w]        then seq_lens [b], query_start_loc [b+1]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pydaemon.config.engine import EngineConfig
from pydaemon.config.model import ModelConfig
from pydaemon.layers.attention import decode_kernel, uses_kernels
from pydaemon.ops.paged_decode_tc import (
    CONTEXT_BUCKET_FACTOR,
    FIRST_CONTEXT_BUCKET,
    decode_tc_partition_size,
)
from pydaemon.quantization.kv_cache_fp8 import is_fp8

PAD_SLOT_ID = -1
# The tensor-core decode kernel's context buckets: a graph of a tier partitions every context
# it serves as eager does (ops/paged_decode_tc.py).
FIRST_SEQ_LEN_TIER = FIRST_CONTEXT_BUCKET
SEQ_LEN_TIER_FACTOR = CONTEXT_BUCKET_FACTOR


def capture_batch_sizes(max_num_seqs: int) -> list[int]:
    """The batch buckets, ascending, the last one ``max_num_seqs``."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes, size = [], 1
    while size < max_num_seqs:
        sizes.append(size)
        size = 2 * size if size < 8 else size + max(8, (1 << (size.bit_length() - 1)) // 4)
    return [*sizes, max_num_seqs]


def capture_seq_len_tiers(max_seq_len_to_capture: int) -> list[int]:
    """The seq-len tiers, ascending, the last one ``max_seq_len_to_capture``."""
    if max_seq_len_to_capture < 1:
        raise ValueError(f"max_seq_len_to_capture must be >= 1, got {max_seq_len_to_capture}")
    tiers, tier = [], FIRST_SEQ_LEN_TIER
    while tier < max_seq_len_to_capture:
        tiers.append(tier)
        tier *= SEQ_LEN_TIER_FACTOR
    return [*tiers, max_seq_len_to_capture]


@dataclass(frozen=True)
class GraphKey:
    batch_size: int  # padded batch (a bucket)
    max_seq_len: int  # the tier: the longest context the graph serves
    block_table_width: int  # columns of its block_tables: ceil(max_seq_len / block_size)


@dataclass(frozen=True)
class GraphPlan:
    """The graphs to capture and the one that serves a given decode step.

    ``tiered``: the batch buckets that get one graph per seq-len tier (their decode kernel's
    partition count follows the context); every other bucket gets one graph at the last tier.
    """

    batch_sizes: tuple[int, ...]
    seq_len_tiers: tuple[int, ...]
    block_size: int
    tiered: frozenset[int]

    def keys(self) -> list[GraphKey]:
        """Every graph, largest first (so that smaller ones reuse the shared memory pool)."""
        keys = []
        for b in sorted(self.batch_sizes, reverse=True):
            tiers = self.seq_len_tiers if b in self.tiered else self.seq_len_tiers[-1:]
            keys.extend(self._key(b, t) for t in sorted(tiers, reverse=True))
        return keys

    def key_for(self, num_seqs: int, max_seq_len: int) -> GraphKey | None:
        """The graph for a decode step, or None when it must run eagerly (too many sequences
        or a context longer than the last tier)."""
        b = next((s for s in self.batch_sizes if s >= num_seqs), None)
        if b is None or max_seq_len > self.seq_len_tiers[-1]:
            return None
        if b not in self.tiered:
            return self._key(b, self.seq_len_tiers[-1])
        return self._key(b, next(t for t in self.seq_len_tiers if t >= max_seq_len))

    @property
    def max_buffer_words(self) -> int:
        return max(buffer_words(k.batch_size, k.block_table_width) for k in self.keys())

    def _key(self, batch_size: int, tier: int) -> GraphKey:
        return GraphKey(batch_size, tier, -(-tier // self.block_size))


def cuda_graph_plan(
    config: EngineConfig, model_config: ModelConfig, kv_cache: torch.Tensor, max_model_len: int
) -> GraphPlan | None:
    """The decode graphs this runner captures, or None when every step runs eagerly:
    ``enforce_eager``, a cache not served by the CUDA kernels (CPU, float32, a build without
    kernels, PAGEDD_ATTENTION_BACKEND=torch), or a sliding-window model (its windowed layers
    attend on the torch path, whose Python control flow a graph would freeze)."""
    if config.enforce_eager or not uses_kernels(kv_cache) or model_config.has_sliding_window:
        return None
    tp = config.tensor_parallel_size
    return make_graph_plan(
        config.max_num_seqs,
        min(config.max_seq_len_to_capture, max_model_len),
        config.block_size,
        model_config.num_key_value_heads // tp,
        model_config.num_attention_heads // tp,
        model_config.head_dim,
        fp8_cache=is_fp8(kv_cache.dtype),
    )


def make_graph_plan(
    max_num_seqs: int,
    max_seq_len_to_capture: int,
    block_size: int,
    num_kv_heads: int,  # this rank's
    num_q_heads: int,  # this rank's
    head_dim: int = 128,
    fp8_cache: bool = False,
) -> GraphPlan:
    """The buckets and tiers (cuda_graph_inputs.py); a bucket needs one graph per tier unless
    its decode runs on tensor cores with one partition at every tier (then the graph of the
    longest tier serves every context with one partition, as eager does). fp8_cache: the KV
    cache is float8_e4m3fn, which splits up to more sequences (decode_tc_partition_size)."""
    batch_sizes = capture_batch_sizes(max_num_seqs)
    tiers = capture_seq_len_tiers(max_seq_len_to_capture)

    def one_graph(b: int) -> bool:
        if decode_kernel(num_q_heads // num_kv_heads, head_dim) != "tensor_cores":
            return False
        return all(decode_tc_partition_size(b, num_kv_heads, t, fp8_cache) >= t for t in tiers)

    tiered = frozenset(b for b in batch_sizes if not one_graph(b))
    return GraphPlan(tuple(batch_sizes), tuple(tiers), block_size, tiered)


def buffer_words(batch_size: int, width: int) -> int:
    """int64 words of the static buffer of a graph of this bucket and block-table width."""
    b = batch_size
    return 3 * b + -(-(b * width + 2 * b + 1) // 2)


def pack_decode_inputs(
    input_ids: np.ndarray,  # [n] int64
    positions: np.ndarray,  # [n] int64
    slot_mapping: np.ndarray,  # [n] int64
    block_tables: np.ndarray,  # [n, any width] int32
    seq_lens: np.ndarray,  # [n] int32
    key: GraphKey,
) -> np.ndarray:
    """-> [buffer_words(b, w)] int64: the step's decode inputs padded to ``key``'s bucket.

    Block-table columns past ``w`` are dropped: no sequence of the step reaches them, since
    every context is at most the tier (a step may hold a block allocated ahead).
    """
    n, b, w = len(input_ids), key.batch_size, key.block_table_width
    if n > b:
        raise ValueError(f"{n} sequences do not fit a graph of batch size {b}")
    words = np.zeros(buffer_words(b, w), dtype=np.int64)
    words[:n] = input_ids
    words[b : b + n] = positions
    words[2 * b : 2 * b + n] = slot_mapping
    words[2 * b + n : 3 * b] = PAD_SLOT_ID
    ints = words.view(np.int32)
    bt, lens, qsl = _int32_fields(ints[6 * b :], b, w)
    cols = min(w, block_tables.shape[1])
    bt[:n, :cols] = block_tables[:, :cols]  # padding rows stay block 0
    lens[:n] = seq_lens
    lens[n:] = 1
    qsl[:] = np.arange(b + 1, dtype=np.int32)  # every row is one query token
    return words


def decode_input_views(buffer: torch.Tensor, key: GraphKey) -> dict[str, torch.Tensor]:
    """Views of the static buffer (int64, contiguous) in ``pack_decode_inputs``' layout:
    input_ids [b] int64, positions [b] int64, slot_mapping [b] int64, block_tables [b, w]
    int32, seq_lens [b] int32, query_start_loc [b + 1] int32."""
    b, w = key.batch_size, key.block_table_width
    ints = buffer[: buffer_words(b, w)].view(torch.int32)
    block_tables, seq_lens, query_start_loc = _int32_fields(ints[6 * b :], b, w)
    return {
        "input_ids": buffer[:b],
        "positions": buffer[b : 2 * b],
        "slot_mapping": buffer[2 * b : 3 * b],
        "block_tables": block_tables,
        "seq_lens": seq_lens,
        "query_start_loc": query_start_loc,
    }


def _int32_fields(ints, b: int, w: int):
    """(block_tables [b, w], seq_lens [b], query_start_loc [b + 1]) views of the int32 part."""
    block_tables = ints[: b * w].reshape(b, w)
    seq_lens = ints[b * w : b * w + b]
    query_start_loc = ints[b * w + b : b * w + 2 * b + 1]
    return block_tables, seq_lens, query_start_loc
