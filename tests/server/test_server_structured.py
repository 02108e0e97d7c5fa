"""Structured outputs over gRPC (StartRequest.structured_output) on the demo engine: JSON
schema, regex, choice, grammar, json_object; a bad constraint is an in-band INVALID_ARGUMENT
error (the stream lives on) before any KV block is taken; `pagedd generate --json-schema`."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from conftest import make_server_thread, shared_demo_engine
from server_helpers import BidiClient, joined_text

from pydaemon.entrypoints.grpc.client import add_generate_flags, run_generate
from pydaemon.proto.pagedd.v1 import generation_pb2 as pb

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server():
    st = make_server_thread(shared_demo_engine)
    yield st
    st.close()


def _run(server, constraint: pb.StructuredOutput, n: int = 2) -> list[str]:
    sampling = pb.SamplingParams(max_tokens=150, n=n, seed=5)
    client = BidiClient(server.stub()).start(
        "r", "Once upon a time", sampling=sampling, structured_output=constraint
    )
    frames = client.close_send().collect()["r"]
    finished = frames[-1]
    assert finished.HasField("finished"), frames[-1]
    return [joined_text(frames, i) for i in range(n)]


def test_every_kind_of_constraint(server):
    for text in _run(server, pb.StructuredOutput(json_schema=json.dumps(SCHEMA))):
        jsonschema.validate(json.loads(text), SCHEMA)
    for text in _run(server, pb.StructuredOutput(regex="[a-z]{2}-[0-9]{3}")):
        assert re.fullmatch("[a-z]{2}-[0-9]{3}", text)
    choices = pb.Choices(choices=["left", "right"])
    assert set(_run(server, pb.StructuredOutput(choice=choices))) <= {"left", "right"}
    for text in _run(server, pb.StructuredOutput(grammar='root ::= "<" [xy]{1,4} ">"')):
        assert re.fullmatch("<[xy]{1,4}>", text)
    compact = pb.StructuredOutput(json_object=True, disable_any_whitespace=True)
    sampling = pb.SamplingParams(max_tokens=200, temperature=0)
    client = BidiClient(server.stub()).start(
        "o", "Hi", sampling=sampling, structured_output=compact
    )
    frames = client.close_send().collect()["o"]
    if frames[-1].finished.finish_reason == pb.FINISH_REASON_STOP:
        assert isinstance(json.loads(joined_text(frames)), dict)
    server.wait_all_blocks_free()


@pytest.mark.parametrize(
    ("constraint", "match"),
    [
        (pb.StructuredOutput(regex="a(b"), "invalid regex"),
        (pb.StructuredOutput(json_schema="{"), "not valid JSON"),
        (pb.StructuredOutput(choice=pb.Choices()), "choice must be a list"),
        (pb.StructuredOutput(disable_any_whitespace=True), "set one of"),
    ],
)
def test_bad_constraint_is_invalid_argument_in_band(server, constraint, match):
    client = BidiClient(server.stub())
    client.start("bad", "Hi", structured_output=constraint)
    client.start("good", "Hi", sampling=pb.SamplingParams(max_tokens=2))
    frames = client.close_send().collect()
    [error] = frames["bad"]
    assert error.HasField("error"), error
    assert error.error.code == 3  # INVALID_ARGUMENT
    assert re.search(match, error.error.message), error.error.message
    assert frames["good"][-1].HasField("finished")
    server.wait_all_blocks_free()


def test_generate_cli_json_schema(server, tmp_path):
    import argparse
    import io

    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    parser = argparse.ArgumentParser()
    add_generate_flags(parser)
    args = parser.parse_args(
        ["Hello", "--server", server.address, "--json-schema", str(schema_file),
         "--max-tokens", "150", "--seed", "2"]
    )  # fmt: skip
    out, err = io.StringIO(), io.StringIO()
    assert run_generate(args, out=out, err=err) == 0, err.getvalue()
    jsonschema.validate(json.loads(out.getvalue()), SCHEMA)
    args = parser.parse_args(["Hello", "--server", server.address, "--json-schema", "/nope"])
    assert run_generate(args, out=out, err=err) == 2
    assert "--json-schema: cannot read /nope" in err.getvalue()


# ---- chat with tools over gRPC (a tiny model with Qwen's template, which renders tools) ----

WEATHER = pb.Tool(
    name="get_weather",
    description="The weather in a city",
    parameters_json=json.dumps(
        {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        }
    ),
)


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    from tool_model import build_tool_model

    from pydaemon.config.engine import EngineConfig
    from pydaemon.engine.llm_engine import LLMEngine

    model_dir = build_tool_model(tmp_path_factory.mktemp("grpc_tools"))
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", num_kv_blocks=256))
    st = make_server_thread(lambda: engine)
    yield st
    st.close()


def _chat(server, messages, tool_choice, n=1, max_tokens=500):
    chat = pb.ChatMessages(messages=messages, tools=[WEATHER], tool_choice=tool_choice)
    sampling = pb.SamplingParams(max_tokens=max_tokens, n=n, seed=1)
    client = BidiClient(server.stub())
    client.send(pb.GenerateRequest(start=pb.StartRequest(request_id="c", messages=chat,
                                                         sampling=sampling)))  # fmt: skip
    return client.close_send().collect()["c"]


def test_grpc_chat_tool_calls_and_a_second_turn(tool_server):
    user = pb.ChatMessage(role="user", content="Weather in Oslo?")
    for choice in ("required", "get_weather"):
        frames = _chat(tool_server, [user], choice, n=2)
        finished = frames[-1].finished
        assert [c.index for c in finished.tool_calls] == [0, 1], frames[-1]
        for seq in finished.tool_calls:
            [call] = seq.calls if choice == "get_weather" else seq.calls[:1]
            assert call.name == "get_weather" and call.id.startswith("call_")
            jsonschema.validate(
                json.loads(call.arguments_json), json.loads(WEATHER.parameters_json)
            )
    call = finished.tool_calls[0].calls[0]
    history = [
        user,
        pb.ChatMessage(role="assistant", tool_calls=[call]),
        pb.ChatMessage(role="tool", tool_call_id=call.id, content='{"temp_c": 21}'),
    ]
    frames = _chat(tool_server, history, "auto", max_tokens=4)
    finished = frames[-1].finished
    # The call and its result are in the prompt; a random model makes no call of its own.
    assert finished.usage.prompt_tokens > 40 and not finished.tool_calls
    tool_server.wait_all_blocks_free()


def test_grpc_bad_tools_are_invalid_argument(tool_server):
    user = pb.ChatMessage(role="user", content="Hi")
    for tool_choice, match in (("nope", "'nope', which is not in tools"),):
        [frame] = _chat(tool_server, [user], tool_choice)
        assert frame.error.code == 3 and re.search(match, frame.error.message), frame
    bad = pb.ChatMessages(messages=[user], tools=[pb.Tool(name="f", parameters_json="{")])
    client = BidiClient(tool_server.stub())
    client.send(pb.GenerateRequest(start=pb.StartRequest(request_id="b", messages=bad)))
    [frame] = client.close_send().collect()["b"]
    assert frame.error.code == 3 and "parameters_json is not JSON" in frame.error.message
