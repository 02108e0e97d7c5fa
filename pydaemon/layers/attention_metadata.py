"""Per-step inputs of the paged attention layers, built by the model runner.

KV-cache layout (one tensor for the whole model, allocated once at start-up):

    kv_cache: [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]

so that one block of every layer's K and V is one contiguous chunk: a swap or a
copy-on-write moves whole blocks with one copy each. Layer ``l`` sees the strided views

    key_cache   = kv_cache[:, l, 0]   # [num_blocks, num_kv_heads, block_size, head_dim]
    value_cache = kv_cache[:, l, 1]   # same shape; block stride = num_layers*2*H*bs*D

The innermost [block_size, head_dim] of one KV head is contiguous, so a kernel reads one
head's block as one run of memory. A token at position ``p`` of a sequence lives in block
``block_table[p // block_size]`` at offset ``p % block_size``; its slot is
``block_id * block_size + offset``.

Token order in a step: sequences with prefill work (query_len >= 1, possibly a chunk) come
first, then decode sequences (query_len == 1). ``num_prefills`` counts the former.

Per-layer-group tables (core/kv_groups.py): ``kv_cache`` is [num_blocks, num_slots, 2, ...],
a layer reads slot ``layer_slot[l]`` (``worker.kv_cache.LayerSlotCache``), and ``groups[g]``
is the metadata of group g's layers: the same step with group g's ``block_tables`` and
``slot_mapping`` (``groups[0]`` is this object). ``PagedAttention.kv_group`` picks it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    num_prefills: int  # sequences [0, num_prefills) run prefill (chunks)
    num_prefill_tokens: int  # tokens [0, num_prefill_tokens) belong to them
    num_decode_tokens: int  # the rest: one token per decode sequence
    slot_mapping: torch.Tensor  # [num_tokens] int64, slot of each new token (-1: skip)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int32, context length after this step
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query lengths
    max_seq_len: int
    max_query_len: int
    # Host copies, so that Python-side loops (CPU path, prefill via SDPA) never read a
    # device tensor back (no host-device sync inside the forward pass).
    seq_lens_cpu: list[int]
    query_lens_cpu: list[int]
    groups: list[AttentionMetadata] | None = None  # per layer group; None: one table

    def with_groups(
        self, slot_mappings: torch.Tensor, block_tables: torch.Tensor
    ) -> AttentionMetadata:
        """Sets ``groups`` from [G, num_tokens] slot mappings and [G, num_seqs, max_blocks]
        block tables (group 0's are this object's); returns self."""
        self.groups = [self] + [
            replace(self, slot_mapping=slot_mappings[g], block_tables=block_tables[g])
            for g in range(1, slot_mappings.shape[0])
        ]
        return self

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_decodes(self) -> int:
        return self.num_seqs - self.num_prefills


def chunk_metadata(
    block_tables: np.ndarray | list[np.ndarray],
    starts: np.ndarray,
    query_lens: np.ndarray,
    block_size: int,
    device: torch.device,
) -> tuple[AttentionMetadata, np.ndarray]:
    """Metadata for a step of chunks, every sequence run as a prefill over its cached context
    (the proposers' forwards: a draft model's or an EAGLE head's, at any query length).

    block_tables: [num_seqs, max_blocks] int32 (or one table per sequence); starts: [num_seqs], position of each chunk's
    first token; query_lens: [num_seqs] >= 1. -> (metadata, positions [num_tokens] int64)."""
    if isinstance(block_tables, list):  # padded with 0
        tables = np.zeros((len(block_tables), max(map(len, block_tables))), dtype=np.int32)
        for i, table in enumerate(block_tables):
            tables[i, : len(table)] = table
        block_tables = tables
    query_lens = query_lens.astype(np.int32)
    query_start = np.zeros(len(query_lens) + 1, dtype=np.int32)
    np.cumsum(query_lens, out=query_start[1:])
    seq_of_token = np.repeat(np.arange(len(query_lens)), query_lens)
    positions = (np.arange(int(query_start[-1])) - query_start[seq_of_token]).astype(np.int64)
    positions += starts.astype(np.int64)[seq_of_token]
    slots = block_tables[seq_of_token, positions // block_size].astype(np.int64) * block_size
    slots += positions % block_size
    seq_lens = (starts + query_lens).astype(np.int32)
    meta = AttentionMetadata(
        num_prefills=len(query_lens),
        num_prefill_tokens=int(query_start[-1]),
        num_decode_tokens=0,
        slot_mapping=to_device(slots, device),
        block_tables=to_device(np.ascontiguousarray(block_tables, np.int32), device),
        seq_lens=to_device(seq_lens, device),
        query_start_loc=to_device(query_start, device),
        max_seq_len=int(seq_lens.max()),
        max_query_len=int(query_lens.max()),
        seq_lens_cpu=seq_lens.tolist(),
        query_lens_cpu=query_lens.tolist(),
    )
    return meta, positions


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on ``device``: through pinned memory without blocking on CUDA (a pageable
    copy would wait for the work already queued: a host-device sync in the step)."""
    tensor = torch.from_numpy(array)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor
