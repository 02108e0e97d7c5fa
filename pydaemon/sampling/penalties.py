"""Logit penalties and masks: repetition (HF/CTRL), presence / frequency (OpenAI), min_tokens,
and the logit bias (OpenAI)."""

from __future__ import annotations

import torch


def token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Occurrences of each token id per row.

    token_ids: [num_seqs, max_len] int64, padded with -1.
    Returns [num_seqs, vocab_size] int64.
    """
    num_seqs = token_ids.shape[0]
    # Padding (-1) and ids past the logits' vocab go to a dummy last column that is dropped:
    # no boolean indexing, so no host-device sync.
    index = torch.where((token_ids < 0) | (token_ids >= vocab_size), vocab_size, token_ids)
    counts = torch.zeros(num_seqs, vocab_size + 1, dtype=torch.int64, device=token_ids.device)
    counts.scatter_add_(1, index, torch.ones_like(index))
    return counts[:, :vocab_size]


def apply_repetition_penalty(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor,
    output_token_ids: torch.Tensor,
    repetition_penalty: torch.Tensor,
) -> torch.Tensor:
    """HF/CTRL repetition penalty on every token seen in the prompt or the output.

    logits: [num_seqs, vocab] float32; prompt_token_ids / output_token_ids: [num_seqs, len]
    int64 padded with -1; repetition_penalty: [num_seqs] float32 (1.0 = off).
    A seen token's positive logit is divided by the penalty, a negative one multiplied.
    """
    vocab_size = logits.shape[1]
    seen = (
        token_counts(prompt_token_ids, vocab_size) + token_counts(output_token_ids, vocab_size)
    ) > 0
    penalty = repetition_penalty[:, None].expand_as(logits)
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def apply_presence_frequency_penalties(
    logits: torch.Tensor,
    output_token_ids: torch.Tensor,
    presence_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
) -> torch.Tensor:
    """OpenAI penalties on the output tokens only.

    logits: [num_seqs, vocab] float32; output_token_ids: [num_seqs, len] int64 padded with -1;
    presence_penalty / frequency_penalty: [num_seqs] float32.
    logit[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0).
    """
    counts = token_counts(output_token_ids, logits.shape[1])
    logits = logits - frequency_penalty[:, None] * counts.to(logits.dtype)
    return logits - presence_penalty[:, None] * (counts > 0).to(logits.dtype)


def apply_min_tokens_mask(
    logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor
) -> torch.Tensor:
    """Set logits[rows[i], token_ids[i]] = -inf in place (rows / token_ids: [num_masked] int64).

    The -inf is made on the logits' device: ``logits[rows, ids] = float("-inf")`` would copy a
    scalar from pageable host memory, which waits for the stream (a stall under async
    scheduling, caught by tests/gpu/test_async_scheduling_gpu.py)."""
    neg_inf = torch.full((), float("-inf"), dtype=logits.dtype, device=logits.device)
    return logits.index_put_((rows, token_ids), neg_inf)


def apply_logit_bias(
    logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor, values: torch.Tensor
) -> torch.Tensor:
    """OpenAI's logit_bias: logits[rows[i], token_ids[i]] += values[i], in place (rows,
    token_ids: [num_biased] int64; values: [num_biased] float32, in [-100, 100])."""
    return logits.index_put_((rows, token_ids), values, accumulate=True)
