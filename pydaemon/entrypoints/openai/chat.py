"""POST /v1/chat/completions: messages rendered by the model's chat template -> choices.

The template is the tokenizer's (``apply_chat_template``, jinja2 as transformers renders it);
the rendered prompt is tokenized without an added BOS, since templates write their own.
With ``tools``, the template renders them (unless tool_choice is "none") and the output's tool
calls come back as ``tool_calls`` with finish_reason "tool_calls": enforced by a constraint
for tool_choice "required" or a named function, read by the tool-call parser (the daemon's
``--tool-call-parser``, else the one the template's syntax calls for) for "auto". With a
reasoning parser (``--reasoning-parser``; harmony templates bring their own) the reasoning comes
apart as ``reasoning``/``reasoning_content``, and a constraint applies to the answer after it.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from aiohttp import web

from pydaemon.entrypoints.common.reasoning_parsers import (
    ReasoningParser,
    ReasoningSplit,
    ReasoningStreams,
    apply_reasoning,
    chat_reasoning_parser,
    prompt_tail,
)
from pydaemon.entrypoints.common.token_texts import TokenTexts
from pydaemon.entrypoints.common.tool_choice import (
    chat_tool_parser,
    messages_for_template,
    tools_must_render,
)
from pydaemon.entrypoints.common.tool_parsers import (
    StreamingToolParser,
    ToolCall,
    ToolParser,
    detect_tool_call_parser,
)
from pydaemon.entrypoints.openai.accumulator import Accumulator, ChoiceDelta, ChoiceState
from pydaemon.entrypoints.openai.chunk_template import IDS_MARKER, TEXT_MARKER, ChunkTemplate
from pydaemon.entrypoints.openai.engine_stream import EnginePrompt
from pydaemon.entrypoints.openai.logprobs import chat_logprobs
from pydaemon.entrypoints.openai.prompt_logprobs import vllm_prompt_logprobs
from pydaemon.entrypoints.openai.protocol import ChatCompletionRequest
from pydaemon.entrypoints.openai.request_fields import InvalidParam, check_logit_bias_size
from pydaemon.entrypoints.openai.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatResponseMessage,
    DeltaMessage,
    Usage,
    make_usage,
)
from pydaemon.entrypoints.openai.runner import respond
from pydaemon.entrypoints.openai.serving import OpenAIServing
from pydaemon.sampling_params import SamplingParams


async def create_chat_completion(
    serving: OpenAIServing, request: web.Request
) -> web.StreamResponse:
    raw = await serving.read_body(request)
    check_logit_bias_size(raw)  # before parsing: a huge one takes seconds to parse
    body = ChatCompletionRequest.model_validate_json(raw)
    body.check(serving.model.vocab_size, serving.model.max_logprobs)
    tool_parser = _tool_parser(serving, body)
    lora_request = serving.admit(body.model, body.n)
    if body.return_tokens_as_token_ids is None:
        body.return_tokens_as_token_ids = serving.options.return_tokens_as_token_ids
    conversation = await render_conversation(
        serving,
        body,
        f"chatcmpl-{uuid.uuid4().hex}",
        serving.model_name(lora_request),
        tool_parser,
    )
    return await respond(
        serving,
        request,
        [conversation.prompt],
        conversation.params,
        conversation.formatter,
        stream=body.stream,
        include_usage=body.include_usage,
        cache_salt=body.cache_salt,
        lora_request=lora_request,
        constraint_source=body.constraint_source,
    )


@dataclass
class Conversation:
    """One conversation made ready for the engine: its prompt, sampling parameters, and the
    formatter that turns its outputs into chat choices."""

    prompt: EnginePrompt
    params: SamplingParams
    formatter: ChatFormatter


async def render_conversation(
    serving: OpenAIServing,
    body: ChatCompletionRequest,
    request_id: str,
    model_name: str,
    tool_parser: ToolParser | None,
    param: str = "messages",
) -> Conversation:
    """``body.messages`` rendered by the chat template and tokenized, its max_tokens resolved
    against the context left, its reasoning parser set up. ``param``: the field its errors
    name (``messages.<i>``: conversation i of a batch)."""
    prompt_ids = await serving.encode_chat(
        messages_for_template([m.for_template() for m in body.messages]),
        body.template_tools,
        body.generation_prompt,
        body.chat_template_kwargs,
        body.continue_final_message,
        must_render_tools=tools_must_render(body.tools, body.tool_choice),
        param=param,
    )
    prompt = EnginePrompt(body.truncated(prompt_ids, serving.model.max_model_len))
    max_tokens = serving.resolve_max_tokens(
        len(prompt.token_ids),
        body.requested_max_tokens,
        prompt_param=param,
        max_tokens_param=(
            "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        ),
    )
    params = body.sampling_params(
        max_tokens, body.engine_logprobs, defaults=serving.model.generation_defaults
    )
    reasoning = chat_reasoning_parser(serving.options.reasoning_parser, serving.tokenizer)
    tail = ""
    if reasoning is not None and body.continue_final_message:  # the output goes on with it
        tail = reasoning.continued_tail(body.messages[-1].text or "")
    elif reasoning is not None:
        tail = prompt_tail(serving.tokenizer, prompt.token_ids)
    params = apply_reasoning(params, reasoning, serving.tokenizer, tail)
    formatter = ChatFormatter(
        request_id, model_name, serving.tokenizer, prompt, body, tool_parser, reasoning, tail
    )
    return Conversation(prompt, params, formatter)


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
        reasoning_parser: ReasoningParser | None = None,
        prompt_tail: str = "",
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        # top_logprobs' count, or the ids logprob_token_ids lists
        self.top_logprobs: int | list[int] = body.logprob_token_ids or body.top_logprobs or 0
        self.has_logprobs = body.logprobs
        self.role = body.reply_role
        # echo: the message's text, its reasoning apart as the parser reads a message
        self.echo = ReasoningSplit(None, body.echo_text or None)
        if reasoning_parser is not None and body.echo_text:
            self.echo = reasoning_parser.split_message(body.echo_text)
        self._tokenizer = tokenizer
        # Logprobs' token names: their text, or "token_id:<id>" (TokenTexts without tokenizer)
        self.logprob_tokenizer = None if body.return_tokens_as_token_ids else tokenizer
        self._prompt = prompt
        self._templates: dict[int, ChunkTemplate] = {}  # choice index -> its text-chunk template
        self._tool_parser = tool_parser
        self._tool_streams: dict[int, StreamingToolParser] = {}  # choice index -> its parser
        self._reasoning_parser = reasoning_parser
        self._prompt_tail = prompt_tail  # the rendered prompt's end: did it open the reasoning?
        self._reasoning_streams = (
            None if reasoning_parser is None else ReasoningStreams(reasoning_parser, prompt_tail)
        )
        self._return_token_ids = body.return_token_ids
        # Without return_token_ids the fields are left out, not written as null.
        self._exclude = (
            None
            if body.return_token_ids
            else {"prompt_token_ids": True, "choices": {"__all__": {"token_ids"}}}
        )
        self._continuous_usage = body.continuous_usage
        self._prompt_logprobs = body.prompt_logprobs
        if body.prompt_logprobs is None:  # not asked: left out, not written as null
            self._exclude = {**(self._exclude or {}), "prompt_logprobs": True}
        # Chunks carry "usage" only with include_usage (null but on the usage chunk, as OpenAI)
        self._chunk_exclude = (
            self._exclude if body.include_usage else {**(self._exclude or {}), "usage": True}
        )

    def _template(self, index: int) -> ChunkTemplate:
        template = self._templates.get(index)
        if template is None:
            ids = IDS_MARKER if self._return_token_ids else None
            choice = ChatChunkChoice(
                index=index, delta=DeltaMessage(content=TEXT_MARKER), token_ids=ids
            )
            template = ChunkTemplate(
                ChatCompletionChunk(
                    id=self.request_id, created=self.created, model=self.model, choices=[choice]
                ),
                self._chunk_exclude,
                has_ids=self._return_token_ids,
            )
            self._templates[index] = template
        return template

    def _chunk(
        self,
        choices: list[ChatChunkChoice],
        usage: Usage | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> str:
        return ChatCompletionChunk(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
            prompt_token_ids=prompt_token_ids,
        ).model_dump_json(exclude=self._chunk_exclude)

    def _usage(self, acc: Accumulator, choice: ChoiceState | None) -> Usage | None:
        """stream_options.continuous_usage_stats: the usage so far on every chunk (None: the
        role-only first chunk, which has sent no token: 0, as vLLM counts it)."""
        if not self._continuous_usage:
            return None
        done = 0 if choice is None else len(choice.token_ids)
        return make_usage(acc.prompts[0].num_prompt_tokens, done, 0)

    def start_chunks(self, acc: Accumulator) -> list[str]:
        """OpenAI's first chunk of each choice names the role (vLLM's return_token_ids: the
        first chunk has the prompt's ids); echo: the echoed content follows."""
        chunks = []
        for k, c in enumerate(acc.choices):
            role = ChatChunkChoice(index=c.index, delta=DeltaMessage(role=self.role, content=""))
            ids = self._prompt.token_ids if self._return_token_ids and k == 0 else None
            chunks.append(self._chunk([role], self._usage(acc, None), ids))
            if self.echo.content or self.echo.reasoning:
                delta = DeltaMessage(
                    content=self.echo.content,
                    reasoning=self.echo.reasoning,
                    reasoning_content=self.echo.reasoning,
                )
                echo = ChatChunkChoice(index=c.index, delta=delta)
                chunks.append(self._chunk([echo], self._usage(acc, None)))
        return chunks

    def delta_chunks(self, deltas: list[ChoiceDelta], acc: Accumulator) -> list[str]:
        if self._tool_parser is not None or self._reasoning_parser is not None:
            return self._parsed_delta_chunks(deltas, acc)
        chunks = []
        for d in deltas:
            out = d.output
            if (
                out.finish_reason is None
                and not (self.has_logprobs and out.logprobs)
                and not self._continuous_usage
            ):
                chunks.append(self._template(d.choice.index).render(out.text, out.token_ids))
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
                token_ids=out.token_ids,
            )
            chunks.append(self._chunk([choice], self._usage(acc, d.choice)))
        return chunks

    def _parsed_delta_chunks(self, deltas: list[ChoiceDelta], acc: Accumulator) -> list[str]:
        """The reasoning apart from the content; content streams until a tool call may start,
        the calls come whole at the end."""
        chunks = []
        for d in deltas:
            out, index = d.output, d.choice.index
            reasoning, content = "", out.text
            if self._reasoning_streams is not None:
                reasoning, content = self._reasoning_streams.feed(
                    index, out.text, out.finish_reason is not None
                )
            calls: list[ToolCall] = []
            if self._tool_parser is not None:
                stream = self._tool_streams.get(index)
                if stream is None:
                    stream = self._tool_streams[index] = StreamingToolParser(self._tool_parser)
                content = stream.feed(content)
                if out.finish_reason is not None:
                    rest, calls = stream.finish()
                    content += rest
            logprobs = None
            if self.has_logprobs and out.logprobs:
                logprobs = chat_logprobs(
                    d.choice.texts, out.token_ids, out.logprobs, self.top_logprobs
                )
            quiet = not (content or reasoning or logprobs or out.finish_reason is not None)
            if quiet and not self._return_token_ids and not self._continuous_usage:
                continue
            choice = ChatChunkChoice(
                index=index,
                delta=DeltaMessage(
                    content=content or None,
                    reasoning=reasoning or None,
                    reasoning_content=reasoning or None,
                    tool_calls=[{"index": k, **c.to_openai()} for k, c in enumerate(calls)] or None,
                ),
                logprobs=logprobs,
                finish_reason=_finish_reason(out.finish_reason, calls),
                stop_reason=out.stop_reason,
                token_ids=out.token_ids,
            )
            chunks.append(self._chunk([choice], self._usage(acc, d.choice)))
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

    def choice(self, c: ChoiceState) -> ChatChoice:
        """One finished choice: its message (reasoning, tool calls and echo apart) and logprobs."""
        logprobs = None
        if self.has_logprobs:
            texts = TokenTexts(self.logprob_tokenizer, self._prompt.token_ids)
            logprobs = chat_logprobs(texts, c.token_ids, c.positions, self.top_logprobs)
        content, calls, reasoning = c.text, [], None
        if self._reasoning_parser is not None:
            split = self._reasoning_parser.split(c.text, self._prompt_tail)
            content, reasoning = split.content, split.reasoning
        if self._tool_parser is not None and content is not None:
            parsed = self._tool_parser.parse(content)
            content, calls = parsed.content, parsed.tool_calls
        if self.echo.content:
            content = self.echo.content + (content or "")
        if self.echo.reasoning:
            reasoning = self.echo.reasoning + (reasoning or "")
        message = ChatResponseMessage(
            role=self.role,
            content=content,
            reasoning=reasoning,
            reasoning_content=reasoning,
            tool_calls=[t.to_openai() for t in calls] or None,
        )
        return ChatChoice(
            index=c.index,
            message=message,
            logprobs=logprobs,
            finish_reason=_finish_reason(c.finish_reason, calls),
            stop_reason=c.stop_reason,
            token_ids=c.token_ids,
        )

    def response_json(self, acc: Accumulator) -> str:
        choices = [self.choice(c) for c in acc.choices]
        response = ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=acc.usage(),
            prompt_token_ids=self._prompt.token_ids if self._return_token_ids else None,
        )
        if self._prompt_logprobs is not None:
            response.prompt_logprobs = vllm_prompt_logprobs(
                self._tokenizer,
                self._prompt.token_ids,
                acc.prompts[0].prompt_logprobs,
                self._prompt_logprobs,
            )
        return response.model_dump_json(exclude=self._exclude)


def _finish_reason(finish_reason: str | None, calls: list[ToolCall]) -> str | None:
    """OpenAI's: an output that ended (not cut by the length limit) with tool calls."""
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason
