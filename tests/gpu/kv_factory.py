"""Random paged KV caches with shuffled block tables, and a float64 decode reference."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from pydaemon.quantization.kv_cache_fp8 import FP8_DTYPE, dequantize_fp8, quantize_fp8


@dataclass
class PagedBatch:
    kv_cache: torch.Tensor  # [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]
    layer: int
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    seq_lens_cpu: list[int]

    @property
    def key_cache(self) -> torch.Tensor:
        return self.kv_cache[:, self.layer, 0]

    @property
    def value_cache(self) -> torch.Tensor:
        return self.kv_cache[:, self.layer, 1]


def make_paged_batch(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    num_layers: int = 2,
    layer: int = 1,
    extra_blocks: int = 3,
    gen: torch.Generator | None = None,
) -> PagedBatch:
    """Blocks handed out in a random permutation, so no block table is in order."""
    blocks_per_seq = [max(1, -(-n // block_size)) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    kv_cache = torch.randn(
        num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim,
        device="cuda", dtype=dtype, generator=gen,
    )  # fmt: skip
    perm = torch.randperm(num_blocks, device="cpu", generator=None).tolist()
    max_blocks = max(blocks_per_seq) + 1  # one padding column
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    pos = 0
    for i, nb in enumerate(blocks_per_seq):
        tables[i, :nb] = torch.tensor(perm[pos : pos + nb], dtype=torch.int32)
        pos += nb
    return PagedBatch(
        kv_cache=kv_cache,
        layer=layer,
        block_tables=tables.cuda(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        seq_lens_cpu=list(seq_lens),
    )


def fp8_batch(lens, num_kv_heads, head_dim, block_size, k_scale, v_scale, spread=3.0):
    """-> (batch with an fp8 cache, the same batch with the dequantized cache in float32).
    K/V ~ N(0, spread) in real units, stored as e4m3 of x / scale."""
    full = make_paged_batch(lens, num_kv_heads, head_dim, block_size, torch.float32)
    real = full.kv_cache * spread
    fp8 = torch.empty_like(real, dtype=FP8_DTYPE)
    fp8[:, :, 0] = quantize_fp8(real[:, :, 0], k_scale)
    fp8[:, :, 1] = quantize_fp8(real[:, :, 1], v_scale)
    deq = torch.empty_like(real)
    deq[:, :, 0] = dequantize_fp8(fp8[:, :, 0], k_scale, torch.float32)
    deq[:, :, 1] = dequantize_fp8(fp8[:, :, 1], v_scale, torch.float32)
    return dataclasses.replace(full, kv_cache=fp8), dataclasses.replace(full, kv_cache=deq)


def gather_kv(batch: PagedBatch, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence, contiguous: [num_kv_heads, seq_len, head_dim] each."""
    n = batch.seq_lens_cpu[seq]
    _, num_kv_heads, bs, head_dim = batch.key_cache.shape
    blocks = batch.block_tables[seq, : max(1, -(-n // bs))].long()
    k = batch.key_cache[blocks].permute(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)
    v = batch.value_cache[blocks].permute(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)
    return k[:, :n], v[:, :n]


def reference_decode(query: torch.Tensor, batch: PagedBatch, scale: float) -> torch.Tensor:
    """float64 decode attention; query: [num_seqs, num_q_heads, head_dim] -> same shape."""
    num_q_heads = query.shape[1]
    out = torch.zeros(query.shape, dtype=torch.float64, device=query.device)
    for s, n in enumerate(batch.seq_lens_cpu):
        if n == 0:
            continue
        k, v = gather_kv(batch, s)
        group = num_q_heads // k.shape[0]
        k = k.double().repeat_interleave(group, dim=0)  # [num_q_heads, n, head_dim]
        v = v.double().repeat_interleave(group, dim=0)
        q = query[s].double().unsqueeze(1)  # [num_q_heads, 1, head_dim]
        p = torch.softmax((q @ k.transpose(1, 2)) * scale, dim=-1)
        out[s] = (p @ v).squeeze(1)
    return out


def reference_prefill(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim], sequences packed in order
    batch: PagedBatch,
    query_lens: list[int],
    scale: float,
    chunk: int = 2048,
) -> torch.Tensor:
    """float64 causal attention of each sequence's last query_lens[s] tokens over its cache.

    Query token j of sequence s sits at position seq_len - query_len + j and sees keys
    [0, that]. Computed per head in query chunks, so 16k x 16k stays small. -> float64 query.shape
    """
    num_q_heads = query.shape[1]
    out = torch.zeros(query.shape, dtype=torch.float64, device=query.device)
    start = 0
    for s, (n, q_len) in enumerate(zip(batch.seq_lens_cpu, query_lens, strict=True)):
        k, v = gather_kv(batch, s)  # [num_kv_heads, n, head_dim]
        group = num_q_heads // k.shape[0]
        k_pos = torch.arange(n, device=query.device)
        for h in range(num_q_heads):
            kh, vh = k[h // group].double(), v[h // group].double()
            for c0 in range(0, q_len, chunk):
                c1 = min(q_len, c0 + chunk)
                q = query[start + c0 : start + c1, h].double()  # [c, head_dim]
                q_pos = torch.arange(n - q_len + c0, n - q_len + c1, device=query.device)
                scores = (q @ kh.T) * scale  # [c, n]
                scores.masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))
                out[start + c0 : start + c1, h] = torch.softmax(scores, dim=-1) @ vh
        start += q_len
    return out
