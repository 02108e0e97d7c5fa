"""What the engine requests of one HTTP request produced so far: per choice its text, tokens,
logprobs and finish reason; per prompt its token counts and engine timings (for ``usage`` and
the latency histograms).

Choice ``prompt_index * n + seq.index`` is sequence ``seq.index`` of prompt ``prompt_index``,
as in vLLM.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pydaemon.entrypoints.common.token_texts import TokenTexts
from pydaemon.entrypoints.openai.engine_stream import EnginePrompt
from pydaemon.entrypoints.openai.responses import Usage, make_usage
from pydaemon.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprobs


@dataclass
class ChoiceState:
    index: int
    texts: TokenTexts  # token -> text in context, consumed in token order
    text_parts: list[str] = field(default_factory=list)
    num_chars: int = 0
    token_ids: list[int] = field(default_factory=list)
    positions: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


@dataclass
class PromptState:
    num_prompt_tokens: int
    arrival_time: float = field(default_factory=time.monotonic)
    metrics: RequestMetrics | None = None
    is_finished: bool = False
    # prompt_logprobs (or echo with logprobs): [None, {token_id: logprob}...], one per token
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)


@dataclass
class ChoiceDelta:
    """The new part of one choice from one engine output."""

    choice: ChoiceState
    output: CompletionOutput
    text_offset: int  # characters of the choice's text before this delta


class Accumulator:
    def __init__(
        self,
        prompts: list[EnginePrompt],
        n: int,
        tokenizer,
        max_tokens: int | list[int] | None = None,
    ) -> None:
        self.n = n
        self.max_tokens = max_tokens  # the engine requests' (metrics): one, or one per prompt
        self.prompts = [PromptState(len(p.token_ids)) for p in prompts]
        self.choices = [
            ChoiceState(i * n + k, TokenTexts(tokenizer, p.token_ids))
            for i, p in enumerate(prompts)
            for k in range(n)
        ]

    def add(self, prompt_index: int, output: RequestOutput) -> list[ChoiceDelta]:
        prompt = self.prompts[prompt_index]
        prompt.num_prompt_tokens = len(output.prompt_token_ids)
        if output.metrics is not None:
            prompt.metrics = output.metrics
        prompt.is_finished = output.finished
        if output.prompt_logprobs:
            prompt.prompt_logprobs += output.prompt_logprobs
        deltas = []
        for seq in output.outputs:
            choice = self.choices[prompt_index * self.n + seq.index]
            offset = choice.num_chars
            choice.text_parts.append(seq.text)
            choice.num_chars += len(seq.text)
            choice.token_ids += seq.token_ids
            if seq.logprobs is not None:
                choice.positions += seq.logprobs
            if seq.finish_reason is not None:
                choice.finish_reason, choice.stop_reason = seq.finish_reason, seq.stop_reason
            deltas.append(ChoiceDelta(choice, seq, offset))
        return deltas

    def abort_unfinished(self) -> list[ChoiceState]:
        """Marks every unfinished choice "abort" (the server ended it); returns them."""
        aborted = [c for c in self.choices if c.finish_reason is None]
        for choice in aborted:
            choice.finish_reason = "abort"
        return aborted

    def usage(self) -> Usage:
        return make_usage(
            sum(p.num_prompt_tokens for p in self.prompts),
            sum(len(c.token_ids) for c in self.choices),
            sum(p.metrics.num_cached_tokens for p in self.prompts if p.metrics is not None),
        )

    def longest_output(self, prompt_index: int) -> int:
        choices = self.choices[prompt_index * self.n : (prompt_index + 1) * self.n]
        return max(len(c.token_ids) for c in choices)
