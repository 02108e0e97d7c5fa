"""Tool-call parsers: a model's text -> content and OpenAI-style tool calls, whole or streamed.

Named as vLLM's ``--tool-call-parser`` values:
- ``hermes`` (Hermes, Qwen 2/2.5/3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks, any number, after optional content;
- ``llama3_json`` (Llama 3.1+): the output is one JSON object (or several joined by ``;``)
  ``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``;
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name": ..., "arguments": {...}}``;
- ``openai`` (gpt-oss, harmony): commentary messages to ``functions.NAME`` whose body is the
  arguments' JSON, as the ``openai_gptoss`` reasoning parser leaves them in the content
  (``<|channel|>commentary to=functions.NAME<|message|>{...}<|call|>``).
``detect_tool_call_parser`` picks one from a chat template. Text that looks like a call but
does not parse stays content. Streaming holds back only text that may start a call: content
streams as it comes, calls arrive whole (id, name and the JSON arguments) once complete.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall]


def _call_from_json(obj: object, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(arguments, str):  # already JSON text
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


class ToolParser:
    """Base: ``parse(text)`` for a whole output; ``StreamingToolParser`` for deltas."""

    name = ""
    start_marker = ""  # text that starts the tool-call part of the output

    def parse(self, text: str) -> ParsedOutput:
        raise NotImplementedError

    def tool_part_start(self, text: str) -> int | None:
        """Where the tool-call part of ``text`` starts, if it has one so far."""
        index = text.find(self.start_marker)
        return None if index < 0 else index


class HermesToolParser(ToolParser):
    name = "hermes"
    start_marker = "<tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> ParsedOutput:
        start = text.find(self.start_marker)
        if start < 0:
            return ParsedOutput(text, [])
        calls = []
        for body in self._BLOCK.findall(text[start:]):
            try:
                call = _call_from_json(json.loads(body), "arguments")
            except json.JSONDecodeError:
                call = None
            if call is None:
                return ParsedOutput(text, [])
            calls.append(call)
        content = text[:start].strip()
        return ParsedOutput(content or None, calls)


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    start_marker = "<|python_tag|>"

    def tool_part_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith(self.start_marker) or stripped.startswith("{"):
            return len(text) - len(stripped)
        return None

    def parse(self, text: str) -> ParsedOutput:
        body = text.strip().removeprefix(self.start_marker).strip()
        if not body.startswith("{"):
            return ParsedOutput(text, [])
        calls = []
        decoder = json.JSONDecoder()
        index = 0
        while index < len(body):
            try:
                obj, end = decoder.raw_decode(body, index)
            except json.JSONDecodeError:
                return ParsedOutput(text, [])
            call = _call_from_json(obj, "parameters")
            if call is None:
                return ParsedOutput(text, [])
            calls.append(call)
            index = end
            while index < len(body) and body[index] in " \n\t;":
                index += 1
        return ParsedOutput(None, calls)


class MistralToolParser(ToolParser):
    name = "mistral"
    start_marker = "[TOOL_CALLS]"

    def parse(self, text: str) -> ParsedOutput:
        start = text.find(self.start_marker)
        if start < 0:
            return ParsedOutput(text, [])
        body = text[start + len(self.start_marker) :].strip()
        try:
            obj, _ = json.JSONDecoder().raw_decode(body)
        except json.JSONDecodeError:
            return ParsedOutput(text, [])
        items = obj if isinstance(obj, list) else [obj]
        calls = [_call_from_json(item, "arguments") for item in items]
        if not calls or any(c is None for c in calls):
            return ParsedOutput(text, [])
        content = text[:start].strip()
        return ParsedOutput(content or None, calls)


class HarmonyToolParser(ToolParser):
    name = "openai"
    start_marker = "<|channel|>commentary to=functions."
    _CALL = re.compile(
        r"<\|channel\|>commentary to=functions\.([^<\s]+)<\|message\|>(.*?)(?:<\|call\|>|$)",
        re.DOTALL,
    )

    def parse(self, text: str) -> ParsedOutput:
        start = text.find(self.start_marker)
        if start < 0:
            return ParsedOutput(text, [])
        calls = []
        for name, body in self._CALL.findall(text[start:]):
            try:
                arguments = json.loads(body) if body.strip() else {}
            except json.JSONDecodeError:
                return ParsedOutput(text, [])
            if not isinstance(arguments, dict):
                return ParsedOutput(text, [])
            calls.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False)))
        if not calls:
            return ParsedOutput(text, [])
        content = text[:start].strip()
        return ParsedOutput(content or None, calls)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,  # Qwen's format is Hermes'
    "llama3_json": Llama3JsonToolParser,
    "llama4_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "openai": HarmonyToolParser,
}


def get_tool_parser(name: str) -> ToolParser:
    """ValueError naming the known parsers for an unknown name."""
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"unknown tool call parser {name!r} (known: {', '.join(sorted(TOOL_PARSERS))})"
        ) from None


def detect_tool_call_parser(chat_template: str | None) -> str | None:
    """The parser a chat template's tool-call syntax calls for, None if it has none."""
    if not chat_template or "tool" not in chat_template:
        return None
    if "<|channel|>" in chat_template and "functions." in chat_template:
        return "openai"
    if "<tool_call>" in chat_template:
        return "hermes"
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if "<|python_tag|>" in chat_template or "ipython" in chat_template:
        return "llama3_json"
    return None


class StreamingToolParser:
    """Feeds one choice's text deltas; content streams out, tool calls come out whole."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self._text = ""
        self._sent = 0  # characters of _text already sent as content
        self.in_tool_part = False

    def feed(self, delta: str) -> str:
        """-> the content to stream now (may be "")."""
        self._text += delta
        if self.in_tool_part:
            return ""
        start = self.parser.tool_part_start(self._text)
        if start is not None:
            self.in_tool_part = True
            out = self._text[self._sent : start]
            self._sent = start
            return out.rstrip() if not out.strip() else out
        # Hold back a tail that may be the start of the marker.
        keep = _marker_prefix_len(self._text, self.parser.start_marker)
        if isinstance(self.parser, Llama3JsonToolParser) and not self._text.strip():
            keep = len(self._text) - self._sent  # nothing but spaces so far: wait
        end = len(self._text) - keep
        out = self._text[self._sent : end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end: (content not yet sent, the tool calls)."""
        parsed = self.parser.parse(self._text)
        if not parsed.tool_calls:
            # No call: what was held back is content, unless the parser says the output has
            # none (a forced call cut before its name: neither content nor a call).
            rest = self._text[self._sent :] if parsed.content is not None else ""
            self._sent = len(self._text)
            return rest, []
        self._sent = len(self._text)
        return "", parsed.tool_calls


def _marker_prefix_len(text: str, marker: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
