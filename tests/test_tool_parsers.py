"""Tool-call parsers (hermes, llama3_json, mistral), whole and streamed, the parser picked from
a chat template, and the constraints that enforce tool_choice required / named."""

from __future__ import annotations

import json

import jsonschema
import pytest
from tokenizer_utils import LLAMA3_TEMPLATE, MISTRAL_TEMPLATE, QWEN2_TEMPLATE

from pydaemon.entrypoints.common.tool_choice import (
    ForcedToolParser,
    check_tools,
    forced_tool_calls,
    messages_for_template,
    tool_choice_constraint,
)
from pydaemon.entrypoints.common.tool_parsers import (
    StreamingToolParser,
    detect_tool_call_parser,
    get_tool_parser,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}

CASES = [
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        "Let me check.",
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "parameters": {}}',
        None,
    ),
    (
        "mistral",
        'Let me check. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {}}]',
        "Let me check.",
    ),
]


@pytest.mark.parametrize(("name", "text", "content"), CASES)
def test_parse_whole_output(name, text, content):
    parsed = get_tool_parser(name).parse(text)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    ids = {c.id for c in parsed.tool_calls}
    assert len(ids) == 2 and all(i.startswith("call_") for i in ids)


@pytest.mark.parametrize(("name", "text", "content"), CASES)
def test_parse_streamed_in_small_deltas(name, text, content):
    stream = StreamingToolParser(get_tool_parser(name))
    sent = "".join(stream.feed(text[i : i + 3]) for i in range(0, len(text), 3))
    rest, calls = stream.finish()
    assert (sent + rest).strip() == (content or "")
    assert [c.name for c in calls] == ["get_weather", "get_time"]


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral"])
def test_plain_text_and_broken_calls_stay_content(name):
    for text in ["Just text, no tools.", "<tool_call>{not json", '[TOOL_CALLS] [{"x": 1}]']:
        parsed = get_tool_parser(name).parse(text)
        assert parsed.tool_calls == [] and parsed.content == text
        stream = StreamingToolParser(get_tool_parser(name))
        sent = "".join(stream.feed(c) for c in text)
        rest, calls = stream.finish()
        assert calls == [] and sent + rest == text


def test_unknown_parser_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown tool call parser 'x'.*hermes"):
        get_tool_parser("x")


def test_detect_parser_from_template():
    assert detect_tool_call_parser(QWEN2_TEMPLATE) == "hermes"
    assert detect_tool_call_parser(MISTRAL_TEMPLATE) is None  # renders no tools
    assert detect_tool_call_parser("{{ tools }}[TOOL_CALLS]") == "mistral"
    assert detect_tool_call_parser(LLAMA3_TEMPLATE + "<|python_tag|>") == "llama3_json"
    assert detect_tool_call_parser(None) is None


def test_tool_choice_checks():
    assert check_tools([WEATHER], "auto") is None
    assert check_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}) == (
        "get_weather"
    )
    with pytest.raises(ValueError, match="'nope', which is not in tools"):
        check_tools([WEATHER], {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ValueError, match="needs tools"):
        check_tools(None, "required")
    with pytest.raises(ValueError, match="tools\\[0\\] must be"):
        check_tools([{"type": "function"}], "auto")
    with pytest.raises(ValueError, match="tool_choice must be"):
        check_tools([WEATHER], "sometimes")


def test_required_and_named_constraints():
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert tool_choice_constraint([WEATHER, TIME], named).json == WEATHER["function"]["parameters"]
    assert tool_choice_constraint([WEATHER], "auto") is None
    required = tool_choice_constraint([WEATHER, TIME], "required").json
    output = [
        {"name": "get_weather", "parameters": {"city": "Oslo"}},
        {"name": "get_time", "parameters": {}},
    ]
    jsonschema.validate(output, required)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(
            [
                {"name": "get_time", "parameters": {"city": 1}},
            ],
            {**required, "items": {"anyOf": required["items"]["anyOf"][:1]}},
        )
    single = tool_choice_constraint([WEATHER, TIME], "required", parallel_tool_calls=False).json
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(output, single)  # two calls where one is allowed
    jsonschema.validate(output[:1], single)
    calls = forced_tool_calls(json.dumps(output), [WEATHER, TIME], "required")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]
    calls = forced_tool_calls('{"city": "Rome"}', [WEATHER], named)
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Rome"}')]
    # Cut by max_tokens: no half call (issue 55, item 22: as OpenAI and vLLM); the whole
    # calls before a cut one stay; a cut named call leaves neither a call nor content.
    assert forced_tool_calls('{"city": "Ro', [WEATHER], named) == []
    cut = forced_tool_calls(json.dumps(output)[:-12], [WEATHER, TIME], "required")
    assert [(c.name, json.loads(c.arguments)) for c in cut] == [("get_weather", {"city": "Oslo"})]
    parsed = ForcedToolParser([WEATHER], named).parse('{"city": "Ro')
    assert (parsed.content, parsed.tool_calls) == (None, [])


def test_messages_for_template_turn_arguments_into_objects():
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages = [{"role": "assistant", "content": None, "tool_calls": [call]}]
    out = messages_for_template(messages)
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'


def test_a_tool_call_turn_without_content_renders_with_a_template_that_reads_content():
    """The OpenAI client sends an assistant turn that only called tools with no content (or
    null); a template reading message['content'] (SmolLM2's) must still render it."""
    from pydaemon.tokenizer.chat_template import render_chat_template

    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    for turn in (
        {"role": "assistant", "tool_calls": [call]},
        {"role": "assistant", "content": None},
    ):
        messages = messages_for_template([{"role": "user", "content": "hi"}, turn])
        assert messages[1]["content"] == ""
        text = render_chat_template(
            template, messages, model_name="m", special_tokens={}, add_generation_prompt=False
        )
        assert text == "<user>hi<assistant>"


def test_a_forced_call_cut_by_max_tokens_is_left_out_never_content():
    """Issue 46: the raw partial JSON came back as content; issue 55 (22): then the cut call
    came back as a call. OpenAI and vLLM leave a cut call out: the whole calls only."""
    from pydaemon.entrypoints.common.tool_choice import ForcedToolParser

    tools = [{"type": "function", "function": {"name": n}} for n in ("a", "b")]
    required = ForcedToolParser(tools, "required")
    cases = {
        '[{"name":"a","parameters":{"x":1}},{"name":"b","parameters":{"y":"Os': [
            ("a", '{"x": 1}'),
        ],
        '[{"name":"a","parameters":{"x":1}},{"na': [("a", '{"x": 1}')],
        '[{"name":"b","par': [],
        '[{"name":"b': [],
        "": [],
    }
    for text, calls in cases.items():
        parsed = required.parse(text)
        assert parsed.content is None
        assert [(c.name, c.arguments) for c in parsed.tool_calls] == calls, text
    named = ForcedToolParser(tools, {"type": "function", "function": {"name": "b"}})
    parsed = named.parse('{"city":"Os')
    assert parsed.content is None and parsed.tool_calls == []
    stream = StreamingToolParser(required)
    assert stream.feed('[{"name":"b') == ""
    assert stream.finish() == ("", [])  # cut before the name: no content, no call
