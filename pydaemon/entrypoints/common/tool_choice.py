"""OpenAI ``tools`` / ``tool_choice``: validation, and the constraint that enforces a choice.

``tool_choice``: ``"none"`` (tools are not offered), ``"auto"`` (the template renders the tools,
a tool-call parser reads the output), ``"required"`` (at least one call, enforced: the output
is a JSON list of ``{"name", "parameters"}`` matching the tools' schemas, as vLLM builds it), or
``{"type": "function", "function": {"name": ...}}`` (that function, enforced: the output is its
arguments object). A tool whose ``parameters`` schema xgrammar cannot compile is a ValueError.

``"auto"`` on a chat template that leaves the tools out of the prompt (SmolLM2's, and any
template written without tools) is refused (``ToolsNotRendered``): the model would never know
of the tools, and the parser would never find a call, so the request would be answered as if
no tools had been sent. Refused rather than served with a warning (a log line the client never
sees) or with the tools written into a system prompt of our own (the parser names how calls
are written, not how the model was taught to read tools: guessing that prompt gives a model
instructions it was never trained on). "required" and a named function still work with any
template: their constraint enforces the call; ``--chat-template`` serves a template that
renders tools.
"""

from __future__ import annotations

import json
from typing import Any

from pydaemon.entrypoints.common.tool_parsers import (
    ParsedOutput,
    ToolCall,
    ToolParser,
    get_tool_parser,
)
from pydaemon.sampling_params import StructuredOutputsParams
from pydaemon.tokenizer.chat_encoding import encode_chat

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def check_tools(tools: list[dict[str, Any]] | None, tool_choice: Any) -> str | None:
    """Validates ``tools`` and ``tool_choice``; -> the named function, if one is named.
    ValueError naming what is wrong."""
    names = []
    for i, tool in enumerate(tools or ()):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or (not isinstance(function, dict) or not isinstance(function.get("name"), str))
        ):
            raise ValueError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name'...}}}}"
            )
        parameters = function.get("parameters", _EMPTY_PARAMETERS)
        if not isinstance(parameters, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        names.append(function["name"])
    if tool_choice is None or tool_choice in ("none", "auto"):
        return None
    if not tools:
        raise ValueError(f"tool_choice {tool_choice!r} needs tools")
    if tool_choice == "required":
        return None
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if tool_choice.get("type", "function") == "function" and isinstance(name, str):
            if name not in names:
                raise ValueError(f"tool_choice names {name!r}, which is not in tools")
            return name
    raise ValueError(
        "tool_choice must be 'none', 'auto', 'required' or "
        "{'type': 'function', 'function': {'name': ...}}"
    )


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or _EMPTY_PARAMETERS


def tool_choice_constraint(
    tools: list[dict[str, Any]], tool_choice: Any, parallel_tool_calls: bool = True
) -> StructuredOutputsParams | None:
    """The constraint that enforces ``tool_choice`` (None for auto / none); "required" with
    ``parallel_tool_calls`` False makes exactly one call."""
    named = check_tools(tools, tool_choice)
    if named is not None:
        tool = next(t for t in tools if t["function"]["name"] == named)
        return StructuredOutputsParams(json=_parameters(tool), disable_any_whitespace=True)
    if tool_choice != "required":
        return None
    one_call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [t["function"]["name"]]},
                    # Its references ("#/$defs/...") name its own root, which is now here.
                    "parameters": _rebased(
                        _parameters(t), f"#/items/anyOf/{i}/properties/parameters"
                    ),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for i, t in enumerate(tools)
        ]
    }
    # Compact JSON: the arguments are re-serialized anyway, and whitespace costs tokens.
    calls = {"type": "array", "minItems": 1, "items": one_call}
    if not parallel_tool_calls:
        calls["maxItems"] = 1
    return StructuredOutputsParams(json=calls, disable_any_whitespace=True)


# Keywords whose values are data, not schemas: a "$ref" inside them is not a reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _rebased(schema: Any, root: str) -> Any:
    """``schema`` with every local reference ("#", "#/...") rewritten to point under
    ``root``, the JSON pointer where the schema now sits inside a larger one."""
    if isinstance(schema, list):
        return [_rebased(v, root) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = root + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        elif key == "properties" and isinstance(value, dict):  # names, then schemas
            out[key] = {name: _rebased(v, root) for name, v in value.items()}
        else:
            out[key] = _rebased(value, root)
    return out


def forced_tool_calls(text: str, tools: list[dict[str, Any]], tool_choice: Any) -> list[ToolCall]:
    """The tool calls of an output generated under ``tool_choice_constraint`` (required or
    named). An output cut by max_tokens (not complete JSON) keeps its whole calls only: a cut
    call is left out, as OpenAI and vLLM answer (finish_reason stays "length"; a cut named
    call leaves no call and no content: its half JSON is neither)."""
    named = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return _partial_calls(text, named)
    if named is not None:
        return [ToolCall(named, json.dumps(value, ensure_ascii=False))]
    return [
        ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in value
    ]


def _partial_calls(text: str, named: str | None) -> list[ToolCall]:
    if named is not None:
        return []
    calls = []
    decoder = json.JSONDecoder()
    index = 1 if text.startswith("[") else len(text)
    while index < len(text):
        try:
            item, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            break  # the cut call
        calls.append(ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False)))
        if text.startswith(",", index):
            index += 1
    return calls


def messages_for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant ``tool_calls`` with their JSON ``arguments`` as objects, as chat templates
    (Qwen's, Llama's, Mistral's) expect them (vLLM does the same); a message without content
    (an assistant turn that only called tools: the OpenAI client sends ``content: null`` or
    nothing) gets "" so that templates reading ``message['content']`` render it."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls or message.get("content") is None:
            message = dict(message)
            if message.get("content") is None:
                message["content"] = ""
            if calls:
                message["tool_calls"] = [_with_object_arguments(c) for c in calls]
        out.append(message)
    return out


def _with_object_arguments(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


class ForcedToolParser(ToolParser):
    """The "parser" of an output generated under tool_choice required or named: all of it is
    the tool call(s) (nothing streams as content)."""

    name = "forced"

    def __init__(self, tools: list[dict[str, Any]], tool_choice: Any) -> None:
        self.tools, self.tool_choice = tools, tool_choice

    def tool_part_start(self, text: str) -> int | None:
        return 0

    def parse(self, text: str) -> ParsedOutput:
        """Never content: the output is the call(s); cut by max_tokens, its whole calls only
        (a stream has sent the cut call's arguments as they came, as vLLM's does)."""
        return ParsedOutput(None, forced_tool_calls(text, self.tools, self.tool_choice))


class ToolsNotRendered(ValueError):
    """tool_choice "auto" on a chat template that leaves the tools out of the prompt."""


TOOLS_NOT_RENDERED = (
    'tool_choice "auto": this model\'s chat template does not render tools (the prompt is the '
    "same without them), so the model would never see them and could not call them; use "
    'tool_choice "required" or a named function (enforced with any template), "none", or a '
    "template that renders tools (the daemon's --chat-template)"
)


def tools_must_render(tools: list[dict[str, Any]] | None, tool_choice: Any) -> bool:
    """Whether the template must write ``tools`` for the request to mean anything: tool_choice
    "auto" (or none given, which means auto), where the model itself decides to call."""
    return bool(tools) and tool_choice in (None, "auto")


def encode_chat_with_tools(
    tokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None,
    *,
    must_render_tools: bool,
    **kwargs: Any,
) -> tuple[str, list[int]]:
    """``encode_chat``; with ``must_render_tools`` (tools_must_render) ToolsNotRendered when the
    template leaves ``tools`` out. The check renders the conversation once more, without the
    tools: exact for templates that write tools only in some places (a system turn, the last
    user turn)."""
    text, ids = encode_chat(tokenizer, messages, add_generation_prompt, tools, **kwargs)
    if must_render_tools and tools:
        without, _ = encode_chat(tokenizer, messages, add_generation_prompt, None, **kwargs)
        if without == text:
            raise ToolsNotRendered(TOOLS_NOT_RENDERED)
    return text, ids


AUTO_NEEDS_PARSER = (
    '"auto" tool choice requires --tool-call-parser to be set: this model\'s chat template '
    "has no tool-call syntax pagedd recognises, so the model's calls could not be read "
    '(tool_choice "required" or a named function work with any model; "none" leaves the '
    "tools out)"
)


def chat_tool_parser(
    tools: list[dict[str, Any]] | None, tool_choice: Any, parser_name: str | None
) -> ToolParser | None:
    """How to read tool calls out of a chat output: forced (required / named), the named or
    detected parser (auto; tools without a tool_choice mean auto, as in vLLM), or None (no
    tools, tool_choice none). Auto without a parser is a ValueError (vLLM's rule: its calls
    would come back as plain content, the tools silently ignored)."""
    if not tools or tool_choice == "none":
        return None
    if tool_choice not in (None, "auto"):
        return ForcedToolParser(tools, tool_choice)
    if parser_name is None:
        raise ValueError(AUTO_NEEDS_PARSER)
    return get_tool_parser(parser_name)
