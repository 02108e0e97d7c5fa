"""float64 references of paged attention with score modifiers (sliding window, soft-cap, sinks)
and batches whose out-of-window blocks are poisoned (NaN), to prove the kernels never read
them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_factory import PagedBatch, gather_kv


@dataclass(frozen=True)
class Mods:
    sliding_window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None  # [num_q_heads], the query's dtype

    def kwargs(self) -> dict:
        return {"sliding_window": self.sliding_window, "softcap": self.softcap, "sinks": self.sinks}

    def describe(self) -> str:
        return f"window={self.sliding_window} softcap={self.softcap} sinks={self.sinks is not None}"


def poison_out_of_window(
    batches: PagedBatch | list[PagedBatch], first_query_pos: list[int], window: int | None
) -> int:
    """Points every block-table entry of a block wholly before its sequence's window (the
    window of its first query token) at a block of NaN (K and V of every layer, in each of
    ``batches``: batches sharing one block table, e.g. an fp8 cache and its dequantized
    copy): a kernel that reads one gets NaN. -> how many entries were poisoned."""
    batches = batches if isinstance(batches, list) else [batches]
    batch = batches[0]
    if window is None:
        return 0
    bs = batch.key_cache.shape[2]
    tables = batch.block_tables.cpu()
    used = set(tables.flatten().tolist())
    spare = [b for b in range(batch.kv_cache.shape[0]) if b not in used]
    assert spare, "no spare block to poison (kv_factory leaves extra_blocks)"
    poison = spare[0]
    for b in batches:
        b.kv_cache[poison] = float("nan")  # float8_e4m3fn has a NaN too
    count = 0
    for s, pos in enumerate(first_query_pos):
        first_key = max(0, pos - window + 1)
        for b in range(first_key // bs):  # blocks [0, first_key // bs) end before first_key
            tables[s, b] = poison
            count += 1
    for b in batches:
        b.block_tables.copy_(tables.to(b.block_tables.device))
    return count


def reference_paged(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim], sequences packed in order
    batch: PagedBatch,
    query_lens: list[int],
    scale: float,
    mods: Mods,
) -> torch.Tensor:  # float64, query.shape
    """Sequence s's query_lens[s] last tokens over its cache, with the modifiers: scores
    scaled, soft-capped, masked (causal and window), a sink column joined, softmax, dropped."""
    num_q_heads = query.shape[1]
    out = torch.zeros(query.shape, dtype=torch.float64, device=query.device)
    start = 0
    for s, (n, q_len) in enumerate(zip(batch.seq_lens_cpu, query_lens, strict=True)):
        if n == 0:
            continue
        k, v = gather_kv(batch, s)  # [num_kv_heads, n, head_dim]
        group = num_q_heads // k.shape[0]
        k = k.double().repeat_interleave(group, dim=0)  # [num_q_heads, n, head_dim]
        v = v.double().repeat_interleave(group, dim=0)
        q = query[start : start + q_len].double().transpose(0, 1)  # [num_q_heads, q_len, d]
        q_pos = torch.arange(n - q_len, n, device=query.device)
        k_pos = torch.arange(n, device=query.device)
        scores = (q @ k.transpose(1, 2)) * scale  # [num_q_heads, q_len, n]
        if mods.softcap is not None:
            scores = mods.softcap * torch.tanh(scores / mods.softcap)
        masked = k_pos[None, :] > q_pos[:, None]  # [q_len, n]
        if mods.sliding_window is not None:
            masked |= k_pos[None, :] <= q_pos[:, None] - mods.sliding_window
        scores = scores.masked_fill(masked, float("-inf"))
        if mods.sinks is not None:
            sinks = mods.sinks.double().view(-1, 1, 1).expand(num_q_heads, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        # Keys no query attends may hold NaN (poisoned blocks): 0 * NaN must not reach out.
        v = v.masked_fill(masked.all(dim=0)[None, :, None], 0.0)
        out[start : start + q_len] = (probs @ v).transpose(0, 1)
        start += q_len
    return out
