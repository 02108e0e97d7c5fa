"""vLLM's /tokenize, /detokenize and /version (issue 46) on the demo model: text and chat
tokenization as generation tokenizes them, detokenization, the API key, the version."""

from __future__ import annotations

import pytest
from conftest import make_server_thread, shared_demo_engine
from http_helpers import MODEL, openai_client, post, request

from pydaemon import __version__

MESSAGES = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def server():
    st = make_server_thread(shared_demo_engine, http_port=0)
    yield st
    st.close()


def test_tokenize_text_and_chat_as_generation_does(server):
    tok = shared_demo_engine().tokenizer
    r = post(server, "/tokenize", {"model": MODEL, "prompt": "Once upon a time"})
    assert r.status == 200, r.text
    body = r.json()
    ids = tok.encode("Once upon a time", add_bos=True)
    assert body == {"count": len(ids), "max_model_len": 2048, "tokens": ids, "token_strs": None}
    completion = openai_client(server).completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=1
    )
    assert completion.usage.prompt_tokens == body["count"]
    r = post(server, "/tokenize", {"prompt": "Once", "return_token_strs": True,
                                   "add_special_tokens": False})  # fmt: skip
    assert r.json()["token_strs"] == [tok.id_to_piece(t) for t in tok.encode("Once", False)]
    r = post(server, "/tokenize", {"model": MODEL, "messages": MESSAGES})
    chat = openai_client(server).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=1
    )
    assert r.json()["count"] == chat.usage.prompt_tokens
    assert r.json()["tokens"] == tok.encode("User: Hello\nAssistant:", add_bos=False)
    # add_special_tokens: what the tokenizer's own encoding adds (the demo's adds BOS)
    r = post(server, "/tokenize", {"messages": MESSAGES, "add_special_tokens": True})
    assert r.json()["tokens"] == tok.encode("User: Hello\nAssistant:", add_bos=True)


def test_a_chat_gets_bos_only_where_the_tokenizer_adds_one():
    """Issue 55, 24: SmolLM2's BOS is <|im_start|> and its encoding adds none; a chat with
    add_special_tokens got a second <|im_start|> in front."""
    from pydaemon.entrypoints.openai.tokenize_routes import with_special_tokens

    class Tok:
        bos_token_id = 1

        def __init__(self, adds_bos: bool) -> None:
            self.adds_bos = adds_bos

        def encode(self, text: str, add_bos: bool = True) -> list[int]:
            return [1] if add_bos and self.adds_bos else []

    assert with_special_tokens(Tok(adds_bos=False), [1, 5, 6]) == [1, 5, 6]
    assert with_special_tokens(Tok(adds_bos=True), [5, 6]) == [1, 5, 6]


def test_detokenize(server):
    tok = shared_demo_engine().tokenizer
    ids = tok.encode("Once upon a time", add_bos=False)
    r = post(server, "/detokenize", {"model": MODEL, "tokens": ids})
    assert r.status == 200 and r.json() == {"prompt": tok.decode(ids)}
    r = post(server, "/detokenize", {"tokens": [5, 10**6]})
    assert (
        r.status == 400 and "Token id 1000000 is out of vocabulary" in r.json()["error"]["message"]
    )
    r = post(server, "/detokenize", {"model": "gpt-4", "tokens": [5]})
    assert r.status == 404


def test_version_is_open_and_tokenize_needs_the_key():
    st = make_server_thread(shared_demo_engine, http_port=0, api_key="k")
    try:
        r = request(st, "GET", "/version")
        assert r.status == 200 and r.json() == {"version": __version__}
        assert post(st, "/tokenize", {"prompt": "hi"}).status == 401
        assert post(st, "/detokenize", {"tokens": [1]}).status == 401
        ok = post(st, "/tokenize", {"prompt": "hi"}, {"Authorization": "Bearer k"})
        assert ok.status == 200
    finally:
        st.close()
