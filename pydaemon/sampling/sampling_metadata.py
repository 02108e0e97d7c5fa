"""Per-step sampling tensors, built only for the features some row of the batch uses."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pydaemon.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def make_generator(
    seed: int | None, seq_index: int, device: torch.device | str
) -> torch.Generator | None:
    """A torch.Generator for sequence ``seq_index`` of a request seeded with ``seed``.

    ``None`` when the request has no seed (it then draws from the batched, unseeded stream).
    The per-sequence seed is a splitmix64 mix of (seed, seq_index): the n sequences of one
    request get distinct streams, and the same (seed, seq_index) always gives the same stream.
    """
    if seed is None:
        return None
    if seq_index < 0:
        raise ValueError(f"make_generator: seq_index must be >= 0 (got {seq_index})")
    z = (seed * 0x9E3779B97F4A7C15 + (seq_index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    generator = torch.Generator(device=device)
    generator.manual_seed(z & ((1 << 63) - 1))
    return generator


def _to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on ``device``. To a GPU through pinned memory, non-blocking: a plain
    ``.to("cuda")`` waits for the stream, which would stall async scheduling behind the
    forward pass just launched."""
    if torch.device(device).type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def _padded(token_lists: Sequence[Sequence[int]], device: torch.device | str) -> torch.Tensor:
    """[num_seqs, max_len] int64, padded with -1 (the sampler maps -1 to a dummy column)."""
    max_len = max((len(t) for t in token_lists), default=0)
    rows = [list(t) + [-1] * (max_len - len(t)) for t in token_lists]
    return _to_device(torch.tensor(rows, dtype=torch.int64).reshape(len(rows), max_len), device)


@dataclass
class SamplingMetadata:
    """What the Sampler needs for one step; one row per sequence sampled in this step.

    Optional tensors are ``None`` when no row of the batch uses the feature, so an all-greedy
    batch without penalties carries nothing but the flags.
    """

    num_seqs: int
    all_greedy: bool
    all_random: bool
    # [num_seqs] float32; greedy rows hold 1.0 (never divided by zero). None if all_greedy.
    temperature: torch.Tensor | None
    # [num_seqs] bool, True where temperature == 0. None if all_greedy or all_random.
    is_greedy: torch.Tensor | None
    # [num_seqs] int64, 0 = disabled. None if no row uses top-k. max_top_k: largest k used.
    top_k: torch.Tensor | None
    max_top_k: int
    # [num_seqs] float32, 1.0 = disabled. None if no row uses top-p.
    top_p: torch.Tensor | None
    # [num_seqs] float32, 0.0 = disabled. None if no row uses min-p.
    min_p: torch.Tensor | None
    # [num_seqs] float32 each. None if no row uses any penalty.
    presence_penalty: torch.Tensor | None
    frequency_penalty: torch.Tensor | None
    repetition_penalty: torch.Tensor | None
    # [num_seqs, max_prompt_len] / [num_seqs, max_output_len] int64, padded with -1.
    # Built only when some row has a penalty (prompt ids only for repetition penalty).
    prompt_token_ids: torch.Tensor | None
    output_token_ids: torch.Tensor | None
    # min_tokens: positions (row, token_id) whose logit is set to -inf this step
    # (EOS / stop token ids of rows that have fewer than min_tokens outputs). None if none.
    min_tokens_rows: torch.Tensor | None  # [num_masked] int64
    min_tokens_token_ids: torch.Tensor | None  # [num_masked] int64
    max_min_tokens_token_id: int
    # logit_bias: logits[rows[i], token_ids[i]] += values[i] ([num_biased] each). None if none.
    logit_bias_rows: torch.Tensor | None
    logit_bias_token_ids: torch.Tensor | None  # int64
    logit_bias_values: torch.Tensor | None  # float32
    max_logit_bias_token_id: int
    # Per-row generator of seeded random rows, None for unseeded or greedy rows.
    generators: list[torch.Generator | None]
    has_seeded_rows: bool
    # Largest `logprobs` asked by a row (None: no row wants top logprobs), and the per-row ask.
    max_num_logprobs: int | None
    num_logprobs: list[int | None]
    # logprob_token_ids: the top-k column cols[i] of row rows[i] holds token_ids[i] (each
    # [num_asked] int64) instead of the i-th most likely token. None if no row asks.
    asked_logprob_rows: torch.Tensor | None = None
    asked_logprob_cols: torch.Tensor | None = None
    asked_logprob_token_ids: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        device: torch.device | str,
        stop_ids_for_min_tokens: Sequence[set[int]] | None = None,
    ) -> SamplingMetadata:
        """One row per sequence to sample. ``stop_ids_for_min_tokens[i]``: the ids (EOS unless
        ignore_eos, plus stop_token_ids) row i may not produce while it has fewer than
        ``min_tokens`` outputs; defaults to the row's ``stop_token_ids`` only. A token-id row is
        read only when its row uses a penalty or min_tokens (callers may pass lazy sequences)."""
        num_seqs = len(params)
        for name, value in (
            ("prompt_token_ids", prompt_token_ids),
            ("output_token_ids", output_token_ids),
            ("generators", generators),
        ):
            if len(value) != num_seqs:
                raise ValueError(
                    f"SamplingMetadata.build: {name} has {len(value)} rows, params has {num_seqs}"
                )
        if stop_ids_for_min_tokens is not None and len(stop_ids_for_min_tokens) != num_seqs:
            raise ValueError(
                f"SamplingMetadata.build: stop_ids_for_min_tokens has "
                f"{len(stop_ids_for_min_tokens)} rows, params has {num_seqs}"
            )

        greedy = [p.temperature == 0.0 for p in params]
        all_greedy = all(greedy)
        all_random = not any(greedy)

        def f32(values: list[float]) -> torch.Tensor:
            return _to_device(torch.tensor(values, dtype=torch.float32), device)

        temperature = is_greedy = top_k = top_p = min_p = None
        max_top_k = 0
        if not all_greedy:
            temperature = f32(
                [1.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)]
            )
            if not all_random:
                is_greedy = _to_device(torch.tensor(greedy, dtype=torch.bool), device)
            # Filters only matter for random rows: greedy rows take the argmax before them.
            ks = [0 if g else p.top_k for g, p in zip(greedy, params, strict=True)]
            if any(ks):
                top_k = _to_device(torch.tensor(ks, dtype=torch.int64), device)
                max_top_k = max(ks)
            ps = [1.0 if g else p.top_p for g, p in zip(greedy, params, strict=True)]
            if any(v < 1.0 for v in ps):
                top_p = f32(ps)
            mps = [0.0 if g else p.min_p for g, p in zip(greedy, params, strict=True)]
            if any(v > 0.0 for v in mps):
                min_p = f32(mps)

        presence = frequency = repetition = prompt_ids = output_ids = None
        if any(p.has_penalties for p in params):
            presence = f32([p.presence_penalty for p in params])
            frequency = f32([p.frequency_penalty for p in params])
            repetition = f32([p.repetition_penalty for p in params])
            output_ids = _padded(output_token_ids, device)
            if any(p.repetition_penalty != 1.0 for p in params):
                prompt_ids = _padded(prompt_token_ids, device)

        mask_rows: list[int] = []
        mask_ids: list[int] = []
        for i, p in enumerate(params):
            if p.min_tokens and len(output_token_ids[i]) < p.min_tokens:  # no row read if off
                ids = (
                    stop_ids_for_min_tokens[i]
                    if stop_ids_for_min_tokens is not None
                    else set(p.stop_token_ids)
                )
                for token_id in sorted(ids):
                    mask_rows.append(i)
                    mask_ids.append(token_id)
        min_tokens_rows = min_tokens_ids = None
        if mask_rows:
            min_tokens_rows = _to_device(torch.tensor(mask_rows, dtype=torch.int64), device)
            min_tokens_ids = _to_device(torch.tensor(mask_ids, dtype=torch.int64), device)

        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_values: list[float] = []
        for i, p in enumerate(params):
            for token_id, value in (p.logit_bias or {}).items():
                bias_rows.append(i)
                bias_ids.append(token_id)
                bias_values.append(value)
        logit_bias_rows = logit_bias_ids = logit_bias_values = None
        if bias_rows:
            logit_bias_rows = _to_device(torch.tensor(bias_rows, dtype=torch.int64), device)
            logit_bias_ids = _to_device(torch.tensor(bias_ids, dtype=torch.int64), device)
            logit_bias_values = f32(bias_values)

        gens = [None if g else gen for g, gen in zip(greedy, generators, strict=True)]
        num_logprobs = [p.logprobs for p in params]
        asked = [k for k in num_logprobs if k is not None]
        asked_rows: list[int] = []
        asked_cols: list[int] = []
        asked_ids: list[int] = []
        for i, p in enumerate(params):
            for col, token_id in enumerate(p.logprob_token_ids or ()):
                asked_rows.append(i)
                asked_cols.append(col)
                asked_ids.append(token_id)
        asked_tensors = [None, None, None]
        if asked_rows:
            asked_tensors = [
                _to_device(torch.tensor(values, dtype=torch.int64), device)
                for values in (asked_rows, asked_cols, asked_ids)
            ]
        return cls(
            num_seqs=num_seqs,
            all_greedy=all_greedy,
            all_random=all_random,
            temperature=temperature,
            is_greedy=is_greedy,
            top_k=top_k,
            max_top_k=max_top_k,
            top_p=top_p,
            min_p=min_p,
            presence_penalty=presence,
            frequency_penalty=frequency,
            repetition_penalty=repetition,
            prompt_token_ids=prompt_ids,
            output_token_ids=output_ids,
            min_tokens_rows=min_tokens_rows,
            min_tokens_token_ids=min_tokens_ids,
            max_min_tokens_token_id=max(mask_ids, default=-1),
            logit_bias_rows=logit_bias_rows,
            logit_bias_token_ids=logit_bias_ids,
            logit_bias_values=logit_bias_values,
            max_logit_bias_token_id=max(bias_ids, default=-1),
            generators=gens,
            has_seeded_rows=any(g is not None for g in gens),
            max_num_logprobs=max(asked) if asked else None,
            num_logprobs=num_logprobs,
            asked_logprob_rows=asked_tensors[0],
            asked_logprob_cols=asked_tensors[1],
            asked_logprob_token_ids=asked_tensors[2],
        )
