"""RejectionSampler: verifies drafted tokens against the target model, keeping its distribution.

Each verified sequence brings ``m`` drafts d_1..d_m and ``m + 1`` logits rows: row j (0-based)
is the target's distribution for the token after d_j (row 0: after the sequence's last real
token), so row j verifies d_{j+1} and row m gives the bonus token. Drafts come from
deterministic proposers (n-gram lookup, greedy draft models): the draft distribution q is a
point mass on d, and the speculative-sampling rule (Leviathan et al., Chen et al.) becomes

  accept d with probability p(d); on rejection, sample from p with d removed (renormalised);
  after m acceptances, sample the bonus token from row m's p.

The output is then distributed exactly as sampling from p token by token. ``p`` is the
sampler's distribution (min_tokens mask, penalties, temperature, top-k, top-p, min-p: the
steps of pydaemon's Sampler, applied per row with the drafts before the row counted as
output). Greedy rows accept while the draft equals the argmax and then emit the argmax, so
their tokens are those of non-speculative greedy decoding.

Everything runs on the device; ``verify`` returns one packed float64 tensor per row
(draft, accepted, fallback, their raw logprobs, top-k ids and logprobs) whose host copy ``accepted_runs`` turns into each sequence's tokens. Seeded
rows draw their uniforms and noise from the sequence's own generator, in row order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pydaemon.sampling.logits_processing import processed_logits
from pydaemon.sampling.sampler import tempered_logits
from pydaemon.sampling.sampling_metadata import SamplingMetadata


@dataclass
class AcceptedRun:
    """What one verified sequence emits: its accepted drafts, then one sampled token."""

    token_ids: list[int]
    chosen_logprobs: list[float]  # raw-logits logprob of each token
    logprobs: list[dict[int, float] | None]  # top-k asks, per token
    num_drafts: int  # drafts it verified


def target_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The Sampler's steps before temperature (min_tokens mask, logit bias, penalties: one
    function for both). logits: [num_rows, vocab] float32 -> the same shape."""
    return processed_logits(logits, metadata)


def target_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """logits: [num_rows, vocab] (penalized) -> [num_rows, vocab] float32 probabilities after
    temperature, top-k, top-p and min-p (greedy rows: temperature 1, no filter; unused)."""
    return tempered_logits(logits, metadata).softmax(dim=-1)


class RejectionSampler:
    """Stateless: ``verify`` on the device, ``accepted_runs`` on the host copy."""

    def verify(
        self, logits: torch.Tensor, draft_ids: torch.Tensor, metadata: SamplingMetadata
    ) -> torch.Tensor:
        """logits: [num_rows, vocab] float32 raw target logits; draft_ids: [num_rows] int64,
        the draft each row verifies (-1 on a sequence's last row); metadata: one row per
        logits row. -> packed [num_rows, 5 + 2 * num_top] float64 on the device: draft id, accepted,
        fallback id, raw logprobs of fallback and draft, top ids, top logprobs."""
        num_rows, vocab_size = logits.shape
        raw_logits = logits
        logits = target_logits(logits, metadata)
        has_draft = draft_ids >= 0
        safe_draft = torch.where(has_draft, draft_ids, 0)[:, None]  # [num_rows, 1]
        if metadata.all_greedy:
            fallback = logits.argmax(dim=-1)
            accepted = has_draft & (fallback == draft_ids)
        else:
            probs = target_probs(logits, metadata)
            uniform, noise = self._draws(num_rows, vocab_size, metadata, logits.device)
            p_draft = probs.gather(1, safe_draft)[:, 0]
            accepted = has_draft & (uniform < p_draft)
            residual = probs.scatter(1, safe_draft, torch.where(has_draft, 0.0, p_draft)[:, None])
            fallback = (residual / noise).argmax(dim=-1)
            # p(d) rounding to 1 but rejected: nothing left to sample, d stands.
            fallback = torch.where(residual.sum(dim=-1) > 0, fallback, safe_draft[:, 0])
            if not metadata.all_random:
                greedy_ids = logits.argmax(dim=-1)
                fallback = torch.where(metadata.is_greedy, greedy_ids, fallback)
                accepted = torch.where(
                    metadata.is_greedy, has_draft & (greedy_ids == draft_ids), accepted
                )
        logprobs = raw_logits.log_softmax(dim=-1)
        columns = [
            draft_ids[:, None].double(),
            accepted[:, None].double(),
            fallback[:, None].double(),
            logprobs.gather(1, fallback[:, None]).double(),
            logprobs.gather(1, safe_draft).double(),
        ]
        num_top = metadata.max_num_logprobs or 0
        if num_top > 0:
            top_values, top_ids = logprobs.topk(min(num_top, vocab_size), dim=-1)
            columns += [top_ids.double(), top_values.double()]
        return torch.cat(columns, dim=1)

    @staticmethod
    def _draws(
        num_rows: int, vocab_size: int, metadata: SamplingMetadata, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """uniform [num_rows] in [0, 1) and Exp(1) noise [num_rows, vocab]: one batched draw,
        then each seeded row from its own generator (the same one for all rows of a
        sequence, drawn in row order)."""
        uniform = torch.rand(num_rows, device=device)
        noise = torch.empty(num_rows, vocab_size, device=device).exponential_()
        for row, generator in enumerate(metadata.generators):
            if generator is not None:
                uniform[row] = torch.rand((), device=device, generator=generator)
                noise[row].exponential_(generator=generator)
        return uniform, noise

    @staticmethod
    def accepted_runs(
        rows: list[list[float]], num_drafts: list[int], num_logprobs: list[int | None]
    ) -> list[AcceptedRun]:
        """rows: the host copy of ``verify``'s packed tensor; num_drafts[s]: drafts of
        sequence s (its rows are the next num_drafts[s] + 1); num_logprobs: each sequence's
        top-logprobs ask. A sequence emits its drafts up to the first rejected one, then the
        fallback token of that row (the bonus token if none was rejected)."""
        num_top = (len(rows[0]) - 5) // 2 if rows else 0
        runs: list[AcceptedRun] = []
        start = 0
        for m, asked in zip(num_drafts, num_logprobs, strict=True):
            run = AcceptedRun([], [], [], m)
            for row in rows[start : start + m + 1]:
                is_draft = row[1] > 0.5
                token_id = int(row[0] if is_draft else row[2])
                chosen = row[4] if is_draft else row[3]
                run.token_ids.append(token_id)
                run.chosen_logprobs.append(chosen)
                top = None
                if asked is not None:
                    ids, values = row[5 : 5 + asked], row[5 + num_top : 5 + num_top + asked]
                    top = {int(t): v for t, v in zip(ids, values, strict=True)}
                    top[token_id] = chosen
                run.logprobs.append(top)
                if not is_draft:
                    break
            start += m + 1
            runs.append(run)
        return runs
