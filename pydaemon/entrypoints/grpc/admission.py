"""Admission of one StartRequest: the model's prompt applied (chat rendered off the event loop),
the request validated, and the queue limit, in sequences."""

from __future__ import annotations

import asyncio

import grpc

from pydaemon.engine.engine_client import EngineClient, num_sequences
from pydaemon.entrypoints.common.tool_parsers import ToolParser
from pydaemon.entrypoints.grpc.model_prompt import apply_model_prompt, chat_tools
from pydaemon.entrypoints.grpc.validation import (
    EngineArgs,
    RequestInvalid,
    check_text_size,
    to_engine_args,
)
from pydaemon.proto.pagedd.v1 import generation_pb2 as pb


def check_chat_size(start: pb.StartRequest, engine: EngineClient) -> None:
    """Refuses messages too long to fit, before anything renders them."""
    contents = [m.content for m in start.messages.messages]
    check_text_size(contents, engine.model_info.max_model_len, "prompt messages")


async def render_chat(
    start: pb.StartRequest,
    engine: EngineClient,
    parse_special_tokens_in_chat: bool,
    tool_call_parser: str | None = None,
) -> tuple[pb.StartRequest, ToolParser | None]:
    """The messages (and their tools) rendered into token ids in the executor: a big
    conversation takes seconds to render and tokenize, and every other stream shares this event
    loop. -> (the rendered request, the parser of the model's tool calls when tools are given)."""

    def render() -> tuple[pb.StartRequest, ToolParser | None]:
        tools, tool_choice, tool_parser = chat_tools(start, engine.tokenizer, tool_call_parser)
        rendered = apply_model_prompt(
            start,
            engine.tokenizer,
            tools,
            tool_choice,
            parse_special_tokens_in_chat=parse_special_tokens_in_chat,
        )
        return rendered, tool_parser

    return await asyncio.get_running_loop().run_in_executor(None, render)


def admit(start: pb.StartRequest, engine: EngineClient, max_queued_requests: int) -> EngineArgs:
    """Validated engine arguments, or RequestInvalid (RESOURCE_EXHAUSTED when the queue, counted
    in sequences, has no room for this request's)."""
    info = engine.model_info
    args = to_engine_args(
        start,
        vocab_size=info.vocab_size,
        has_tokenizer=info.has_tokenizer,
        max_model_len=info.max_model_len,
        defaults=info.generation_defaults,
    )
    num_queued = engine.num_unscheduled
    num_new = num_sequences(args.params)
    if num_queued + num_new > max_queued_requests:
        raise RequestInvalid(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{num_queued} sequences are queued and this request adds {num_new}; "
            f"--max-queued-requests is {max_queued_requests}: retry later",
        )
    return args
