"""POST /v1/chat/completions/batch (vLLM's): several conversations in one request.

The body is /v1/chat/completions' except that ``messages`` is a list of conversations, each a
list of messages; every other field is shared by all of them. The answer is one
``chat.completion`` whose choice ``i`` answers conversation ``i`` (index 0..N-1) and whose usage
sums the conversations'. Each conversation is rendered, sized and sampled exactly as
/v1/chat/completions would (the same code), and all are submitted to the engine together, as
one request's prompts are.

As in vLLM: not streamed (``stream: true`` is a 400), ``n`` must be 1, no tools, no beam
search. pagedd also refuses ``prompt_logprobs`` (the response has no place for one list per
conversation; vLLM drops the field) and more than MAX_CONVERSATIONS conversations. Every check
runs before any engine request is made, so a refused batch takes no KV block.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from pydaemon.entrypoints.openai.accumulator import Accumulator, ChoiceDelta, ChoiceState
from pydaemon.entrypoints.openai.chat import ChatFormatter, render_conversation
from pydaemon.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from pydaemon.entrypoints.openai.request_fields import InvalidParam, check_logit_bias_size
from pydaemon.entrypoints.openai.responses import ChatCompletionResponse, Usage
from pydaemon.entrypoints.openai.runner import respond
from pydaemon.entrypoints.openai.serving import OpenAIServing

# Conversations one batch may hold (each is an engine request; --max-queued-requests still
# bounds what may wait).
MAX_CONVERSATIONS = 256


class BatchMessages(BaseModel):
    """The batch's ``messages``: 1..MAX_CONVERSATIONS conversations, each a non-empty list of
    messages (errors name ``messages.<i>.<j>...``). The other fields are validated as
    /v1/chat/completions validates them."""

    model_config = ConfigDict(extra="ignore", strict=True)

    messages: list[Annotated[list[ChatMessage], Field(min_length=1)]]

    @field_validator("messages", mode="before")
    @classmethod
    def _count(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value  # pydantic's own error
        if not value:
            raise PydanticCustomError(
                "empty_batch",
                "the batch holds no conversation: messages must list at least one "
                "(each a list of messages)",
            )
        if len(value) > MAX_CONVERSATIONS:
            raise PydanticCustomError(
                "too_many_conversations",
                "the batch holds {count} conversations; at most {limit} per request",
                {"count": len(value), "limit": MAX_CONVERSATIONS},
            )
        if isinstance(value[0], dict):
            raise PydanticCustomError(
                "not_a_batch",
                "messages must be a list of conversations, each a list of messages "
                "(one conversation goes to /v1/chat/completions)",
            )
        return value


def parse_batch(
    raw: bytes, vocab_size: int, max_logprobs: int
) -> tuple[ChatCompletionRequest, list[list[ChatMessage]]]:
    """-> the shared fields (as a one-conversation request holding the first conversation) and
    the conversations. 400s name the field."""
    conversations = BatchMessages.model_validate_json(raw).messages
    data = json.loads(raw)
    data["messages"] = data["messages"][0]  # valid: the shared fields are checked with it
    shared = ChatCompletionRequest.model_validate_json(json.dumps(data))
    _refuse_unsupported(shared)
    shared.check(vocab_size, max_logprobs)
    return shared, conversations


def _refuse_unsupported(body: ChatCompletionRequest) -> None:
    if body.stream:
        raise InvalidParam(
            "batch chat completions are not streamed: stream must be false or omitted", "stream"
        )
    if body.n != 1:  # vLLM's rule
        raise InvalidParam(
            f"batch chat completions do not support n > 1 (got {body.n}): set n to 1", "n"
        )
    if body.use_beam_search:
        raise InvalidParam(
            "batch chat completions do not support beam search: set use_beam_search to false",
            "use_beam_search",
        )
    if body.tools:
        raise InvalidParam("batch chat completions do not support tools", "tools")
    if body.tool_choice not in (None, "none"):
        raise InvalidParam(
            'batch chat completions do not support tools: tool_choice must be "none" or omitted',
            "tool_choice",
        )
    if body.prompt_logprobs is not None:
        raise InvalidParam(
            "batch chat completions do not return prompt_logprobs", "prompt_logprobs"
        )


async def create_batch_chat_completion(
    serving: OpenAIServing, request: web.Request
) -> web.StreamResponse:
    raw = await serving.read_body(request)
    check_logit_bias_size(raw)  # before parsing: a huge one takes seconds to parse
    shared, conversations = parse_batch(raw, serving.model.vocab_size, serving.model.max_logprobs)
    lora_request = serving.admit(shared.model, len(conversations))
    if shared.return_tokens_as_token_ids is None:
        shared.return_tokens_as_token_ids = serving.options.return_tokens_as_token_ids
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    model_name = serving.model_name(lora_request)
    rendered = [
        await render_conversation(
            serving,
            shared.model_copy(update={"messages": messages}),
            request_id,
            model_name,
            None,  # no tools
            param=f"messages.{i}",
        )
        for i, messages in enumerate(conversations)
    ]
    formatter = BatchChatFormatter(
        request_id, model_name, [c.formatter for c in rendered], shared.return_token_ids
    )
    return await respond(
        serving,
        request,
        [c.prompt for c in rendered],
        [c.params for c in rendered],
        formatter,
        stream=False,
        include_usage=False,
        cache_salt=shared.cache_salt,
        lora_request=lora_request,
        constraint_source=shared.constraint_source,
    )


class BatchChatFormatter:
    """One chat.completion from the conversations' outputs: choice i is conversation i's, as
    its own ChatFormatter makes it; usage sums them. Never streamed."""

    def __init__(
        self,
        request_id: str,
        model: str,
        formatters: list[ChatFormatter],
        return_token_ids: bool,
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.logprob_tokenizer = formatters[0].logprob_tokenizer
        self._formatters = formatters
        self._exclude: dict[str, Any] = {"prompt_token_ids": True, "prompt_logprobs": True}
        if not return_token_ids:
            self._exclude["choices"] = {"__all__": {"token_ids"}}

    def response_json(self, acc: Accumulator) -> str:
        choices = [f.choice(c) for f, c in zip(self._formatters, acc.choices, strict=True)]
        response = ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=acc.usage(),
        )
        return response.model_dump_json(exclude=self._exclude)

    def start_chunks(self, acc: Accumulator) -> list[str]:
        raise AssertionError("a chat batch is not streamed")

    def delta_chunks(self, deltas: list[ChoiceDelta], acc: Accumulator) -> list[str]:
        raise AssertionError("a chat batch is not streamed")

    def abort_chunks(self, choices: list[ChoiceState]) -> list[str]:
        raise AssertionError("a chat batch is not streamed")

    def usage_chunk(self, usage: Usage) -> str:
        raise AssertionError("a chat batch is not streamed")
