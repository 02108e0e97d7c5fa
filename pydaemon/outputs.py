"""What the engine hands back: plain dataclasses, the same offline and through the daemon."""

from __future__ import annotations

from dataclasses import dataclass, field

# One position's logprobs: {token_id: logprob}, the chosen token always included.
TokenLogprobs = dict[int, float]


@dataclass
class CompletionOutput:
    """One generated sequence of a request (``index`` in [0, n))."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    cumulative_logprob: float = 0.0
    logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Engine-side timestamps (time.monotonic seconds) and counts of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0


@dataclass
class RequestOutput:
    """The state of one request after an engine step.

    In a streaming delivery each CompletionOutput carries the *new* token ids and text since
    the last delivery (``delta=True``); offline, ``LLM.generate`` returns the whole output.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None  # set when the engine rejected or failed the request
    # SamplingParams.prompt_logprobs: per prompt position, {token_id: logprob} of the prompt
    # token there and its top-k (None at position 0, which has no context). In a streamed
    # delivery, the positions new since the last delta (the first delta starts with None).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
