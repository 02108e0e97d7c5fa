"""OpenAI response bodies and stream chunks (pydantic), as the official client parses them.

``finish_reason`` is "stop", "length" or "abort" (vLLM's value for a request ended by the
server); ``stop_reason`` (vLLM's extra) is the stop string or token id that matched.
A reasoning model's reasoning (--reasoning-parser) is in ``reasoning`` (vLLM's current name)
and ``reasoning_content`` (the name DeepSeek's API and older clients read); both are left out
when there is none.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, model_serializer


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def make_usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached: int) -> Usage:
    return Usage(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt_tokens + num_completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached),
    )


# ---- completions ------------------------------------------------------------------------


class CompletionLogprobs(BaseModel):
    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # vLLM's return_token_ids: this choice's (new) tokens
    prompt_token_ids: list[int] | None = None  # return_token_ids: its prompt's (first chunk)
    # vLLM's prompt_logprobs: per prompt token, None (the first) or {token_id: {"logprob",
    # "rank", "decoded_token"}}
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# ---- chat completions -------------------------------------------------------------------


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class _ReasoningFields(BaseModel):
    reasoning: str | None = None
    reasoning_content: str | None = None  # the same text, under the older name

    @model_serializer(mode="wrap")
    def _without_empty_reasoning(self, handler):
        data = handler(self)
        if self.reasoning is None:
            data.pop("reasoning", None)
            data.pop("reasoning_content", None)
        return data


class ChatResponseMessage(_ReasoningFields):
    role: str = "assistant"  # or the continued message's (continue_final_message)
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None  # {"id", "type": "function", "function"}


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # vLLM's return_token_ids: the choice's tokens


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids: the rendered prompt's
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # as CompletionChoice's


class DeltaMessage(_ReasoningFields):
    role: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # whole calls, each with its "index"


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids: the chunk's new tokens


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: in the first chunk


# ---- models and errors ------------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagedd"
    root: str
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)
    max_model_len: int
    vocab_size: int  # pagedd's extra: the range of token-id prompts


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
