"""A constraint's errors name the field the client sent (issue 46: a bad ``response_format``
answered ``structured_outputs.json: ...`` with ``param: null``); ``/v1/completions`` takes
``response_format`` (vLLM does); ``response_format`` gives way to a forced tool call (vLLM's
rule). Official openai client, streamed and not; gRPC names StartRequest's fields."""

from __future__ import annotations

import json

import openai
import pytest
from conftest import make_server_thread, shared_demo_engine
from http_helpers import MODEL, openai_client
from server_helpers import BidiClient

from pydaemon.proto.pagedd.v1 import generation_pb2 as pb

MESSAGES = [{"role": "user", "content": "Pick."}]
BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}
CHOICE = {"type": "string", "enum": ["yes", "no"]}


@pytest.fixture(scope="module")
def server():
    st = make_server_thread(shared_demo_engine, http_port=0)
    yield st
    st.close()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_a_bad_response_format_names_response_format(server, endpoint, stream):
    client = openai_client(server)
    with pytest.raises(openai.BadRequestError) as e:
        if endpoint == "chat":
            client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=4, stream=stream,
                response_format=BAD_SCHEMA,
            )  # fmt: skip
        else:
            client.completions.create(
                model=MODEL, prompt="Pick.", max_tokens=4, stream=stream,
                extra_body={"response_format": BAD_SCHEMA},
            )  # fmt: skip
    error = e.value.body
    assert error["param"] == "response_format", error
    assert error["message"].startswith("response_format.json_schema.schema: "), error
    assert "structured_outputs" not in error["message"]
    server.wait_all_blocks_free()


def test_vllm_structured_outputs_errors_name_structured_outputs(server):
    with pytest.raises(openai.BadRequestError) as e:
        openai_client(server).completions.create(
            model=MODEL, prompt="Pick.", max_tokens=4,
            extra_body={"structured_outputs": {"regex": "a(b"}},
        )  # fmt: skip
    assert e.value.body["param"] == "structured_outputs"
    assert e.value.body["message"].startswith("structured_outputs.regex: invalid regex")


@pytest.mark.parametrize("stream", [False, True])
def test_completions_take_response_format(server, stream):
    response_format = {"type": "json_schema", "json_schema": {"name": "c", "schema": CHOICE}}
    r = openai_client(server).completions.create(
        model=MODEL, prompt="Pick.", max_tokens=8, stream=stream, seed=1,
        extra_body={"response_format": response_format},
    )  # fmt: skip
    if stream:
        chunks = list(r)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        text, finish = r.choices[0].text, r.choices[0].finish_reason
    assert finish == "stop" and json.loads(text) in ("yes", "no"), text


def test_completions_refuse_two_constraints(server):
    with pytest.raises(openai.BadRequestError) as e:
        openai_client(server).completions.create(
            model=MODEL, prompt="Pick.", max_tokens=4,
            extra_body={"response_format": {"type": "json_object"},
                        "structured_outputs": {"regex": "a"}},
        )  # fmt: skip
    assert e.value.body["param"] == "response_format"


def test_grpc_names_structured_output_fields(server):
    client = BidiClient(server.stub())
    client.start("r", "Hi", structured_output=pb.StructuredOutput(regex="a(b"))
    client.start("j", "Hi", structured_output=pb.StructuredOutput(json_schema='{"type": "objec"}'))
    frames = client.close_send().collect()
    assert frames["r"][0].error.message.startswith("structured_output.regex: invalid regex")
    assert frames["j"][0].error.message.startswith("structured_output.json_schema: ")


@pytest.mark.parametrize("stream", [False, True])
def test_an_unenforced_schema_keyword_is_a_400_naming_it(server, stream):
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    with pytest.raises(openai.BadRequestError) as e:
        openai_client(server).chat.completions.create(
            model="demo", messages=MESSAGES, max_tokens=4, stream=stream,
            response_format={"type": "json_schema", "json_schema": {"name": "u", "schema": schema}},
        )  # fmt: skip
    assert e.value.body["param"] == "response_format"
    assert "'uniqueItems' (at #)" in e.value.body["message"]
    assert e.value.body["message"].startswith("response_format.json_schema.schema:")


SELF_REF = {"$defs": {"A": {"allOf": [{"$ref": "#/$defs/A"}]}}, "$ref": "#/$defs/A"}


@pytest.mark.parametrize("stream", [False, True])
def test_unsatisfiable_constraints_are_a_400(server, stream):
    """Issue 46: `root ::= root` and a schema that only refers to itself answered "" with
    finish "stop"; their grammars accept no text, which is known once compiled."""
    client = openai_client(server)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="demo", prompt="Hi", max_tokens=4, stream=stream,
                                  extra_body={"structured_outputs": {"grammar": "root ::= root"}})  # fmt: skip
    assert e.value.body["param"] == "structured_outputs"
    assert "can never be satisfied" in e.value.body["message"]
    response_format = {"type": "json_schema", "json_schema": {"name": "s", "schema": SELF_REF}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=4,
                                       stream=stream, response_format=response_format)  # fmt: skip
    assert e.value.body["param"] == "response_format"
    assert "can never be satisfied" in e.value.body["message"]
    server.wait_all_blocks_free()


def test_a_grammar_bomb_is_a_400_before_compiling(server):
    rules = "\n".join(f'r{i} ::= [a-z]* | ""' for i in range(10_000))
    grammar = "root ::= " + " ".join(f"r{i}" for i in range(10_000)) + "\n" + rules
    with pytest.raises(openai.BadRequestError) as e:
        openai_client(server).completions.create(
            model="demo", prompt="Hi", max_tokens=4,
            extra_body={"structured_outputs": {"grammar": grammar}},
        )  # fmt: skip
    assert e.value.body["param"] == "structured_outputs"
    assert "above the limit" in e.value.body["message"]
