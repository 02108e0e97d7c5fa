"""The Sampler: logits of one step -> one token per sequence, plus logprobs.

Order of operations per row (vLLM's; 1-3: logits_processing.py):
  1. min_tokens mask (EOS / stop ids -> -inf while the row is short of min_tokens)
  2. logit bias (OpenAI's logit_bias: a value in [-100, 100] added to chosen tokens' logits)
  3. repetition penalty (prompt + output), then frequency and presence penalties (output)
  4. greedy rows (temperature 0): argmax here
  5. temperature, then top-k, top-p (on the top-k-masked distribution), min-p
  6. sample with the exponential race: argmax(probs / q), q ~ Exp(1), drawn per seeded row
     from that row's own generator, so a seeded row gets the same token whatever the batch.

Logprobs (``logprobs`` and ``chosen_logprobs``) are the log_softmax of the RAW model logits,
before penalties, masks and temperature: what the model thinks, not what the sampler did
(vLLM's default "raw_logprobs"). ``sample_packed`` does everything on the device and returns
one packed tensor; ``unpack`` reads its host copy. ``Sampler()(...)`` does both: the only
host-device sync is that one copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pydaemon.sampling.logits_processing import processed_logits
from pydaemon.sampling.sampling_metadata import SamplingMetadata


@dataclass
class SamplerOutput:
    """One entry per row of the step, in row order."""

    sampled_token_ids: list[int]
    # Top-`logprobs` {token_id: logprob} plus the sampled token; None where logprobs is None.
    logprobs: list[dict[int, float] | None]
    # Raw-logits logprob of the sampled token (for cumulative_logprob).
    chosen_logprobs: list[float]


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, max_top_k: int, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask (-inf) tokens outside each row's top-k and then outside its top-p nucleus.

    logits: [num_seqs, vocab] float32; top_k: [num_seqs] int64 (0 = off);
    top_p: [num_seqs] float32 (1.0 = off). Top-p keeps the smallest set of most likely tokens
    whose probability (after top-k) reaches p, always at least one token.
    """
    vocab_size = logits.shape[1]
    if top_p is None:
        if top_k is None:
            return logits
        # Top-k alone: a partial topk instead of a full sort. Ties with the k-th value are kept.
        k = min(max_top_k, vocab_size)
        top_values = logits.topk(k, dim=-1).values  # [num_seqs, k]
        row_k = torch.where(top_k > 0, top_k, k).clamp(max=k)
        kth_value = top_values.gather(1, (row_k - 1)[:, None])
        kth_value = torch.where(top_k[:, None] > 0, kth_value, float("-inf"))
        return logits.masked_fill(logits < kth_value, float("-inf"))

    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        row_k = torch.where(top_k > 0, top_k, vocab_size).clamp(max=vocab_size)
        kth_value = sorted_logits.gather(1, (vocab_size - row_k)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_value, float("-inf"))
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    outside = cumulative <= (1.0 - top_p[:, None])
    outside[:, -1] = False  # the most likely token always stays
    sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p * (the row's top probability).

    logits: [num_seqs, vocab] float32; min_p: [num_seqs] float32 (0.0 = off).
    """
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _exponential_noise(probs: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """q ~ Exp(1) of probs' shape ([num_seqs, vocab]): one batched draw for the unseeded rows,
    then each seeded row drawn from its own generator, so a seeded row's draw does not depend
    on the batch around it."""
    noise = torch.empty_like(probs)
    if not all(g is not None for g in metadata.generators):
        noise.exponential_()
    for row, generator in enumerate(metadata.generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    return noise


def tempered_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The sampler's steps from temperature on: temperature, top-k / top-p, min-p. One
    function for the Sampler and the speculative rejection sampler, so that verification
    keeps the distribution sampling uses. logits: [num_rows, vocab] float32 (penalized;
    greedy rows: temperature 1, no filter) -> the same shape."""
    logits = logits / metadata.temperature[:, None]
    logits = apply_top_k_top_p(logits, metadata.top_k, metadata.max_top_k, metadata.top_p)
    if metadata.min_p is not None:
        logits = apply_min_p(logits, metadata.min_p)
    return logits


class Sampler:
    """Stateless: ``Sampler()(logits, metadata) -> SamplerOutput``."""

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """logits: [num_seqs, vocab] float32, one row per sequence of ``metadata``."""
        _, packed = self.sample_packed(logits, metadata)
        return self.unpack(packed.tolist(), metadata)

    def sample_packed(
        self, logits: torch.Tensor, metadata: SamplingMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples on the device without waiting for it. logits: [num_seqs, vocab] float32.
        -> (sampled [num_seqs] int64, packed [num_seqs, 2 + 2 * max_num_logprobs] float64),
        both on logits' device; ``unpack(packed.tolist(), metadata)`` reads the packed rows."""
        if logits.dim() != 2 or logits.shape[0] != metadata.num_seqs:
            raise ValueError(
                f"Sampler: logits must be [num_seqs={metadata.num_seqs}, vocab], "
                f"got {tuple(logits.shape)}"
            )
        if logits.dtype != torch.float32:
            raise ValueError(f"Sampler: logits must be float32, got {logits.dtype}")
        vocab_size = logits.shape[1]
        if metadata.max_min_tokens_token_id >= vocab_size:
            raise ValueError(
                f"Sampler: min_tokens stop id {metadata.max_min_tokens_token_id} is outside "
                f"the vocabulary (size {vocab_size})"
            )

        if metadata.max_logit_bias_token_id >= vocab_size:
            raise ValueError(
                f"Sampler: logit_bias token id {metadata.max_logit_bias_token_id} is outside "
                f"the vocabulary (size {vocab_size})"
            )
        sampled = self._sample(processed_logits(logits, metadata), metadata)
        return sampled, self._pack(logits, sampled, metadata)

    @staticmethod
    def _sample(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """logits: [num_seqs, vocab] (penalized). Returns [num_seqs] int64 on the device."""
        if metadata.all_greedy:
            return logits.argmax(dim=-1)
        greedy_ids = None if metadata.all_random else logits.argmax(dim=-1)
        probs = tempered_logits(logits, metadata).softmax(dim=-1)
        sampled = (probs / _exponential_noise(probs, metadata)).argmax(dim=-1)
        if greedy_ids is not None:
            sampled = torch.where(metadata.is_greedy, greedy_ids, sampled)
        return sampled

    @staticmethod
    def _pack(
        raw_logits: torch.Tensor, sampled: torch.Tensor, metadata: SamplingMetadata
    ) -> torch.Tensor:
        """raw_logits: [num_seqs, vocab]; sampled: [num_seqs] int64.
        -> [num_seqs, 2 + 2 * num_top] float64: id, its logprob, top ids, top logprobs."""
        num_top = metadata.max_num_logprobs or 0
        if metadata.max_num_logprobs is None:
            # Only the chosen token's logprob: a logsumexp, not a full log_softmax.
            chosen = raw_logits.gather(1, sampled[:, None]) - raw_logits.logsumexp(
                dim=-1, keepdim=True
            )
            columns = [sampled[:, None].double(), chosen.double()]
        else:
            logprobs = raw_logits.log_softmax(dim=-1)
            chosen = logprobs.gather(1, sampled[:, None])
            columns = [sampled[:, None].double(), chosen.double()]
            if num_top > 0:
                top_values, top_ids = logprobs.topk(min(num_top, logprobs.shape[1]), dim=-1)
                if metadata.asked_logprob_rows is not None:  # logprob_token_ids' rows
                    rows, cols = metadata.asked_logprob_rows, metadata.asked_logprob_cols
                    ids = metadata.asked_logprob_token_ids
                    top_ids[rows, cols] = ids
                    top_values[rows, cols] = logprobs[rows, ids]
                columns += [top_ids.double(), top_values.double()]
        # Ids (< 2**53) and float32 logprobs are exact in float64: one packed tensor, so the
        # step pays exactly one device-to-host copy.
        return torch.cat(columns, dim=1)

    @staticmethod
    def unpack(rows: list[list[float]], metadata: SamplingMetadata) -> SamplerOutput:
        """rows: the host copy of ``sample_packed``'s packed tensor, as lists."""
        num_top = (len(rows[0]) - 2) // 2 if rows else 0
        sampled_ids: list[int] = []
        chosen_logprobs: list[float] = []
        out_logprobs: list[dict[int, float] | None] = []
        for row, asked in zip(rows, metadata.num_logprobs, strict=True):
            token_id = int(row[0])
            sampled_ids.append(token_id)
            chosen_logprobs.append(row[1])
            if asked is None:
                out_logprobs.append(None)
                continue
            entry = {
                int(t): v
                for t, v in zip(
                    row[2 : 2 + asked], row[2 + num_top : 2 + num_top + asked], strict=True
                )
            }
            entry[token_id] = row[1]
            out_logprobs.append(entry)
        return SamplerOutput(sampled_ids, out_logprobs, chosen_logprobs)
