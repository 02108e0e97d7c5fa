"""OpenAI request bodies (pydantic), with vLLM's extra sampling fields, and their conversion to
SamplingParams. Value ranges are SamplingParams' own checks, so the two APIs cannot drift.

Types are strict (``"stream": "yes"`` or ``"prompt": [true]`` is a 400, not a coercion); the
limits on stop strings and token ids are entrypoints/common/limits.py's, as for gRPC. Unknown
fields are refused (400 naming them); fields that OpenAI clients commonly send but that
change nothing here (``user``, ``store``, ``metadata``...) are accepted and ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pydaemon.config.generation import GenerationDefaults
from pydaemon.entrypoints.common.limits import (
    MAX_CACHE_SALT_LEN,
    MAX_STOP_TOKEN_IDS,
    LimitError,
    check_stop,
    check_token_ids,
)
from pydaemon.sampling_params import SamplingParams

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's legacy completions default


class InvalidParam(LimitError):
    """A request field with a bad value; ``param`` names the field."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields that completions and chat completions share."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Accepted, no effect here.
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # vLLM's extra sampling fields.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    # vLLM's prefix-cache salt: only requests with the same salt share cached KV blocks.
    cache_salt: str | None = Field(default=None, max_length=MAX_CACHE_SALT_LEN)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise InvalidParam("stream_options is only allowed with stream: true", "stream_options")
        if self.logit_bias:
            raise InvalidParam("logit_bias is not supported", "logit_bias")

    def _check_limits(self, vocab_size: int) -> None:
        """The bounds gRPC enforces too (entrypoints/common/limits.py)."""
        check_stop([self.stop] if isinstance(self.stop, str) else self.stop or [], "stop")
        ids = self.stop_token_ids or []
        check_token_ids(ids, vocab_size, "stop_token_ids", MAX_STOP_TOKEN_IDS)

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        best_of: int | None = None,
        defaults: GenerationDefaults | None = None,
    ) -> SamplingParams:
        """-> SamplingParams, the model's generation_config.json ``defaults`` under the fields
        the request set; a bad value raises InvalidParam naming the request field."""
        self._check_common()
        kwargs: dict[str, Any] = {
            "n": self.n,
            "best_of": best_of,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "seed": self.seed,
            "stop": [self.stop] if isinstance(self.stop, str) else list(self.stop or ()),
            "stop_token_ids": list(self.stop_token_ids or ()),
            "ignore_eos": self.ignore_eos,
            "max_tokens": max_tokens,
            "min_tokens": self.min_tokens,
            "logprobs": logprobs,
        }
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        try:
            return (defaults or GenerationDefaults()).sampling_params(**kwargs)
        except ValueError as e:
            # "SamplingParams.top_p must be in (0, 1] (got 2.0)" -> param "top_p"
            message = str(e).removeprefix("SamplingParams.")
            raise InvalidParam(message, message.split(" ", 1)[0]) from None


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = DEFAULT_COMPLETION_MAX_TOKENS
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    return_token_ids: bool = False  # vLLM's extra: each choice (chunk) carries its token ids

    def check(self, vocab_size: int) -> None:
        self._check_limits(vocab_size)
        if self.suffix:
            raise InvalidParam("suffix is not supported", "suffix")
        if self.echo and self.logprobs is not None:
            raise InvalidParam("echo with logprobs is not supported (no prompt logprobs)", "echo")
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise InvalidParam("best_of greater than n cannot be streamed", "best_of")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message; extra keys (e.g. ``reasoning_content``) pass through to the template."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates expect it: content as one string."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "".join(part.text for part in self.content)
        return message


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's extras for the template.
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self, vocab_size: int) -> None:
        self._check_limits(vocab_size)
        if self.tools and self.tool_choice in (None, "auto"):
            # Until tool calls are parsed, "auto" would silently return them as plain text.
            raise InvalidParam(
                "tool calls are not parsed by this server: with tools, set tool_choice 'none' "
                "(the tools are rendered into the prompt; the reply is plain text)",
                "tool_choice",
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParam("top_logprobs needs logprobs: true", "top_logprobs")
        if self.tool_choice not in (None, "none", "auto"):
            raise InvalidParam(
                "tool_choice must be 'none' or 'auto' (tool calls are not parsed)", "tool_choice"
            )
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise InvalidParam(
                "only response_format {'type': 'text'} is supported", "response_format"
            )

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def engine_logprobs(self) -> int | None:
        """SamplingParams.logprobs: top-k alternatives per token (0: the chosen token only)."""
        return (self.top_logprobs or 0) if self.logprobs else None
