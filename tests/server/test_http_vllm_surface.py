"""What vLLM's OpenAI server accepts and clients rely on (issue 46), through the official
openai client against a real in-process server on the demo model, streamed and not."""

from __future__ import annotations

import logging

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
