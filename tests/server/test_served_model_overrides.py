"""vLLM's --served-model-name and --chat-template (issue 46), through the official openai
client and gRPC against a real in-process server on the demo model."""

from __future__ import annotations

import argparse

import openai
import pytest
from conftest import make_server_thread, shared_demo_engine
from http_helpers import openai_client

from pydaemon.entrypoints.daemon.settings import add_serve_flags, resolve
from pydaemon.proto.pagedd.v1 import generation_pb2 as pb

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}=>"


@pytest.fixture(scope="module")
def server():
    st = make_server_thread(
        shared_demo_engine, http_port=0, served_model_names=["my-model", "alias"],
        chat_template=TEMPLATE,
    )  # fmt: skip
    yield st
    st.close()


def _resolve(*argv: str):
    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    return resolve(parser.parse_args(list(argv)))


@pytest.mark.parametrize("stream", [False, True])
def test_served_names_and_chat_template(server, stream):
    client = openai_client(server)
    assert [m.id for m in client.models.list().data] == ["my-model", "alias"]
    for name in ("my-model", "alias"):
        r = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
            stream=stream, stream_options={"include_usage": True} if stream else None,
        )  # fmt: skip
        chunks = list(r) if stream else [r]
        assert {c.model for c in chunks} == {"my-model"}
        tok = shared_demo_engine().tokenizer
        assert chunks[-1].usage.prompt_tokens == len(tok.encode("<user> Hi\n=>", add_bos=False))
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="demo", prompt="Hi", max_tokens=1, stream=stream)
    info = server.stub().GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.model_name == "my-model" and info.has_chat_template


def test_settings(tmp_path):
    template_file = tmp_path / "t.jinja"
    template_file.write_text(TEMPLATE)
    _, options, _ = _resolve("--served-model-name", "a", "b", "--chat-template", str(template_file))
    assert options.served_model_names == ["a", "b"] and options.chat_template == TEMPLATE
    _, options, _ = _resolve("--chat-template", TEMPLATE)  # the template itself
    assert options.chat_template == TEMPLATE
    with pytest.raises(ValueError, match="--chat-template: chat template does not parse"):
        _resolve("--chat-template", "{% for m in messages %}")
    with pytest.raises(ValueError, match="--served-model-name"):
        _resolve("--served-model-name", "bad name")


def test_the_engines_own_tokenizer_keeps_its_template(server):
    client = server.server.async_engine
    assert client.tokenizer.chat_template == TEMPLATE
    assert client.engine.tokenizer.chat_template != TEMPLATE  # shared with other servers
