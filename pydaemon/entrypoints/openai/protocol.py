"""OpenAI request bodies (pydantic), with vLLM's extra sampling fields, and their conversion to
SamplingParams. Value ranges are SamplingParams' own checks, so the two APIs cannot drift.

Types are strict (``"stream": "yes"`` or ``"prompt": [true]`` is a 400, not a coercion); the
limits on stop strings and token ids are entrypoints/common/limits.py's, as for gRPC. Unknown
fields are ignored with a warning in the log, as vLLM does (a client sending a field newer
than this server still gets its answer); fields that OpenAI clients commonly send but that
change nothing here (``user``, ``store``, ``metadata``...) are declared and ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

from pydaemon.config.generation import GenerationDefaults
from pydaemon.entrypoints.common.limits import (
    MAX_CACHE_SALT_LEN,
    MAX_STOP_TOKEN_IDS,
    check_chat_role,
    check_stop,
    check_token_ids,
)
from pydaemon.entrypoints.common.tool_choice import check_tools, tool_choice_constraint
from pydaemon.entrypoints.openai.ignored_fields import warn_ignored_fields
from pydaemon.entrypoints.openai.request_fields import (
    InvalidParam,
    check_logprobs_count,
    int64_seed,
    is_token_id_text,
    response_format_field,
    structured_outputs_field,
)
from pydaemon.logprobs_limit import DEFAULT_MAX_LOGPROBS
from pydaemon.sampling_params import (
    MAX_LOGIT_BIAS_TOKENS,
    MAX_LOGPROB_TOKEN_IDS,
    SamplingParams,
    StructuredOutputsParams,
    logit_bias_out_of_vocab,
)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's legacy completions default


class Body(BaseModel):
    """A request body or one of its objects: strict types; unknown fields ignored with a
    warning (ignored_fields.py)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _warn_unknown(cls, data: Any) -> Any:
        return warn_ignored_fields(cls, data, cls.__name__)


class StreamOptions(Body):
    include_usage: bool = False
    # vLLM's: every chunk carries the usage so far (its choice's completion tokens)
    continuous_usage_stats: bool = False


class _SamplingRequest(Body):
    """Fields that completions and chat completions share."""

    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # token id (canonical decimal text) -> bias; the size is also checked before parsing
    # (request_fields.check_logit_bias_size)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS_TOKENS)
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
    # vLLM's: each prompt token's logprob and top-k (not streamed)
    prompt_logprobs: int | None = None
    # vLLM's: the logprobs of exactly these token ids at each position, in place of the
    # top-k (logprobs must be on)
    logprob_token_ids: list[int] | None = Field(default=None, max_length=MAX_LOGPROB_TOKEN_IDS)
    # logit_bias with token-id keys, once check() has read it
    _logit_bias: dict[int, float] | None = PrivateAttr(default=None)
    # vLLM's beam search: n beams, n answers, best first (deterministic: temperature 0)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool = False
    # vLLM's prefix-cache salt: only requests with the same salt share cached KV blocks.
    cache_salt: str | None = Field(default=None, max_length=MAX_CACHE_SALT_LEN)
    # vLLM's constrained decoding: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
    structured_outputs: dict[str, Any] | None = None
    # OpenAI's: {"type": "text" | "json_object" | "json_schema", ...} (vLLM takes it on
    # completions too)
    response_format: dict[str, Any] | None = None
    # vLLM's: a prompt longer than this many tokens keeps its last ones (-1: max_model_len);
    # truncation_side "right" keeps the first ones instead
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None
    # vLLM's: each choice (chunk) carries its token ids, and the prompt's (prompt_token_ids:
    # in each completion choice, at the top of a chat response; streamed: the first chunk)
    return_token_ids: bool = False
    # vLLM's: logprobs name each token "token_id:<id>" (None: the server's
    # --return-tokens-as-token-ids)
    return_tokens_as_token_ids: bool | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk: continuous_usage_stats with include_usage (vLLM's rule; alone
        it sends none, as OpenAI's clients expect without include_usage)."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    def _check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise InvalidParam("stream_options is only allowed with stream: true", "stream_options")

    def _check_prompt_logprobs(self, vocab_size: int, max_logprobs: int) -> None:
        self.prompt_logprobs = check_logprobs_count(
            self.prompt_logprobs, "prompt_logprobs", vocab_size, max_logprobs
        )
        if self.stream and self.prompt_logprobs:  # vLLM's rule and words
            raise InvalidParam(
                "`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs"
            )

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """SamplingParams.prompt_logprobs."""
        return self.prompt_logprobs

    def engine_logit_bias(self, vocab_size: int) -> dict[int, float] | None:
        """logit_bias with token-id keys (vLLM's messages naming the bad keys or ids)."""
        if not self.logit_bias:
            return None
        bad = [k for k in self.logit_bias if not is_token_id_text(k)]
        if bad:
            raise InvalidParam(
                f"logit_bias contains key(s) that cannot be converted to integer token IDs: "
                f"{bad[:16]!r} (a key is a token id in decimal digits, with no sign, space or "
                "leading zero)",
                "logit_bias",
            )
        bias = {int(k): v for k, v in self.logit_bias.items()}
        if any(not 0 <= t < vocab_size for t in bias):
            raise InvalidParam(logit_bias_out_of_vocab(bias, vocab_size), "logit_bias")
        return bias

    def truncated(self, token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt as truncate_prompt_tokens leaves it (vLLM's rule and words)."""
        limit = self.truncate_prompt_tokens
        if limit is None:
            return token_ids
        if limit == -1:
            limit = max_model_len
        if limit < 1:
            raise InvalidParam(
                f"truncate_prompt_tokens must be -1 or a positive integer (got {limit})",
                "truncate_prompt_tokens",
            )
        if limit > max_model_len:
            raise InvalidParam(
                f"truncate_prompt_tokens value ({limit}) is greater than max_model_len "
                f"({max_model_len}). Please, select a smaller truncation size.",
                "truncate_prompt_tokens",
            )
        if len(token_ids) <= limit:
            return token_ids
        return token_ids[:limit] if self.truncation_side == "right" else token_ids[-limit:]

    def _check_limits(self, vocab_size: int) -> None:
        """The bounds gRPC enforces too (entrypoints/common/limits.py)."""
        check_stop([self.stop] if isinstance(self.stop, str) else self.stop or [], "stop")
        ids = self.stop_token_ids or []
        check_token_ids(ids, vocab_size, "stop_token_ids", MAX_STOP_TOKEN_IDS)
        if self.logprob_token_ids is not None:
            check_token_ids(
                self.logprob_token_ids, vocab_size, "logprob_token_ids", MAX_LOGPROB_TOKEN_IDS
            )
            if not self.logprob_token_ids or len(set(self.logprob_token_ids)) != len(
                self.logprob_token_ids
            ):
                raise InvalidParam(
                    "logprob_token_ids must list at least one token id, none twice",
                    "logprob_token_ids",
                )
        self._logit_bias = self.engine_logit_bias(vocab_size)

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
            "seed": int64_seed(self.seed),
            "stop": [self.stop] if isinstance(self.stop, str) else list(self.stop or ()),
            "stop_token_ids": list(self.stop_token_ids or ()),
            "ignore_eos": self.ignore_eos,
            "max_tokens": max_tokens,
            "min_tokens": self.min_tokens,
            "logprobs": len(self.logprob_token_ids) if self.logprob_token_ids else logprobs,
            "logprob_token_ids": self.logprob_token_ids or None,
            "logit_bias": self._logit_bias,
            "prompt_logprobs": self.engine_prompt_logprobs,
        }
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        if self.use_beam_search:
            if self.temperature not in (None, 0):
                raise InvalidParam(
                    "use_beam_search: pagedd's beam search is deterministic, temperature must "
                    f"be 0 or unset (got {self.temperature})",
                    "temperature",
                )
            kwargs.update(
                beam_width=self.n,  # vLLM's: n beams, the n best returned
                best_of=None,
                temperature=0.0,
                length_penalty=self.length_penalty,
                early_stopping=self.early_stopping,
            )
        kwargs["structured_outputs"] = self.constraint()
        try:
            return (defaults or GenerationDefaults()).sampling_params(**kwargs)
        except ValueError as e:
            # "SamplingParams.top_p must be in (0, 1] (got 2.0)" -> param "top_p"
            message = str(e).removeprefix("SamplingParams.")
            raise InvalidParam(message, message.split(" ", 1)[0]) from None

    def constraint(self) -> StructuredOutputsParams | None:
        """The request's constraint on its output (InvalidParam naming the field)."""
        return response_format_field(self.response_format) or structured_outputs_field(
            self.structured_outputs
        )

    @property
    def constraint_source(self) -> str | None:
        """The field the output's constraint comes from (what its errors name)."""
        if response_format_field(self.response_format) is not None:
            return "response_format"
        return None if self.structured_outputs is None else "structured_outputs"

    def _check_one_constraint(self, *more: tuple[str, Any]) -> None:
        asked = [
            name
            for name, value in (
                ("structured_outputs", self.structured_outputs),
                ("response_format", response_format_field(self.response_format)),
                *more,
            )
            if value
        ]
        if len(asked) > 1:
            raise InvalidParam(f"{' and '.join(asked)} cannot be combined", asked[1])


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """echo with logprobs: the prompt's tokens get logprobs too (vLLM's)."""
        if self.prompt_logprobs is None and self.echo and self.logprobs is not None:
            return self.logprobs
        return self.prompt_logprobs

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = DEFAULT_COMPLETION_MAX_TOKENS
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check(self, vocab_size: int, max_logprobs: int = DEFAULT_MAX_LOGPROBS) -> None:
        """``max_logprobs``: the server's --max-logprobs in force."""
        self._check_limits(vocab_size)
        self._check_one_constraint()
        if self.suffix:
            raise InvalidParam("suffix is not supported", "suffix")
        self.logprobs = check_logprobs_count(self.logprobs, "logprobs", vocab_size, max_logprobs)
        self._check_prompt_logprobs(vocab_size, max_logprobs)
        if self.logprob_token_ids and self.logprobs is None:
            raise InvalidParam(
                "logprob_token_ids needs logprobs set (the ids replace its top alternatives)",
                "logprob_token_ids",
            )
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise InvalidParam("best_of greater than n cannot be streamed", "best_of")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message; extra keys (e.g. ``reasoning_content``) pass through to the template."""

    model_config = ConfigDict(extra="allow", strict=True)

    # OpenAI's five or a custom role, passed to the template (vLLM does); one rule with gRPC
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @field_validator("role")
    @classmethod
    def _role_name(cls, role: str) -> str:
        check_chat_role(role, "role")
        return role

    @property
    def text(self) -> str | None:
        """The content as one string (None: none)."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content

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
    # vLLM's extras for the template.
    add_generation_prompt: bool | None = None  # None: True, unless continue_final_message
    continue_final_message: bool = False  # the prompt ends in the last message, to continue it
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the reply starts with the last message's content when it has the reply's role
    echo: bool = False

    def check(self, vocab_size: int, max_logprobs: int = DEFAULT_MAX_LOGPROBS) -> None:
        """``max_logprobs``: the server's --max-logprobs in force."""
        self._check_limits(vocab_size)
        self._check_prompt_logprobs(vocab_size, max_logprobs)
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidParam(  # vLLM's words
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                "continue_final_message",
            )
        self.top_logprobs = check_logprobs_count(
            self.top_logprobs, "top_logprobs", vocab_size, max_logprobs
        )
        if self.logprob_token_ids and not self.logprobs:
            raise InvalidParam(
                "logprob_token_ids needs logprobs: true (the ids replace top_logprobs)",
                "logprob_token_ids",
            )
        if self.top_logprobs and not self.logprobs:  # vLLM's: top_logprobs 0 is the default
            raise InvalidParam(
                "when using `top_logprobs`, `logprobs` must be set to true (logprobs: true)",
                "top_logprobs",
            )
        try:
            check_tools(self.tools, self.tool_choice)
        except ValueError as e:
            param = "tool_choice" if "tool_choice" in str(e) else "tools"
            raise InvalidParam(str(e), param) from None
        if not self.forces_tool_call:
            self._check_one_constraint()
            return
        response_format_field(self.response_format)  # checked, then it gives way to the tool call
        if self.structured_outputs is not None:
            raise InvalidParam(
                "structured_outputs and a forced tool_choice cannot be combined", "tool_choice"
            )

    @property
    def forces_tool_call(self) -> bool:
        """tool_choice "required" or a named function: the output is the tool call(s), and a
        response_format gives way (vLLM drops it: the tools' schema is the constraint)."""
        return bool(self.tools) and self.tool_choice not in (None, "none", "auto")

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template renders (none with tool_choice "none")."""
        return None if self.tool_choice == "none" else self.tools

    def constraint(self) -> StructuredOutputsParams | None:
        if self.forces_tool_call:
            try:
                return tool_choice_constraint(
                    self.tools, self.tool_choice, self.parallel_tool_calls is not False
                )
            except ValueError as e:
                raise InvalidParam(str(e), "tools") from None
        return super().constraint()

    @property
    def constraint_source(self) -> str | None:
        return "tools" if self.forces_tool_call else super().constraint_source

    @property
    def generation_prompt(self) -> bool:
        """add_generation_prompt as the template gets it."""
        if self.add_generation_prompt is None:
            return not self.continue_final_message
        return self.add_generation_prompt

    @property
    def reply_role(self) -> str:
        """The reply's role (vLLM's): assistant after a generation prompt, else the role of
        the last message (the one it continues)."""
        return "assistant" if self.generation_prompt else self.messages[-1].role

    @property
    def echo_text(self) -> str:
        """echo: the last message's content when it has the reply's role (vLLM's rule)."""
        last = self.messages[-1]
        if not self.echo or last.role != self.reply_role:
            return ""
        return last.text or ""

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def engine_logprobs(self) -> int | None:
        """SamplingParams.logprobs: top-k alternatives per token (0: the chosen token only)."""
        return (self.top_logprobs or 0) if self.logprobs else None
