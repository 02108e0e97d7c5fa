"""POST /v1/chat/completions: messages rendered by the model's chat template -> choices.

The template is the tokenizer's (``apply_chat_template``, jinja2 as transformers renders it);
the rendered prompt is tokenized without an added BOS, since templates write their own.
With ``tools``, the template renders them (unless tool_choice is "none") and the output's tool
calls come back as ``tool_calls`` with finish_reason "tool_calls": enforced by a constraint
for tool_choice "required" or a named function, read by the tool-call parser (the daemon's
``--tool-call-parser``, else the one the template's syntax calls for) for "auto".
"""

from __future__ import annotations

import time
import uuid

from aiohttp import web

from pydaemon.entrypoints.common.token_texts import TokenTexts
from pydaemon.entrypoints.common.tool_choice import chat_tool_parser, messages_for_template
from pydaemon.entrypoints.common.tool_parsers import (
    StreamingToolParser,
    ToolCall,
    ToolParser,
    detect_tool_call_parser,
)
from pydaemon.entrypoints.openai.accumulator import Accumulator, ChoiceDelta, ChoiceState
from pydaemon.entrypoints.openai.chunk_template import TEXT_MARKER, ChunkTemplate
from pydaemon.entrypoints.openai.engine_stream import EnginePrompt
from pydaemon.entrypoints.openai.logprobs import chat_logprobs
from pydaemon.entrypoints.openai.protocol import ChatCompletionRequest, InvalidParam
from pydaemon.entrypoints.openai.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatResponseMessage,
    DeltaMessage,
    Usage,
)
from pydaemon.entrypoints.openai.runner import respond
from pydaemon.entrypoints.openai.serving import OpenAIServing


async def create_chat_completion(
    serving: OpenAIServing, request: web.Request
) -> web.StreamResponse:
    body = ChatCompletionRequest.model_validate_json(await serving.read_body(request))
    body.check(serving.model.vocab_size)
    tool_parser = _tool_parser(serving, body)
    lora_request = serving.admit(body.model, body.n)
    prompt = EnginePrompt(
        await serving.encode_chat(
            messages_for_template([m.for_template() for m in body.messages]),
            body.template_tools,
            body.add_generation_prompt,
            body.chat_template_kwargs,
        )
    )
    max_tokens = serving.resolve_max_tokens(
        len(prompt.token_ids),
        body.requested_max_tokens,
        prompt_param="messages",
        max_tokens_param=(
            "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        ),
    )
    params = body.sampling_params(
        max_tokens, body.engine_logprobs, defaults=serving.model.generation_defaults
    )
    formatter = ChatFormatter(
        f"chatcmpl-{uuid.uuid4().hex}",
        serving.model_name(lora_request),
        serving.tokenizer,
        prompt,
        body,
        tool_parser,
    )
    return await respond(
        serving,
        request,
        [prompt],
        params,
        formatter,
        stream=body.stream,
        include_usage=body.include_usage,
        cache_salt=body.cache_salt,
        lora_request=lora_request,
        constraint_source=body.constraint_source,
    )


def _tool_parser(serving: OpenAIServing, body: ChatCompletionRequest) -> ToolParser | None:
    """How the output's tool calls are read (InvalidParam for tool_choice auto without a
    parser: --tool-call-parser, or one the chat template's syntax implies)."""
    template = serving.tokenizer.chat_template if serving.tokenizer is not None else None
    parser_name = serving.options.tool_call_parser or detect_tool_call_parser(template)
    try:
        return chat_tool_parser(body.tools, body.tool_choice, parser_name)
    except ValueError as e:
        raise InvalidParam(str(e), "tool_choice") from None


class ChatFormatter:
    def __init__(
        self,
        request_id: str,
        model: str,
        tokenizer,
        prompt: EnginePrompt,
        body: ChatCompletionRequest,
        tool_parser: ToolParser | None = None,
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.top_logprobs = body.top_logprobs or 0
        self.has_logprobs = body.logprobs
        self._tokenizer = tokenizer
        self._prompt = prompt
        self._templates: dict[int, ChunkTemplate] = {}  # choice index -> its text-chunk template
        self._tool_parser = tool_parser
        self._tool_streams: dict[int, StreamingToolParser] = {}  # choice index -> its parser

    def _template(self, index: int) -> ChunkTemplate:
        template = self._templates.get(index)
        if template is None:
            choice = ChatChunkChoice(index=index, delta=DeltaMessage(content=TEXT_MARKER))
            template = ChunkTemplate(
                ChatCompletionChunk(
                    id=self.request_id, created=self.created, model=self.model, choices=[choice]
                )
            )
            self._templates[index] = template
        return template

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        return ChatCompletionChunk(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
        ).model_dump_json()

    def start_chunks(self, acc: Accumulator) -> list[str]:
        """OpenAI's first chunk of each choice names the role."""
        return [
            self._chunk(
                [ChatChunkChoice(index=c.index, delta=DeltaMessage(role="assistant", content=""))]
            )
            for c in acc.choices
        ]

    def delta_chunks(self, deltas: list[ChoiceDelta]) -> list[str]:
        if self._tool_parser is not None:
            return self._tool_delta_chunks(deltas)
        chunks = []
        for d in deltas:
            out = d.output
            if out.finish_reason is None and not (self.has_logprobs and out.logprobs):
                chunks.append(self._template(d.choice.index).render(out.text))
                continue
            logprobs = None
            if self.has_logprobs and out.logprobs is not None:
                logprobs = chat_logprobs(
                    d.choice.texts, out.token_ids, out.logprobs, self.top_logprobs
                )
            choice = ChatChunkChoice(
                index=d.choice.index,
                delta=DeltaMessage(content=out.text),
                logprobs=logprobs,
                finish_reason=out.finish_reason,
                stop_reason=out.stop_reason,
            )
            chunks.append(self._chunk([choice]))
        return chunks

    def _tool_delta_chunks(self, deltas: list[ChoiceDelta]) -> list[str]:
        """Content streams until a tool call may start; the calls come whole at the end."""
        chunks = []
        for d in deltas:
            out = d.output
            stream = self._tool_streams.get(d.choice.index)
            if stream is None:
                stream = StreamingToolParser(self._tool_parser)
                self._tool_streams[d.choice.index] = stream
            content = stream.feed(out.text)
            calls: list[ToolCall] = []
            if out.finish_reason is not None:
                rest, calls = stream.finish()
                content += rest
            elif not content:
                continue
            choice = ChatChunkChoice(
                index=d.choice.index,
                delta=DeltaMessage(
                    content=content or None,
                    tool_calls=[{"index": k, **c.to_openai()} for k, c in enumerate(calls)] or None,
                ),
                finish_reason=_finish_reason(out.finish_reason, calls),
                stop_reason=out.stop_reason,
            )
            chunks.append(self._chunk([choice]))
        return chunks

    def abort_chunks(self, choices: list[ChoiceState]) -> list[str]:
        return [
            self._chunk(
                [ChatChunkChoice(index=c.index, delta=DeltaMessage(), finish_reason="abort")]
            )
            for c in choices
        ]

    def usage_chunk(self, usage: Usage) -> str:
        return self._chunk([], usage)

    def response_json(self, acc: Accumulator) -> str:
        choices = []
        for c in acc.choices:
            logprobs = None
            if self.has_logprobs:
                texts = TokenTexts(self._tokenizer, self._prompt.token_ids)
                logprobs = chat_logprobs(texts, c.token_ids, c.positions, self.top_logprobs)
            content, calls = c.text, []
            if self._tool_parser is not None:
                parsed = self._tool_parser.parse(c.text)
                content, calls = parsed.content, parsed.tool_calls
            message = ChatResponseMessage(
                content=content, tool_calls=[t.to_openai() for t in calls] or None
            )
            choices.append(
                ChatChoice(
                    index=c.index,
                    message=message,
                    logprobs=logprobs,
                    finish_reason=_finish_reason(c.finish_reason, calls),
                    stop_reason=c.stop_reason,
                )
            )
        response = ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=acc.usage(),
        )
        return response.model_dump_json()


def _finish_reason(finish_reason: str | None, calls: list[ToolCall]) -> str | None:
    """OpenAI's: an output that ended (not cut by the length limit) with tool calls."""
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason
