"""What vLLM's OpenAI server accepts and clients rely on (issue 46), through the official
openai client against a real in-process server on the demo model, streamed and not."""

from __future__ import annotations

import logging

import openai
import pytest
from conftest import make_server_thread, shared_demo_engine
from http_helpers import MODEL, openai_client

MESSAGES = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def server():
    st = make_server_thread(shared_demo_engine, http_port=0)
    yield st
    st.close()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.mark.parametrize("stream", [False, True])
def test_unknown_top_level_fields_are_ignored_with_a_warning(client, caplog, stream):
    """vLLM answers and logs them; pagedd answered 400."""
    caplog.set_level(logging.DEBUG, logger="pydaemon.entrypoints.openai.ignored_fields")
    name = f"a_newer_openai_field_{int(stream)}"
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=2, stream=stream,
        extra_body={name: {"x": 1}}, stream_options={"include_usage": True, name: 1} if stream else None,
    )  # fmt: skip
    chunks = list(r) if stream else [r]
    assert chunks[-1].usage.completion_tokens >= 1
    r = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=2, stream=stream, extra_body={name: 1}
    )
    assert list(r) if stream else r.choices
    ignored = [rec for rec in caplog.records if "present in the request but ignored" in rec.message]
    assert ignored and name in ignored[0].message
    assert ignored[0].levelno == logging.WARNING  # the first time a name is seen


@pytest.mark.parametrize("stream", [False, True])
def test_int64_seeds_negative_ones_too(client, stream):
    """vLLM takes any int64 seed (pagedd refused negative ones); the same seed gives the same
    output, different seeds different streams; out of int64 is a 400 naming seed."""

    def text(seed: int) -> str:
        r = client.completions.create(
            model=MODEL, prompt="Once", max_tokens=8, temperature=1.0, seed=seed, stream=stream,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return "".join(c.choices[0].text for c in r) if stream else r.choices[0].text

    assert text(-5) == text(-5) and text(-(2**63)) == text(-(2**63))
    assert len({text(-5), text(5), text(2**63 - 1), text(-(2**63))}) > 1
    with pytest.raises(openai.BadRequestError) as e:
        text(2**63)
    assert e.value.body["param"] == "seed"


@pytest.mark.parametrize("stream", [False, True])
def test_vllm_messages_for_empty_prompts_and_out_of_vocabulary_ids(server, client, stream):
    cases = [
        ("", "Either prompt or prompt_embeds must be provided and non-empty."),
        ([], "The decoder prompt cannot be empty"),
        ([1, 2, 10**6], "Token id 1000000 is out of vocabulary"),
    ]
    for prompt, message in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, stream=stream)
        assert e.value.body["message"].startswith(message), e.value.body
        assert e.value.body["param"] == "prompt"
    from server_helpers import BidiClient

    grpc_client = BidiClient(server.stub())
    grpc_client.start("oov", [5, 10**6])
    grpc_client.start("empty", [])
    frames = grpc_client.close_send().collect()
    assert frames["oov"][0].error.message.startswith("Token id 1000000 is out of vocabulary")
    assert frames["empty"][0].error.message.startswith("The decoder prompt cannot be empty")
