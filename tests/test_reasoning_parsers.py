"""Reasoning parsers (--reasoning-parser): reasoning and answer apart, whole and streamed in
every split of the text; harmony's channels and its tool calls through the openai parser."""

from __future__ import annotations

import json
import random

import pytest

from pydaemon.entrypoints.common.reasoning_parsers import (
    ReasoningSplit,
    ReasoningStreams,
    detect_reasoning_parser,
    get_reasoning_parser,
)
from pydaemon.entrypoints.common.tool_parsers import detect_tool_call_parser, get_tool_parser

R1, QWEN3, HARMONY = "deepseek_r1", "qwen3", "openai_gptoss"
CASES = [
    # (parser, prompt's end, output, reasoning, content)
    (R1, "", "<think>\nLet me add.</think>\n\nIt is 4.", "\nLet me add.", "It is 4."),
    (R1, "<think>\n", "Let me add.</think>It is 4.", "Let me add.", "It is 4."),
    (R1, "", "Still thinking, cut by max_tokens", "Still thinking, cut by max_tokens", None),
    (R1, "<think>\n\n</think>\n\n", "Just the answer.", None, "Just the answer."),
    (QWEN3, "", "<think>\nhmm</think>\n\nYes.", "\nhmm", "Yes."),
    (QWEN3, "", "Yes, without thinking.", None, "Yes, without thinking."),
    (QWEN3, "", "  <think>a<b</think>c", "a<b", "c"),
    (QWEN3, "<think>\n\n</think>\n\n", "<think> is a tag", None, "<think> is a tag"),
    (QWEN3, "", "<think>cut short", "cut short", None),
    (QWEN3, "", "<thi", None, "<thi"),
    (HARMONY, "", "<|channel|>analysis<|message|>User asks 2+2.<|end|><|start|>assistant"
     "<|channel|>final<|message|>4<|return|>", "User asks 2+2.", "4"),
    (HARMONY, "", "<|channel|>final<|message|>Hi there", None, "Hi there"),
    (HARMONY, "", "<|channel|>analysis<|message|>cut", "cut", None),
]  # fmt: skip


@pytest.mark.parametrize("name,prompt,text,reasoning,content", CASES)
def test_whole_and_every_split_agree(name, prompt, text, reasoning, content):
    parser = get_reasoning_parser(name)
    assert parser.split(text, prompt) == ReasoningSplit(reasoning, content)
    cuts = list(range(1, len(text)))
    for trial in range(40):
        points = sorted(random.Random(trial).sample(cuts, min(len(cuts), trial % 6 + 1)))
        stream = parser.stream(prompt)
        got_r, got_c = "", ""
        for a, b in zip([0, *points], [*points, len(text)], strict=True):
            r, c = stream.feed(text[a:b])
            got_r, got_c = got_r + r, got_c + c
        r, c = stream.finish()
        got_r, got_c = got_r + r, got_c + c
        assert (got_r if stream.had_reasoning else None) == reasoning, points
        assert (got_c or None) == content, points


def test_reasoning_streams_before_the_end_marker():
    stream = get_reasoning_parser(R1).stream("<think>\n")
    assert stream.feed("step one, ") == ("step one, ", "")
    assert stream.feed("two</th") == ("two", "")  # the marker's start is held back
    assert stream.feed("ink>\n\nDone") == ("", "Done")


def test_harmony_tool_calls_reach_the_openai_tool_parser():
    text = (
        "<|channel|>analysis<|message|>Need the weather.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json"
        '<|message|>{"city": "Oslo"}<|call|>'
    )
    split = get_reasoning_parser(HARMONY).split(text)
    assert split.reasoning == "Need the weather."
    parsed = get_tool_parser("openai").parse(split.content)
    assert parsed.content is None
    [call] = parsed.tool_calls
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"}
    # the call stop token is not in the text (it ended the sequence): the end of text ends it
    split = get_reasoning_parser(HARMONY).split(text.removesuffix("<|call|>"))
    [call] = get_tool_parser("openai").parse(split.content).tool_calls
    assert json.loads(call.arguments) == {"city": "Oslo"}


def test_unknown_names_and_detection():
    with pytest.raises(ValueError, match="unknown reasoning parser 'r2'.*deepseek_r1"):
        get_reasoning_parser("r2")
    harmony = "<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }} to=functions."
    assert detect_reasoning_parser(harmony) == HARMONY
    assert detect_tool_call_parser(harmony + " tools") == "openai"
    assert detect_reasoning_parser("{% if enable_thinking %}<think>{% endif %}") is None


def test_markers_follow_the_prompt():
    class Tok:
        ids = {"<think>": [7], "</think>": [8], "<|channel|>final": [1, 2], "<|message|>": [3]}

        def encode(self, text, add_bos=False):
            return self.ids[text]

    qwen3, r1 = get_reasoning_parser(QWEN3), get_reasoning_parser(R1)
    either = qwen3.markers(Tok(), "<|im_start|>assistant\n")
    assert (either.end, either.start) == ((8,), (7,))
    opened = qwen3.markers(Tok(), "<think>\n")
    assert (opened.end, opened.start) == ((8,), None)
    assert qwen3.markers(Tok(), "<think>\n\n</think>\n\n") is None
    assert r1.markers(Tok(), "").start is None
    harmony = get_reasoning_parser(HARMONY).markers(Tok(), "")
    assert (harmony.end, harmony.end_suffix) == ((1, 2), (3,))
    # Think tags are also found in the text, however the model spells them (issue 55, item
    # 10); harmony's markers are special tokens: by id only.
    assert either.end_text == opened.end_text == "</think>" and harmony.end_text is None
    from pydaemon.entrypoints.common.reasoning_parsers import apply_reasoning
    from pydaemon.sampling_params import SamplingParams, StructuredOutputsParams

    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[0-9]"))
    spec = apply_reasoning(params, qwen3, Tok(), "<think>\n").structured_outputs
    assert (spec.reasoning_end, spec.reasoning_end_text) == ((8,), "</think>")


def test_grpc_account_of_a_harmony_chat_with_a_tool_call():
    """The frames of a gpt-oss chat (text with its specials kept, in uneven deltas): reasoning
    and content per delta, and in Finished the split and the call read from the answer."""
    from pydaemon.entrypoints.grpc.frames import RequestAccount
    from pydaemon.outputs import CompletionOutput, RequestOutput
    from pydaemon.proto.pagedd.v1 import generation_pb2 as pb

    text = (
        "<|channel|>analysis<|message|>Need Oslo's weather.<|end|><|start|>assistant to="
        'functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city": "Oslo"}'
    )
    account = RequestAccount(
        "a",
        tool_parser=get_tool_parser("openai"),
        reasoning=ReasoningStreams(get_reasoning_parser(HARMONY)),
    )
    cuts = [0, 5, 17, 40, 41, 90, 120, len(text)]
    deltas = []
    for k, (a, b) in enumerate(zip(cuts[:-1], cuts[1:], strict=True)):
        finish = "stop" if b == len(text) else None
        out = CompletionOutput(0, [k], text[a:b], finish_reason=finish)
        for frame in account.frames(RequestOutput("a", None, [1], [out], finished=bool(finish))):
            deltas.append(frame.delta)
    assert "".join(d.text for d in deltas) == text
    assert "".join(d.reasoning for d in deltas) == "Need Oslo's weather."
    finished = account.finished().finished
    assert finished.finish_reason == pb.FINISH_REASON_STOP
    [split] = finished.reasoning
    assert split.reasoning == "Need Oslo's weather." and split.content == ""  # only a call
    [calls] = finished.tool_calls
    [call] = calls.calls
    assert call.name == "get_weather" and json.loads(call.arguments_json) == {"city": "Oslo"}


@pytest.mark.parametrize("name", [R1, QWEN3])
def test_a_continued_message_goes_on_from_where_it_stopped(name):
    """continue_final_message (issue 55, 13): an answer's continuation is the answer, kept as
    it comes (mid-sentence); reasoning only inside a <think> the message left open; an echoed
    message is split from its own start, whatever the parser assumes of a model's output."""
    parser = get_reasoning_parser(name)
    answer = parser.continued_tail("<think>ok</think>\n\nThe answer is")
    assert parser.split(" 42.", answer) == ReasoningSplit(None, " 42.")
    assert parser.split(" 42.", parser.continued_tail("The answer is")).content == " 42."
    thinking = parser.continued_tail("<think>\nLet me see")
    assert parser.split(" more</think>4", thinking) == ReasoningSplit(" more", "4")
    assert parser.split_message("The answer is") == ReasoningSplit(None, "The answer is")
    assert parser.split_message("<think>ok</think>\n\nIt") == ReasoningSplit("ok", "It")
    harmony = get_reasoning_parser(HARMONY)
    assert harmony.split_message("<b>") == ReasoningSplit(None, "<b>")
