"""vLLM's POST /v1/chat/completions/batch (issue 55, item 23) on the demo model: several
conversations in one request, one choice per conversation, each the same as its own
/v1/chat/completions call, token for token; bad batches are 400s naming the field."""

from __future__ import annotations

import pytest
from http_helpers import MODEL, post, request, start_http_server

from pydaemon.entrypoints.openai.chat_batch import MAX_CONVERSATIONS

PATH = "/v1/chat/completions/batch"
CONVERSATIONS = [
    [{"role": "user", "content": "Tell me about the library."}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the dog doing in the garden today?"},
    ],
    [
        {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": "Hi there."},
        {"role": "user", "content": "Say more."},
    ],
]
SHARED = {
    "model": MODEL,
    "max_completion_tokens": 6,
    "temperature": 0,
    "ignore_eos": True,
    "logprobs": True,
    "top_logprobs": 2,
    "return_token_ids": True,
}


@pytest.fixture(scope="module")
def server():
    st = start_http_server()
    yield st
    st.close()


def test_each_choice_is_its_conversations_own_chat_completion(server):
    r = post(server, PATH, {**SHARED, "messages": CONVERSATIONS})
    assert r.status == 200, r.text
    batch = r.json()
    assert batch["object"] == "chat.completion" and batch["id"].startswith("chatcmpl-")
    assert batch["model"] == MODEL and "prompt_token_ids" not in batch
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2]
    prompt_tokens = completion_tokens = 0
    for messages, choice in zip(CONVERSATIONS, batch["choices"], strict=True):
        single = post(server, "/v1/chat/completions", {**SHARED, "messages": messages})
        assert single.status == 200, single.text
        one = single.json()
        [expected] = one["choices"]
        assert choice["token_ids"] == expected["token_ids"] and len(choice["token_ids"]) == 6
        assert choice["message"] == expected["message"]
        # the same tokens and alternatives; the values to float error (a step that batches
        # three sequences sums in another order than a step of one)
        pairs = zip(choice["logprobs"]["content"], expected["logprobs"]["content"], strict=True)
        for got, want in pairs:
            assert got["token"] == want["token"]
            assert got["logprob"] == pytest.approx(want["logprob"], abs=1e-4)
            assert [t["token"] for t in got["top_logprobs"]] == [
                t["token"] for t in want["top_logprobs"]
            ]
        assert choice["finish_reason"] == expected["finish_reason"] == "length"
        prompt_tokens += one["usage"]["prompt_tokens"]
        completion_tokens += one["usage"]["completion_tokens"]
    # the conversations differ, so do their answers (a batch is not one prompt three times)
    assert len({tuple(c["token_ids"]) for c in batch["choices"]}) > 1
    assert batch["usage"]["prompt_tokens"] == prompt_tokens
    assert batch["usage"]["completion_tokens"] == completion_tokens == 18
    assert batch["usage"]["total_tokens"] == prompt_tokens + completion_tokens


def test_without_return_token_ids_the_choices_carry_no_ids(server):
    body = {"model": MODEL, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    r = post(server, PATH, {**body, "messages": CONVERSATIONS[:2]})
    assert r.status == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 2 and all("token_ids" not in c for c in choices)
    assert all(c["message"]["role"] == "assistant" and c["message"]["content"] for c in choices)


TOO_MANY = [CONVERSATIONS[0]] * (MAX_CONVERSATIONS + 1)
BAD = [
    ({"messages": []}, "messages", "no conversation"),
    ({"messages": CONVERSATIONS[0]}, "messages", "list of conversations"),
    ({"messages": TOO_MANY}, "messages", f"at most {MAX_CONVERSATIONS}"),
    ({"messages": [CONVERSATIONS[0], []]}, "messages.1", "at least 1"),
    ({"messages": [CONVERSATIONS[0], [{"role": 5}]]}, "messages.1.0.role", "string"),
    ({"messages": [CONVERSATIONS[0], "hi"]}, "messages.1", "array"),
    ({"stream": True}, "stream", "not streamed"),
    ({"n": 2}, "n", "n > 1"),
    ({"use_beam_search": True}, "use_beam_search", "beam search"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tools"),
    ({"prompt_logprobs": 1}, "prompt_logprobs", "prompt_logprobs"),
    ({"temperature": -1.0}, "temperature", "temperature"),
    ({"max_tokens": 5000}, "max_tokens", "maximum context length"),
    (
        {"messages": [CONVERSATIONS[0], [{"role": "user", "content": "dog " * 3000}]]},
        "messages.1",
        "no room for output",
    ),
]


@pytest.mark.parametrize(("fields", "param", "words"), BAD, ids=[b[1] for b in BAD])
def test_a_bad_batch_is_a_400_naming_the_field_and_the_daemon_goes_on(server, fields, param, words):
    body = {"model": MODEL, "max_tokens": 2, "messages": CONVERSATIONS, **fields}
    r = post(server, PATH, body)
    assert r.status == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert not server.server.http.num_live_requests  # nothing reached the engine
    ok = post(server, PATH, {"model": MODEL, "max_tokens": 2, "messages": CONVERSATIONS[:1]})
    assert ok.status == 200 and ok.json()["usage"]["completion_tokens"] <= 2, ok.text


def test_an_unknown_model_is_a_404_naming_it(server):
    r = post(server, PATH, {"model": "nope", "messages": CONVERSATIONS})
    assert r.status == 404 and r.json()["error"]["param"] == "model", r.text


def test_the_api_key_guards_it_under_the_root_path_too():
    st = start_http_server(api_key="k", root_path="/llm")
    try:
        body = {"model": MODEL, "max_tokens": 2, "messages": CONVERSATIONS[:2]}
        for path in (PATH, "/llm" + PATH):
            assert post(st, path, body).status == 401, path
            r = post(st, path, body, {"Authorization": "Bearer k"})
            assert r.status == 200 and len(r.json()["choices"]) == 2, (path, r.text)
        assert request(st, "GET", PATH, headers={"Authorization": "Bearer k"}).status == 405
    finally:
        st.close()


def test_the_conversations_run_in_the_engine_together(server, monkeypatch):
    """Every conversation's engine request starts before any of them ends: one batch, not one
    call after another."""
    engine = server.server.http.serving.engine
    events: list[tuple[str, str]] = []
    generate = engine.generate

    async def recording(request):
        events.append(("start", request.request_id))
        async for output in generate(request):
            yield output
        events.append(("end", request.request_id))

    monkeypatch.setattr(engine, "generate", recording)
    body = {"model": MODEL, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    r = post(server, PATH, {**body, "messages": CONVERSATIONS})
    assert r.status == 200, r.text
    kinds = [kind for kind, _ in events]
    assert kinds == ["start"] * 3 + ["end"] * 3, events
    assert len({rid for _, rid in events}) == 3
