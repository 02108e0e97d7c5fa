"""/v1/models and /v1/completions through the official openai client (sync and async, streaming
and not), on a real daemon with the demo model; greedy text checked against the gRPC path."""

from __future__ import annotations

import asyncio

import pytest
from http_helpers import MODEL, async_openai_client, openai_client, start_http_server
from server_helpers import BidiClient, joined_ids, joined_text

from pydaemon.proto.pagedd.v1 import generation_pb2 as pb

PROMPT = "The quick brown fox"
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    st = start_http_server()
    yield st
    st.close()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def _grpc_greedy(server, prompt, max_tokens: int) -> tuple[str, list[int]]:
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    frames = BidiClient(server.stub()).start("g", prompt, sampling=sampling).close_send().collect()
    return joined_text(frames["g"]), joined_ids(frames["g"])


def test_models_list_and_get(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == 2048
    assert client.models.retrieve(MODEL).id == MODEL


def test_greedy_completion_matches_grpc_and_reports_usage(server, client):
    text, ids = _grpc_greedy(server, PROMPT, 8)
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, extra_body=NO_EOS
    )
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    [choice] = r.choices
    assert choice.text == text and choice.finish_reason == "length"
    tokenizer = shared_tokenizer()
    assert r.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert r.usage.completion_tokens == len(ids) == 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_token_id_prompt_and_streaming_equal_non_streaming(server, client):
    prompt = [5, 6, 7, 8, 9]
    text, _ = _grpc_greedy(server, prompt, 6)
    stream = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=NO_EOS,
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == 5
    body = chunks[:-1]
    assert all(c.usage is None for c in body)
    assert "".join(c.choices[0].text for c in body) == text
    assert [c.choices[0].finish_reason for c in body][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in body[:-1])


def test_stream_without_include_usage_has_no_usage_chunk(client):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3,
                                            temperature=0, stream=True, extra_body=NO_EOS))  # fmt: skip
    assert chunks and all(c.choices and c.usage is None for c in chunks)


def test_n2_sampling_with_seed_is_reproducible(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=6, n=2, temperature=1.0, seed=7,
              extra_body=NO_EOS)  # fmt: skip
    first = client.completions.create(**kw)
    again = client.completions.create(**kw)
    assert sorted(c.index for c in first.choices) == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.usage.completion_tokens == 12
    streamed = {0: "", 1: ""}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert [streamed[0], streamed[1]] == [c.text for c in first.choices]


def test_stop_string_cuts_text_and_reports_stop(server, client):
    text, _ = _grpc_greedy(server, PROMPT, 12)
    stop = next(text[i : i + 2] for i in range(2, len(text) - 1) if text[i : i + 2].strip())
    cut = text[: text.index(stop)]
    for stream in (False, True):
        r = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
            stream=stream, extra_body=NO_EOS,
        )  # fmt: skip
        if stream:
            chunks = list(r)
            got = "".join(c.choices[0].text for c in chunks)
            last = chunks[-1].choices[0]
        else:
            got, last = r.choices[0].text, r.choices[0]
        assert got == cut, (stop, text)
        assert last.finish_reason == "stop"
        assert last.model_extra["stop_reason"] == stop


def test_logprobs_name_every_token(client):
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3, extra_body=NO_EOS
    )
    choice = r.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0.0
        assert 3 <= len(top) <= 4  # the top 3, plus the chosen token when it is not among them
        assert max(top.values()) == pytest.approx(logprob)  # greedy: the chosen one is the best
        assert top[token] == pytest.approx(logprob)
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3, stream=True,
        extra_body=NO_EOS,
    )  # fmt: skip
    tokens = [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == lp.tokens


def test_batched_prompts_give_one_choice_each(server, client):
    a, _ = _grpc_greedy(server, "Hello world", 4)
    b, _ = _grpc_greedy(server, [7, 8, 9], 4)
    r = client.completions.create(
        model=MODEL, prompt=["Hello world", "Once upon"], max_tokens=4, temperature=0,
        extra_body=NO_EOS,
    )  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].text == a
    r = client.completions.create(
        model=MODEL, prompt=[[7, 8, 9], [7, 8, 9]], max_tokens=4, temperature=0, n=2,
        extra_body=NO_EOS,
    )  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert {c.text for c in r.choices} == {b}
    assert r.usage.prompt_tokens == 6 and r.usage.completion_tokens == 16


def test_echo_prepends_the_prompt(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                  echo=True, extra_body=NO_EOS)  # fmt: skip
    assert r.choices[0].text.startswith(PROMPT) and len(r.choices[0].text) > len(PROMPT)


def test_vllm_extras_min_tokens_and_penalties_are_accepted(client):
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0.8, top_p=0.9,
        presence_penalty=0.5, frequency_penalty=0.5, user="tester",
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2, "min_tokens": 5},
    )  # fmt: skip
    assert r.usage.completion_tokens == 5  # min_tokens = max_tokens: EOS cannot end it early


def test_async_client_concurrent_streaming_and_not(server):
    async def main():
        client = async_openai_client(server)
        kw = dict(model=MODEL, max_tokens=5, temperature=0, extra_body=NO_EOS)

        async def streamed(prompt):
            text = ""
            async for chunk in await client.completions.create(prompt=prompt, stream=True, **kw):
                text += chunk.choices[0].text
            return text

        async def whole(prompt):
            return (await client.completions.create(prompt=prompt, **kw)).choices[0].text

        prompts = ["Hello world", "Once upon a time", "The library was"]
        results = await asyncio.gather(*(streamed(p) for p in prompts),
                                       *(whole(p) for p in prompts))  # fmt: skip
        await client.close()
        return results

    results = asyncio.run(main())
    assert results[:3] == results[3:]
    assert len(set(results[:3])) == 3  # different prompts, different continuations


def shared_tokenizer():
    from conftest import shared_demo_engine

    return shared_demo_engine().tokenizer


def test_generation_config_defaults_fill_unset_fields(monkeypatch):
    from conftest import shared_demo_engine

    from pydaemon.config.generation import GenerationDefaults

    monkeypatch.setattr(shared_demo_engine(), "generation_defaults", GenerationDefaults(0.0))
    st = start_http_server()  # reads the model's defaults when it starts
    try:
        client = openai_client(st)
        kw = dict(model=MODEL, prompt=PROMPT, max_tokens=8, extra_body=NO_EOS)
        greedy = client.completions.create(temperature=0, **kw).choices[0].text
        assert client.completions.create(**kw).choices[0].text == greedy  # the default: greedy
        sampled = {client.completions.create(temperature=1.0, seed=s, **kw).choices[0].text
                   for s in range(3)}  # fmt: skip
        assert sampled != {greedy}  # the request's own temperature wins
    finally:
        st.close()


def test_cache_salt_separates_prefix_cache_hits(client):
    prompt = [7 + i for i in range(48)]  # three full blocks of 16 tokens

    def cached(salt: str | None) -> int:
        extra = {**NO_EOS, **({"cache_salt": salt} if salt is not None else {})}
        r = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=2, temperature=0, extra_body=extra
        )
        return r.usage.prompt_tokens_details.cached_tokens

    cached("salt-a")  # fills the cache under salt-a
    assert cached("salt-a") >= 32
    assert cached("salt-b") == 0
    assert cached(None) == 0  # an unsalted request never reuses salted blocks


def test_cache_salt_too_long_is_a_400(server):
    from http_helpers import post

    r = post(server, "/v1/completions",
             {"model": MODEL, "prompt": "x", "max_tokens": 1, "cache_salt": "s" * 300})  # fmt: skip
    assert r.status == 400, r.text
    assert "cache_salt" in r.text
