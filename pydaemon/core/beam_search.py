"""Beam-search selection logic with the semantics of Hugging Face transformers 5.x.

This is ``GenerationMixin._beam_search`` (``do_sample=False``, decoder-only, one prompt) with
the model taken out: the engine runs the model on every live beam, hands the step's
``log_softmax`` rows here, and gets back which parent beam each new live beam extends and
with which token. The engine keeps one sequence (KV) per live beam, forks a parent for each
child (sharing blocks) and frees dropped beams; this code never touches KV.

transformers' semantics, reproduced operation for operation in float32 numpy (no torch in
core/); ties between equal scores go to the lower (parent, token) index, as a stable sort:
- W live beams; before the first step only the prompt exists (beam 0 has score 0, the other
  W - 1 copies -1e9, so the first step chooses among beam 0's tokens).
- Each step keeps the top K = max(2, 1 + num_eos) * W candidates (parent, token) by
  accumulated logprob. A candidate "hits a stop" when its token is an EOS id or when it
  reaches max_new_tokens. The W best candidates that do not hit a stop become the live beams
  (a hitting candidate is pushed down by -1e9).
- Of the top W candidates (not all K), those that hit a stop may enter the W-slot finished
  set with score sum_logprobs / (generated_len ** length_penalty), where generated_len counts
  the generated tokens only (EOS included), not the prompt.
- early_stopping=True: stop as soon as W hypotheses are finished. False: stop when the best
  live beam, normalised by the current generated length, cannot beat the worst finished one.
  "never": the same test, but with max_new_tokens as the length when length_penalty > 0.
- The search also ends when every candidate hits a stop (max_new_tokens reached).
- The result is the finished set, best first; the first num_return are returned.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

_NEG = np.float32(-1.0e9)  # transformers' "very large negative" score
# Below this |log(length ** length_penalty)| the power is a finite float32 and the score is
# computed with transformers' own operations (bit-identical); above it, in log space.
_MAX_LOG_DENOMINATOR = 80.0


def length_normalized(values: np.ndarray, length: int, length_penalty: float) -> np.ndarray:
    """values / length ** length_penalty, never raising OverflowError.

    values: [k] float32 cumulative logprobs (<= 0). For moderate penalties this is exactly
    transformers' expression (a float32 tensor divided by a Python float: the divisor rounded
    to float32); otherwise sign(v) * exp(log|v| - length_penalty * log(length)), which
    saturates to 0 or -inf instead of overflowing."""
    log_denominator = length_penalty * math.log(length)
    if abs(log_denominator) < _MAX_LOG_DENOMINATOR:
        return values / np.float32(length**length_penalty)
    v = values.astype(np.float64)
    with np.errstate(divide="ignore", over="ignore"):
        return (np.sign(v) * np.exp(np.log(np.abs(v)) - log_denominator)).astype(values.dtype)


def top_k(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest of ``values`` ([n]), largest first, ties to the lower index
    (a stable order, where torch.topk leaves it unspecified); O(n) selection, then a sort of
    the k."""
    n = values.shape[0]
    if k >= n:
        return np.argsort(-values, kind="stable")
    kth = np.partition(values, n - k)[n - k]  # the k-th largest value
    above = np.flatnonzero(values > kth)
    ties = np.flatnonzero(values == kth)[: k - len(above)]
    chosen = np.concatenate((above, ties))
    return chosen[np.argsort(-values[chosen], kind="stable")]


@dataclass
class BeamHypothesis:
    """A finished (or, rarely, the best unfinished) beam."""

    token_ids: list[int]  # generated tokens only, the final EOS included
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty (transformers' score)
    cumulative_logprob: float


@dataclass
class BeamStepResult:
    """What one step decided; lists have one entry per new live beam.

    New live beam i = previous live beam ``parent_indices[i]`` + ``token_ids[i]``. A parent may
    have several children (fork it) or none (free it).
    """

    parent_indices: list[int]
    token_ids: list[int]
    cumulative_logprobs: list[float]
    num_finished: int  # hypotheses in the finished set after this step
    is_done: bool


class BeamSearchState:
    """Beam search over one prompt. Call ``step`` once per engine step until ``is_done``,
    then ``finalize``. Before the first step there is one live beam (the prompt); after
    every step there are exactly ``beam_width`` live beams, in the order of the last result.
    """

    def __init__(
        self,
        beam_width: int,
        num_return: int,
        length_penalty: float,
        early_stopping: bool | str,
        eos_token_ids: Iterable[int],
        prompt_len: int,
        max_new_tokens: int,
        min_new_tokens: int = 0,
    ) -> None:
        if beam_width < 1:
            raise ValueError(f"BeamSearchState: beam_width must be >= 1 (got {beam_width})")
        if not 1 <= num_return <= beam_width:
            raise ValueError(
                f"BeamSearchState: num_return must be in [1, beam_width={beam_width}] "
                f"(got {num_return})"
            )
        if early_stopping not in (True, False, "never"):
            raise ValueError(
                f"BeamSearchState: early_stopping must be True, False or 'never' "
                f"(got {early_stopping!r})"
            )
        if max_new_tokens < 1:
            raise ValueError(f"BeamSearchState: max_new_tokens must be >= 1 (got {max_new_tokens})")
        if prompt_len < 0:
            raise ValueError(f"BeamSearchState: prompt_len must be >= 0 (got {prompt_len})")
        if not math.isfinite(length_penalty):
            raise ValueError(
                f"BeamSearchState: length_penalty must be finite (got {length_penalty})"
            )
        self.beam_width = beam_width
        self.num_return = num_return
        self.length_penalty = float(length_penalty)
        self.early_stopping = early_stopping
        self.eos_token_ids = sorted(set(eos_token_ids))
        self._eos_set = frozenset(self.eos_token_ids)
        self.prompt_len = prompt_len
        self.max_new_tokens = max_new_tokens
        self.min_new_tokens = min_new_tokens
        self.num_candidates = max(2, 1 + len(self.eos_token_ids)) * beam_width

        self.num_generated = 0
        # Live beams: generated tokens, raw cumulative logprob (float32 as in transformers).
        self.running_token_ids: list[list[int]] = [[] for _ in range(beam_width)]
        self.running_scores = np.full(beam_width, _NEG, dtype=np.float32)
        self.running_scores[0] = 0.0
        # Finished set: W slots, best first; unfilled slots hold -1e9.
        self.finished_token_ids: list[list[int]] = [[] for _ in range(beam_width)]
        self.finished_scores = np.full(beam_width, _NEG, dtype=np.float32)
        self.finished_cumulative: list[float] = [0.0] * beam_width
        self.is_finished = np.zeros(beam_width, dtype=bool)
        self.can_improve = True  # transformers' is_early_stop_heuristic_unsatisfied
        self.is_done = False

    @property
    def num_live_beams(self) -> int:
        return 1 if self.num_generated == 0 else self.beam_width

    def step(self, beam_logprobs: np.ndarray) -> BeamStepResult:
        """beam_logprobs: [num_live_beams, vocab] float32, the log_softmax of each live beam's
        next-token logits."""
        if self.is_done:
            raise RuntimeError("BeamSearchState.step called after the search is done")
        width = self.beam_width
        if beam_logprobs.ndim != 2 or beam_logprobs.shape[0] != self.num_live_beams:
            raise ValueError(
                f"BeamSearchState.step: beam_logprobs must be [{self.num_live_beams}, vocab], "
                f"got {tuple(beam_logprobs.shape)}"
            )
        vocab_size = beam_logprobs.shape[1]
        if width * vocab_size < self.num_candidates:
            raise ValueError(
                f"BeamSearchState.step: vocab {vocab_size} too small for {self.num_candidates} "
                f"candidates"
            )
        logprobs = np.asarray(beam_logprobs, dtype=np.float32)
        if self.num_generated == 0:
            # The W initial beams are identical copies of the prompt: expand the single row.
            logprobs = np.broadcast_to(logprobs, (width, vocab_size))
        if self.num_generated < self.min_new_tokens and self.eos_token_ids:
            logprobs = logprobs.copy()
            logprobs[:, self.eos_token_ids] = -np.inf

        accumulated = (logprobs + self.running_scores[:, None]).reshape(-1)
        top_indices = top_k(accumulated, self.num_candidates)
        top_values = accumulated[top_indices]
        parents = (top_indices // vocab_size).tolist()
        tokens = (top_indices % vocab_size).tolist()
        candidate_token_ids = [
            self.running_token_ids[p] + [t] for p, t in zip(parents, tokens, strict=True)
        ]
        at_max_len = self.num_generated + 1 >= self.max_new_tokens
        hits_stop = np.array([at_max_len or t in self._eos_set for t in tokens], dtype=bool)

        # Live beams for the next step: the best W candidates that did not hit a stop.
        running_values = top_values + hits_stop.astype(np.float32) * _NEG
        next_indices = top_k(running_values, width).tolist()

        self._update_finished(top_values, hits_stop, candidate_token_ids)

        self.running_token_ids = [candidate_token_ids[i] for i in next_indices]
        self.running_scores = running_values[next_indices]
        # Before the first step every virtual beam is the prompt, i.e. live row 0.
        live_parents = [0 if self.num_generated == 0 else parents[i] for i in next_indices]
        self.num_generated += 1
        self._update_can_improve()
        exists_open_beam = not (bool(self.is_finished.all()) and self.early_stopping is True)
        valid_continuations = not bool(hits_stop.all())
        self.is_done = not (self.can_improve and exists_open_beam and valid_continuations)
        return BeamStepResult(
            parent_indices=live_parents,
            token_ids=[tokens[i] for i in next_indices],
            cumulative_logprobs=self.running_scores.tolist(),
            num_finished=int(self.is_finished.sum()),
            is_done=self.is_done,
        )

    def _update_finished(
        self,
        top_values: np.ndarray,
        hits_stop: np.ndarray,
        candidate_token_ids: list[list[int]],
    ) -> None:
        """top_values / hits_stop: [num_candidates]. transformers' _update_finished_beams."""
        width = self.beam_width
        # Only the top W candidates may finish; the rest exist to keep W beams alive.
        top_w_mask = np.zeros_like(hits_stop)
        top_w_mask[:width] = True
        just_finished = hits_stop & top_w_mask
        scores = length_normalized(top_values, self.num_generated + 1, self.length_penalty)
        beams_full = bool(self.is_finished.all()) and self.early_stopping is True
        scores = scores + np.float32(beams_full) * _NEG
        scores = scores + np.float32(not self.can_improve) * _NEG
        scores = scores + (~just_finished).astype(np.float32) * _NEG

        merged_scores = np.concatenate((self.finished_scores, scores))
        merged_token_ids = self.finished_token_ids + candidate_token_ids
        merged_cumulative = self.finished_cumulative + top_values.tolist()
        merged_is_finished = np.concatenate((self.is_finished, just_finished))
        keep = top_k(merged_scores, width)
        self.finished_scores = merged_scores[keep]
        self.is_finished = merged_is_finished[keep]
        keep_list = keep.tolist()
        self.finished_token_ids = [merged_token_ids[i] for i in keep_list]
        self.finished_cumulative = [merged_cumulative[i] for i in keep_list]

    def _update_can_improve(self) -> None:
        """transformers' _check_early_stop_heuristic (sticky once False)."""
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_length = self.max_new_tokens
        else:
            best_length = self.num_generated
        best_possible = length_normalized(self.running_scores[:1], best_length, self.length_penalty)
        worst_finished = np.where(self.is_finished, self.finished_scores.min(), _NEG)
        self.can_improve = self.can_improve and bool((best_possible > worst_finished).any())

    def finalize(self) -> list[BeamHypothesis]:
        """The best ``num_return`` hypotheses, best first (transformers' returned order)."""
        return [
            BeamHypothesis(
                token_ids=list(self.finished_token_ids[i]),
                score=float(self.finished_scores[i]),
                cumulative_logprob=self.finished_cumulative[i],
            )
            for i in range(self.num_return)
        ]
