"""The sampler's steps before temperature, in vLLM's order: the min_tokens mask, the logit
bias, then the repetition and presence / frequency penalties. One function for the Sampler and
the speculative rejection sampler, so that verification keeps the distribution sampling uses.
The input logits are never changed in place (they are the raw logits logprobs come from)."""

from __future__ import annotations

import torch

from pydaemon.sampling.penalties import (
    apply_logit_bias,
    apply_min_tokens_mask,
    apply_presence_frequency_penalties,
    apply_repetition_penalty,
)
from pydaemon.sampling.sampling_metadata import SamplingMetadata


def processed_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """logits: [num_rows, vocab] float32 -> a tensor of the same shape (``logits`` itself
    when no row asks for any of these steps)."""
    raw = logits
    if metadata.min_tokens_rows is not None:
        logits = apply_min_tokens_mask(
            logits.clone(), metadata.min_tokens_rows, metadata.min_tokens_token_ids
        )
    if metadata.logit_bias_rows is not None:
        logits = apply_logit_bias(
            logits.clone() if logits is raw else logits,
            metadata.logit_bias_rows,
            metadata.logit_bias_token_ids,
            metadata.logit_bias_values,
        )
    if metadata.output_token_ids is not None:  # some row has a penalty
        if metadata.prompt_token_ids is not None:
            logits = apply_repetition_penalty(
                logits,
                metadata.prompt_token_ids,
                metadata.output_token_ids,
                metadata.repetition_penalty,
            )
        logits = apply_presence_frequency_penalties(
            logits, metadata.output_token_ids, metadata.presence_penalty, metadata.frequency_penalty
        )
    return logits
