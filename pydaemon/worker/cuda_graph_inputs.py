"""Which decode and verify steps a CUDA graph serves, and the static input buffer the graphs read.

A graph freezes every launch's grid and every pointer, so a decode step is padded to a
captured shape: its batch up to a **batch bucket**, its longest context up to a **seq-len
tier**. A **verify step** of speculative decoding (every sequence a decode plus k drafts:
query length q = k + 1 over a cached prefix) has graphs of its own, keyed by the query
length too (``GraphKey.query_len``; decode graphs have 1), for the configured k only.

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

Verify graphs: every row of a verify step is a prefill row of q tokens, so the step runs the
paged prefill kernel, whose grid is (kv heads, ceil(q * group / tile rows), sequences): the
bucket and q only, never the context (no split-KV; ``max_query_len`` = q is a host int of the
key). One graph per batch bucket at the last seq-len tier therefore serves every context (the
tier only sets the block-table width). Buckets stop at the first one holding
``disable_by_batch_size`` sequences (or ``max_num_seqs``): above it the scheduler reserves no
draft slots.

Padding rows are no-ops for everything the step keeps: token 0 at position 0, slot -1 (the
cache-write kernel and the torch path skip negative slots), context length 1 over block 0
(the runner zeroes block 0 at start; afterwards it only ever holds finite K/V), query length
1 (verify: q tokens at position 0, context length q, so that no query row is past its
context, which the prefill kernel fills with NaN). Their attention output is finite, so
nothing downstream (norms, a dynamic activation scale) can be poisoned by a NaN; their hidden
rows are dropped before the LM head.

Static buffer layout for a graph of bucket ``b``, query length ``q`` (T = b * q tokens) and
block-table width ``w``: one int64 device tensor, so that a step costs one host-to-device copy:

    int64 words  [0, T)        input_ids        [T, 2T)   positions     [2T, 3T) slot_mapping
    int32 words  [6T, 6T+b*w)  block_tables [b, w]        then seq_lens [b], query_start_loc [b+1]

With G per-layer-group tables (core/kv_groups.py) the slot mappings are [G, T] from word 2T
and the block tables [G, b, w] from int32 word 2(2+G)T; group 0's are the plain fields.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from pydaemon.config.model import ModelConfig
from pydaemon.config.runner import RunnerConfig
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
    query_len: int = 1  # tokens per sequence: 1 for decode, k + 1 for a verify step

    @property
    def num_tokens(self) -> int:
        return self.batch_size * self.query_len


@dataclass(frozen=True)
class GraphPlan:
    """The graphs to capture and the one that serves a given decode step.

    ``tiered``: the batch buckets that get one graph per seq-len tier (their decode kernel's
    partition count follows the context); every other bucket gets one graph at the last tier.
    ``verify_query_lens``: q = k + 1 of the verify graphs (empty without speculation), one
    per bucket of ``verify_batch_sizes``, at the last tier.
    """

    batch_sizes: tuple[int, ...]
    seq_len_tiers: tuple[int, ...]
    block_size: int
    tiered: frozenset[int]
    verify_batch_sizes: tuple[int, ...] = ()
    verify_query_lens: tuple[int, ...] = ()
    num_groups: int = 1  # per-layer-group tables (core/kv_groups.py)

    def keys(self) -> list[GraphKey]:
        """Every graph, most tokens first (so that smaller ones reuse the shared memory
        pool); decode graphs of one size by tier, longest first."""
        keys = []
        for b in self.batch_sizes:
            tiers = self.seq_len_tiers if b in self.tiered else self.seq_len_tiers[-1:]
            keys.extend(self._key(b, t) for t in tiers)
        last = self.seq_len_tiers[-1]
        for q in self.verify_query_lens:
            keys.extend(self._key(b, last, q) for b in self.verify_batch_sizes)
        return sorted(keys, key=lambda k: (k.num_tokens, k.max_seq_len), reverse=True)

    def key_for(self, num_seqs: int, max_seq_len: int, query_len: int = 1) -> GraphKey | None:
        """The graph for a decode step (query_len 1) or a verify step (query_len k + 1 for
        every sequence), or None when it must run eagerly (too many sequences, a context
        longer than the last tier, a query length without graphs)."""
        if max_seq_len > self.seq_len_tiers[-1]:
            return None
        if query_len != 1:
            if query_len not in self.verify_query_lens:
                return None
            b = next((s for s in self.verify_batch_sizes if s >= num_seqs), None)
            return None if b is None else self._key(b, self.seq_len_tiers[-1], query_len)
        b = next((s for s in self.batch_sizes if s >= num_seqs), None)
        if b is None:
            return None
        if b not in self.tiered:
            return self._key(b, self.seq_len_tiers[-1])
        return self._key(b, next(t for t in self.seq_len_tiers if t >= max_seq_len))

    @property
    def max_buffer_words(self) -> int:
        return max(
            buffer_words(k.batch_size, k.block_table_width, k.query_len, self.num_groups)
            for k in self.keys()
        )

    def _key(self, batch_size: int, tier: int, query_len: int = 1) -> GraphKey:
        return GraphKey(batch_size, tier, -(-tier // self.block_size), query_len)


def cuda_graph_plan(
    config: RunnerConfig,
    model_config: ModelConfig,
    kv_cache: torch.Tensor,
    max_model_len: int,
    num_groups: int = 1,
) -> GraphPlan | None:
    """The decode graphs this runner captures (and verify graphs for the configured k under
    speculative decoding), or None when every step runs eagerly:
    ``enforce_eager``, a cache not served by the CUDA kernels (CPU, float32, a build without
    kernels, PAGEDD_ATTENTION_BACKEND=torch), or pipeline parallelism (its stages' sends and
    receives are not captured yet). Windowed, soft-capped and sink layers run the kernels too
    (their modifiers are per-layer constants a graph holds)."""
    if config.pipeline_parallel_size > 1:
        return None
    if config.enforce_eager or not uses_kernels(kv_cache):
        return None
    tp = config.tensor_parallel_size
    spec = config.speculative
    plan = make_graph_plan(
        config.max_num_seqs,
        min(config.max_seq_len_to_capture, max_model_len),
        config.block_size,
        model_config.num_key_value_heads // tp,
        model_config.num_attention_heads // tp,
        model_config.head_dim,
        fp8_cache=is_fp8(kv_cache.dtype),
        num_speculative_tokens=0 if spec is None else spec.num_speculative_tokens,
        max_verify_seqs=0 if spec is None else spec.disable_by_batch_size,
    )
    return plan if num_groups == 1 else replace(plan, num_groups=num_groups)


def make_graph_plan(
    max_num_seqs: int,
    max_seq_len_to_capture: int,
    block_size: int,
    num_kv_heads: int,  # this rank's
    num_q_heads: int,  # this rank's
    head_dim: int = 128,
    fp8_cache: bool = False,
    num_speculative_tokens: int = 0,
    max_verify_seqs: int = 0,
) -> GraphPlan:
    """The buckets and tiers (cuda_graph_inputs.py); a bucket needs one graph per tier unless
    its decode runs on tensor cores with one partition at every tier (then the graph of the
    longest tier serves every context with one partition, as eager does). fp8_cache: the KV
    cache is float8_e4m3fn, which splits up to more sequences (decode_tc_partition_size).
    num_speculative_tokens (k > 0): verify graphs of query length k + 1 for the buckets up to
    the first holding ``max_verify_seqs`` sequences (speculation's disable_by_batch_size)."""
    batch_sizes = capture_batch_sizes(max_num_seqs)
    tiers = capture_seq_len_tiers(max_seq_len_to_capture)

    def one_graph(b: int) -> bool:
        if decode_kernel(num_q_heads // num_kv_heads, head_dim) != "tensor_cores":
            return False
        return all(decode_tc_partition_size(b, num_kv_heads, t, fp8_cache) >= t for t in tiers)

    tiered = frozenset(b for b in batch_sizes if not one_graph(b))
    verify_sizes: list[int] = []
    if num_speculative_tokens > 0 and max_verify_seqs > 0:
        for b in batch_sizes:
            verify_sizes.append(b)
            if b >= max_verify_seqs:
                break
    verify_lens = (num_speculative_tokens + 1,) if verify_sizes else ()
    return GraphPlan(
        tuple(batch_sizes), tuple(tiers), block_size, tiered, tuple(verify_sizes), verify_lens
    )


def buffer_words(batch_size: int, width: int, query_len: int = 1, num_groups: int = 1) -> int:
    """int64 words of the static buffer of a graph of this bucket, block-table width, query
    length and number of layer groups."""
    b, t, g = batch_size, batch_size * query_len, num_groups
    return (2 + g) * t + -(-(g * b * width + 2 * b + 1) // 2)


def pack_graph_inputs(
    input_ids: np.ndarray,  # [n * q] int64
    positions: np.ndarray,  # [n * q] int64
    slot_mapping: np.ndarray,  # [n * q] int64; groups: [G, n * q]
    block_tables: np.ndarray,  # [n, any width] int32; groups: [G, n, any width]
    seq_lens: np.ndarray,  # [n] int32
    key: GraphKey,
    num_groups: int = 1,
) -> np.ndarray:
    """-> [buffer_words(b, w, q, G)] int64: the step's n sequences of q = key.query_len
    tokens each, padded to ``key``'s bucket.

    Block-table columns past ``w`` are dropped: no sequence of the step reaches them, since
    every context is at most the tier (a step may hold a block allocated ahead).
    """
    n, b, w, q = len(seq_lens), key.batch_size, key.block_table_width, key.query_len
    if n > b:
        raise ValueError(f"{n} sequences do not fit a graph of batch size {b}")
    if len(input_ids) != n * q:
        raise ValueError(f"{len(input_ids)} tokens are not {n} sequences of {q} tokens")
    t, nt, g = b * q, n * q, num_groups
    words = np.zeros(buffer_words(b, w, q, g), dtype=np.int64)
    words[:nt] = input_ids
    words[t : t + nt] = positions
    slots = words[2 * t : (2 + g) * t].reshape(g, t)
    slots[:, :nt] = slot_mapping.reshape(g, nt)
    slots[:, nt:] = PAD_SLOT_ID
    ints = words.view(np.int32)
    bt, lens, qsl = _int32_fields(ints[2 * (2 + g) * t :], b, w, g)
    tables = block_tables.reshape(g, n, block_tables.shape[-1])
    cols = min(w, tables.shape[2])
    bt[:, :n, :cols] = tables[:, :, :cols]  # padding rows stay block 0
    lens[:n] = seq_lens
    lens[n:] = q  # a padding row's queries are its whole context: none past it
    qsl[:] = np.arange(0, (b + 1) * q, q, dtype=np.int32)  # every row is q query tokens
    return words


def graph_input_views(
    buffer: torch.Tensor, key: GraphKey, num_groups: int = 1
) -> dict[str, torch.Tensor]:
    """Views of the static buffer (int64, contiguous) in ``pack_graph_inputs``' layout, T =
    b * q: input_ids [T] int64, positions [T] int64, slot_mapping [T] int64, block_tables
    [b, w] int32, seq_lens [b] int32, query_start_loc [b + 1] int32; and with groups,
    group_slot_mapping [G, T] and group_block_tables [G, b, w]."""
    b, w, q, g = key.batch_size, key.block_table_width, key.query_len, num_groups
    t = b * q
    ints = buffer[: buffer_words(b, w, q, g)].view(torch.int32)
    block_tables, seq_lens, query_start_loc = _int32_fields(ints[2 * (2 + g) * t :], b, w, g)
    slots = buffer[2 * t : (2 + g) * t].view(g, t)
    views = {
        "input_ids": buffer[:t],
        "positions": buffer[t : 2 * t],
        "slot_mapping": slots[0],
        "block_tables": block_tables[0],
        "seq_lens": seq_lens,
        "query_start_loc": query_start_loc,
    }
    if g > 1:
        views["group_slot_mapping"] = slots
        views["group_block_tables"] = block_tables
    return views


def _int32_fields(ints, b: int, w: int, g: int = 1):
    """(block_tables [g, b, w], seq_lens [b], query_start_loc [b + 1]) views of the int32
    part."""
    n = g * b * w
    block_tables = ints[:n].reshape(g, b, w)
    seq_lens = ints[n : n + b]
    query_start_loc = ints[n + b : n + 2 * b + 1]
    return block_tables, seq_lens, query_start_loc
