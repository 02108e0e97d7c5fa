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
"""

from __future__ import annotations

from dataclasses import dataclass

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

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_decodes(self) -> int:
        return self.num_seqs - self.num_prefills
