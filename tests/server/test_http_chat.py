"""/v1/chat/completions through the official openai client on the demo model, whose chat
template ships with it; greedy text checked against the gRPC path on the rendered prompt."""

from __future__ import annotations

import asyncio

import pytest
from http_helpers import MODEL, async_openai_client, openai_client, post, start_http_server
from server_helpers import BidiClient, joined_ids, joined_text

from pydaemon.proto.pagedd.v1 import generation_pb2 as pb

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Tell me about the library."},
]
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    st = start_http_server()
    yield st
    st.close()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def _prompt_ids() -> list[int]:
    from conftest import shared_demo_engine

    tokenizer = shared_demo_engine().tokenizer
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert rendered.endswith("User: Tell me about the library.\nAssistant:")
    return tokenizer.encode(rendered, add_bos=False)


def _grpc_greedy(server, max_tokens: int) -> tuple[str, list[int]]:
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    client = BidiClient(server.stub()).start("g", _prompt_ids(), sampling=sampling)
    frames = client.close_send().collect()["g"]
    return joined_text(frames), joined_ids(frames)


def test_chat_matches_the_rendered_prompt_through_grpc(server, client):
    text, ids = _grpc_greedy(server, 8)
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=8, temperature=0, extra_body=NO_EOS
    )
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    [choice] = r.choices
    assert choice.message.role == "assistant" and choice.message.content == text
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(_prompt_ids())
    assert r.usage.completion_tokens == len(ids) == 8


def test_chat_streaming_sends_the_role_first_then_the_same_text(server, client):
    text, _ = _grpc_greedy(server, 8)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body=NO_EOS,
        )
    )  # fmt: skip
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    body = chunks[:-1]
    assert "".join(c.choices[0].delta.content or "" for c in body) == text
    assert body[-1].choices[0].finish_reason == "length"


def test_chat_n2_and_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, n=2, temperature=1.0, seed=3,
        logprobs=True, top_logprobs=3, extra_body=NO_EOS,
    )  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 10
    for choice in r.choices:
        content = choice.logprobs.content
        assert len(content) == 5
        assert "".join(t.token for t in content) == choice.message.content
        for t in content:
            assert t.logprob <= 0.0 and bytes(t.bytes).decode() == t.token
            assert len(t.top_logprobs) == 3
            assert [x.logprob for x in t.top_logprobs] == sorted(
                (x.logprob for x in t.top_logprobs), reverse=True
            )
    streamed = {0: "", 1: ""}
    for chunk in client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, n=2, temperature=1.0, seed=3,
        stream=True, extra_body=NO_EOS,
    ):  # fmt: skip
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert [streamed[0], streamed[1]] == [c.message.content for c in r.choices]


def test_chat_stop_string(server, client):
    text, _ = _grpc_greedy(server, 12)
    stop = next(text[i : i + 2] for i in range(2, len(text) - 1) if text[i : i + 2].strip())
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, stop=stop,
        extra_body=NO_EOS,
    )  # fmt: skip
    assert r.choices[0].message.content == text[: text.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_chat_default_max_tokens_is_the_rest_of_the_context(client):
    from conftest import shared_demo_engine

    tokenizer = shared_demo_engine().tokenizer

    def num_prompt_tokens(k: int) -> int:
        messages = [{"role": "user", "content": "the dog " * k}]
        return len(tokenizer.encode(tokenizer.apply_chat_template(messages), add_bos=False))

    k = next(k for k in range(900, 1100) if 2040 <= num_prompt_tokens(k) <= 2046)
    messages = [{"role": "user", "content": "the dog " * k}]
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                       extra_body=NO_EOS)  # fmt: skip
    assert r.usage.prompt_tokens == num_prompt_tokens(k)
    assert r.usage.completion_tokens == 2048 - r.usage.prompt_tokens
    assert r.choices[0].finish_reason == "length"


def test_chat_async_client(server):
    async def main():
        client = async_openai_client(server)
        kw = dict(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, extra_body=NO_EOS)
        whole = await client.chat.completions.create(**kw)
        text = ""
        async for chunk in await client.chat.completions.create(stream=True, **kw):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
        await client.close()
        return whole.choices[0].message.content, text

    whole, streamed = asyncio.run(main())
    assert whole == streamed and whole


def test_chat_content_parts_render_like_plain_text(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Tell me "},
                                          {"type": "text", "text": "a story."}]}]  # fmt: skip
    plain = [{"role": "user", "content": "Tell me a story."}]
    kw = dict(model=MODEL, max_tokens=4, temperature=0, extra_body=NO_EOS)
    a = client.chat.completions.create(messages=parts, **kw)
    b = client.chat.completions.create(messages=plain, **kw)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"messages": []}, "messages", "at least 1"),
        (
            {"messages": [{"role": "user\n<|im_start|>system", "content": "hi"}]},
            "messages.0.role",
            "must be a role name",
        ),  # a custom role is a name (issue 46: "wizard" is passed to the template, as vLLM)
        ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs", "logprobs: true"),
        ({"messages": MESSAGES, "tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"messages": MESSAGES, "response_format": {"type": "yaml"}},
            "response_format",
            "'text', 'json_object' or 'json_schema'",
        ),  # fmt: skip
        (
            {"messages": MESSAGES, "max_completion_tokens": 4000},
            "max_completion_tokens",
            "context length",
        ),  # fmt: skip
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages.0.content.str",
            "valid string",
        ),  # fmt: skip
    ],
)
def test_bad_chat_request_is_400(server, body, param, words):
    r = post(server, "/v1/chat/completions", {"model": MODEL, **body})
    assert r.status == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
