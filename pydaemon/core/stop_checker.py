"""Per-sequence stop conditions: EOS, stop token ids, stop strings, max_tokens, min_tokens.

The engine calls ``StopChecker.check`` once per sequence per step, after appending the new
token and detokenizing it, and streams only ``safe_stream_len(text)`` characters of the
output text while the sequence runs: the held-back tail might still turn into a stop string,
and a streamed delta must never have to be taken back.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydaemon.sampling_params import SamplingParams


@dataclass(frozen=True)
class StopDecision:
    """Result of one check.

    finish_reason: "stop" | "length" | None (still running).
    stop_reason: the stop token id or stop string that matched (None for EOS, length, running).
    text_len: how many characters of the output text to keep; shorter than the text only when
    a stop string matched (the stop string and everything after it are cut).
    """

    finish_reason: str | None
    stop_reason: int | str | None
    text_len: int

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class StopChecker:
    """Stop logic of one sequence (stateless between calls; one instance per request is fine).

    Semantics (vLLM's):
    - Nothing stops the sequence before ``min_tokens`` output tokens except ``max_tokens``.
    - An EOS token (``eos_token_ids``, ignored when ``ignore_eos``) finishes with "stop",
      stop_reason None. A ``stop_token_ids`` token finishes with "stop", stop_reason the id.
      In both cases the token stays in the sequence's token_ids.
    - A stop string finishes with "stop", stop_reason the string; the text is cut just
      before the earliest match. Matches may span several tokens: the search covers the new
      characters plus the ``max_stop_len - 1`` characters before them.
    - ``max_tokens`` output tokens finish with "length".
    """

    def __init__(self, params: SamplingParams, eos_token_ids: set[int] | int | None) -> None:
        if eos_token_ids is None:
            eos_token_ids = set()
        elif isinstance(eos_token_ids, int):
            eos_token_ids = {eos_token_ids}
        self.params = params
        self.eos_token_ids: frozenset[int] = (
            frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        )
        self.stop_token_ids: frozenset[int] = frozenset(params.stop_token_ids)
        self.stop: tuple[str, ...] = tuple(params.stop)
        self.max_stop_len = max((len(s) for s in self.stop), default=0)

    def check(
        self, token_id: int, num_output_tokens: int, text: str, num_new_chars: int
    ) -> StopDecision:
        """Decide whether the sequence finishes with its newest token.

        token_id: the token just appended; num_output_tokens: output tokens including it;
        text: the whole detokenized output text so far (including the new characters);
        num_new_chars: how many characters at the end of ``text`` this token added.
        """
        if num_new_chars < 0 or num_new_chars > len(text):
            raise ValueError(
                f"StopChecker.check: num_new_chars must be in [0, len(text)={len(text)}] "
                f"(got {num_new_chars})"
            )
        params = self.params
        if num_output_tokens < params.min_tokens:
            if num_output_tokens >= params.max_tokens:
                return StopDecision("length", None, len(text))
            return StopDecision(None, None, len(text))
        if token_id in self.eos_token_ids:
            return StopDecision("stop", None, len(text))
        if token_id in self.stop_token_ids:
            return StopDecision("stop", token_id, len(text))
        if self.stop and num_new_chars > 0:
            match = self._find_stop_string(text, num_new_chars)
            if match is not None:
                position, stop = match
                return StopDecision("stop", stop, position)
        if num_output_tokens >= params.max_tokens:
            return StopDecision("length", None, len(text))
        return StopDecision(None, None, len(text))

    def check_token(self, token_id: int, num_output_tokens: int) -> tuple[str | None, int | None]:
        """``check`` without text (the engine core's part: EOS, stop ids, lengths), as
        (finish_reason, stop_reason): it runs once per sequence per step, so no object."""
        params = self.params
        if num_output_tokens < params.min_tokens:
            return ("length", None) if num_output_tokens >= params.max_tokens else (None, None)
        if token_id in self.eos_token_ids:
            return "stop", None
        if token_id in self.stop_token_ids:
            return "stop", token_id
        if num_output_tokens >= params.max_tokens:
            return "length", None
        return None, None

    def _find_stop_string(self, text: str, num_new_chars: int) -> tuple[int, str] | None:
        """Earliest stop string that ends inside the new characters: (start index, string)."""
        search_from = max(0, len(text) - num_new_chars - self.max_stop_len + 1)
        best: tuple[int, str] | None = None
        for stop in self.stop:
            position = text.find(stop, search_from)
            if position != -1 and (best is None or position < best[0]):
                best = (position, stop)
        return best

    def safe_stream_len(self, text: str, finished: bool = False) -> int:
        """How many leading characters of a running sequence's ``text`` may be streamed.

        Holds back the longest suffix of ``text`` that is a proper prefix of some stop
        string (at most ``max_stop_len - 1`` characters): only that suffix can still become
        the start of a match. The value never decreases as ``text`` grows, and a later stop
        match never starts before it, so streamed text is never taken back. When
        ``finished``, ``text`` is final (already cut) and all of it may go.
        """
        if finished or not self.stop:
            return len(text)
        held = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:k]):
                    held = k
                    break
        return len(text) - held
