"""What the loaded model adds to a StartRequest before validation: chat messages rendered by its
chat template into token ids (with their tools, and the constraint a forced tool choice
needs). ``chat_tools`` reads a chat request's tools and how to find the calls in its output.
Its generation_config.json sampling defaults are merged where every front end merges them
(``GenerationDefaults.sampling_params``, from grpc/validation.py)."""

from __future__ import annotations

import json
from typing import Any

import grpc

from pydaemon.entrypoints.common.limits import LimitError, check_chat_role
from pydaemon.entrypoints.common.tool_choice import (
    ToolsNotRendered,
    chat_tool_parser,
    encode_chat_with_tools,
    messages_for_template,
    tool_choice_constraint,
    tools_must_render,
)
from pydaemon.entrypoints.common.tool_parsers import ToolParser, detect_tool_call_parser
from pydaemon.entrypoints.grpc.validation import RequestInvalid
from pydaemon.proto.pagedd.v1 import generation_pb2 as pb
from pydaemon.tokenizer.loader import AnyTokenizer


def _invalid(message: str) -> RequestInvalid:
    return RequestInvalid(grpc.StatusCode.INVALID_ARGUMENT, message)


def chat_tools(
    start: pb.StartRequest, tokenizer: AnyTokenizer | None, parser_name: str | None
) -> tuple[list[dict[str, Any]] | None, Any, ToolParser | None]:
    """A chat request's (OpenAI-style tools, tool_choice, the parser of its output's calls);
    (None, None, None) without tools. INVALID_ARGUMENT for a bad tool or choice."""
    if start.WhichOneof("prompt") != "messages" or not start.messages.tools:
        if start.WhichOneof("prompt") == "messages" and start.messages.tool_choice:
            raise _invalid("messages.tool_choice needs messages.tools")
        return None, None, None
    tools = []
    for i, tool in enumerate(start.messages.tools):
        try:
            parameters = json.loads(tool.parameters_json) if tool.parameters_json else {}
        except json.JSONDecodeError as e:
            raise _invalid(f"messages.tools[{i}].parameters_json is not JSON: {e}") from None
        function = {"name": tool.name, "description": tool.description, "parameters": parameters}
        tools.append({"type": "function", "function": function})
    choice: Any = start.messages.tool_choice or "auto"
    if choice not in ("auto", "none", "required"):
        choice = {"type": "function", "function": {"name": choice}}
    if parser_name is None and tokenizer is not None:
        parser_name = detect_tool_call_parser(tokenizer.chat_template)
    try:
        return tools, choice, chat_tool_parser(tools, choice, parser_name)
    except ValueError as e:
        raise _invalid(f"messages: {e}") from None


def apply_model_prompt(
    start: pb.StartRequest,
    tokenizer: AnyTokenizer | None,
    tools: list[dict[str, Any]] | None = None,
    tool_choice: Any = None,
    *,
    parse_special_tokens_in_chat: bool = False,
) -> pb.StartRequest:
    """-> ``start`` itself when it has no chat messages, else a copy with them rendered.
    ``tools`` and ``tool_choice``: ``chat_tools``' reading of its messages. Special-token text
    in message content stays plain text unless ``parse_special_tokens_in_chat``."""
    if start.WhichOneof("prompt") != "messages":
        return start
    start = pb.StartRequest.FromString(start.SerializeToString())
    for i, m in enumerate(start.messages.messages):
        try:
            check_chat_role(m.role, f"messages.messages[{i}].role")  # HTTP's rule
        except LimitError as e:
            raise _invalid(e.message) from None
    messages = [_message(m) for m in start.messages.messages]
    if not messages:
        raise RequestInvalid(grpc.StatusCode.INVALID_ARGUMENT, "prompt messages is empty")
    try:
        constraint = tool_choice_constraint(tools, tool_choice) if tools else None
        rendered = None if tool_choice == "none" else tools
        _, ids = encode_chat_with_tools(
            tokenizer,
            messages_for_template(messages),
            True,
            rendered,
            must_render_tools=tools_must_render(tools, tool_choice),
            parse_special_tokens_in_content=parse_special_tokens_in_chat,
        )
    except ToolsNotRendered as e:
        raise _invalid(f"messages.tools: {e}") from None
    except ValueError as e:
        raise RequestInvalid(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
    if constraint is not None:
        if start.HasField("structured_output"):
            raise _invalid("a forced tool_choice cannot be combined with structured_output")
        start.structured_output.json_schema = json.dumps(constraint.json)
        start.structured_output.disable_any_whitespace = constraint.disable_any_whitespace
    start.token_ids.ids[:] = ids  # sets the oneof: messages is cleared
    return start


def _message(m: pb.ChatMessage) -> dict[str, Any]:
    message: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_call_id:
        message["tool_call_id"] = m.tool_call_id
    if m.reasoning:  # the template sees it as reasoning_content and thinking (chat_template.py)
        message["reasoning_content"] = m.reasoning
    if m.tool_calls:
        message["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments_json},
            }
            for c in m.tool_calls
        ]
    return message
