"""vLLM's logprob_token_ids (issue 55): the logprobs of exactly the listed token ids at each
position, in place of the top-k alternatives (pagedd ignored the field before). Checked against
the top-k the same greedy request gets, on the demo model through the openai client and gRPC."""

from __future__ import annotations

import openai
import pytest
from conftest import make_server_thread, shared_demo_engine
from http_helpers import MODEL, openai_client
from server_helpers import BidiClient

from pydaemon.proto.pagedd.v1 import generation_pb2 as pb
from pydaemon.sampling_params import SamplingParams

MESSAGES = [{"role": "user", "content": "Hello"}]
AS_IDS = {"return_tokens_as_token_ids": True}


@pytest.fixture(scope="module")
def server():
    st = make_server_thread(shared_demo_engine, http_port=0)
    yield st
    st.close()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def _ids(names) -> list[int]:
    return [int(name.removeprefix("token_id:")) for name in names]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_lists_exactly_the_asked_ids_with_their_logprobs(client, stream):
    def content(**kw):
        r = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0, logprobs=True,
            stream=stream, extra_body={**AS_IDS, "ignore_eos": True, **kw.pop("extra", {})}, **kw,
        )  # fmt: skip
        if not stream:
            return r.choices[0].logprobs.content
        return [e for c in r if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]  # fmt: skip

    top = content(top_logprobs=20)
    ranked = [_ids(t.token for t in e.top_logprobs) for e in top]
    # the 2nd and 5th most likely at the first position, and one outside the top 20
    outside = next(t for t in range(1000) if all(t not in r for r in ranked))
    asked = [ranked[0][4], outside, ranked[0][1]]
    got = content(extra={"logprob_token_ids": asked})
    assert [e.token for e in got] == [e.token for e in top]  # the same greedy tokens
    for position, (mine, reference) in enumerate(zip(got, top, strict=True)):
        assert _ids(t.token for t in mine.top_logprobs) == asked  # in the asked order
        values = {_ids([t.token])[0]: t.logprob for t in reference.top_logprobs}
        floor = min(values.values())
        for t in mine.top_logprobs:
            token_id = _ids([t.token])[0]
            if token_id in values:
                assert t.logprob == pytest.approx(values[token_id], abs=1e-5)
            else:
                assert t.logprob <= floor + 1e-6  # not among the top 20
        if position == 0:
            assert mine.top_logprobs[0].logprob == pytest.approx(values[asked[0]], abs=1e-5)


def test_completions_take_the_ids_in_place_of_the_top_k(client):
    asked = [7, 300, 11]
    r = client.completions.create(
        model=MODEL, prompt="Once", max_tokens=2, temperature=0, logprobs=1,
        extra_body={**AS_IDS, "logprob_token_ids": asked, "ignore_eos": True},
    )  # fmt: skip
    lp = r.choices[0].logprobs
    for token, top in zip(lp.tokens, lp.top_logprobs, strict=True):
        assert set(_ids(top)) == set(asked) | set(_ids([token]))  # the ids and the chosen one


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"logprob_token_ids": [1, 2]}, "needs logprobs"),
        ({"logprobs": True, "logprob_token_ids": [10**7]}, "outside the vocabulary"),
        ({"logprobs": True, "logprob_token_ids": [3, 3]}, "none twice"),
        ({"logprobs": True, "logprob_token_ids": []}, "at least one"),
        ({"logprobs": True, "logprob_token_ids": list(range(129))}, "128"),
    ],
)
def test_bad_asks_are_a_400_naming_the_field(client, kw, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=1,
            logprobs=kw.pop("logprobs", openai.NOT_GIVEN), extra_body=kw,
        )  # fmt: skip
    assert e.value.body["param"] == "logprob_token_ids"
    assert words in e.value.body["message"]


def test_sampling_params_rules():
    assert SamplingParams(logprob_token_ids=[4, 2]).logprobs == 2
    with pytest.raises(ValueError, match="logprobs must equal the number of logprob_token_ids"):
        SamplingParams(logprobs=5, logprob_token_ids=[4, 2])
    with pytest.raises(ValueError, match="must not repeat"):
        SamplingParams(logprob_token_ids=[4, 4])


def test_grpc_takes_the_ids_and_refuses_bad_ones(server):
    asked = [7, 300, 11]
    greedy = dict(max_tokens=3, temperature=0, ignore_eos=True)
    frames = (
        BidiClient(server.stub())
        .start("top", "Once", sampling=pb.SamplingParams(logprobs=20, **greedy))
        .start("ids", "Once", sampling=pb.SamplingParams(logprob_token_ids=asked, **greedy))
        .start("outside", "Once", sampling=pb.SamplingParams(logprob_token_ids=[10**7], **greedy))
        .start("twice", "Once", sampling=pb.SamplingParams(logprob_token_ids=[3, 3], **greedy))
        .close_send()
        .collect()
    )

    def entries(request_id):
        return [lp for f in frames[request_id] if f.HasField("delta") for lp in f.delta.logprobs]

    top, mine = entries("top"), entries("ids")
    assert [e.token_id for e in mine] == [e.token_id for e in top]  # the same greedy tokens
    for m, t in zip(mine, top, strict=True):
        # top_logprobs: the asked ids and the chosen token, most likely first (gRPC's order)
        assert {c.token_id for c in m.top_logprobs} == set(asked) | {m.token_id}
        assert [c.logprob for c in m.top_logprobs] == sorted(
            (c.logprob for c in m.top_logprobs), reverse=True
        )
        values = {c.token_id: c.logprob for c in t.top_logprobs}
        for c in m.top_logprobs:
            if c.token_id in values:
                assert c.logprob == pytest.approx(values[c.token_id], abs=1e-5)
    for request_id, words in (("outside", "outside the vocabulary"), ("twice", "must not repeat")):
        error = frames[request_id][0].error
        assert error.code == 3 and "logprob_token_ids" in error.message  # INVALID_ARGUMENT
        assert words in error.message
    server.wait_all_blocks_free()
