"""Engine-side failures through HTTP, on the fake engine: a request the engine refuses is a
400 (nothing streamed yet; the other prompts of a batch are aborted), a dying engine ends a
stream with an error event and a non-streaming request with 503."""

from __future__ import annotations

import json

from fake_engine import FakeEngine
from http_helpers import post, request, sse_payloads

BODY = {"model": "fake", "max_tokens": 8}


def _start(start_server, engine: FakeEngine):
    return start_server(lambda: engine, http_port=0)


def _finished_total(st) -> int:
    lines = request(st, "GET", "/metrics").text.splitlines()
    return sum(int(x.split()[-1]) for x in lines if x.startswith("pagedd_requests_finished_total{"))


def test_a_prompt_the_engine_refuses_is_400_and_frees_the_batch(start_server):
    engine = FakeEngine(num_gpu_blocks=8, max_model_len=2048, step_delay_s=0.01)
    st = _start(start_server, engine)
    # (A batch that streams could already have sent the first prompt's tokens.)
    for prompt, stream in (([[1, 2], [1] * 200], False), ([1] * 200, True)):
        r = post(st, "/v1/completions", {**BODY, "prompt": prompt, "stream": stream})
        assert r.status == 400, r.text
        assert r.json()["error"]["message"] == "prompt does not fit in the whole KV cache"
    assert st.wait_all_blocks_free().num_free_gpu_blocks == 8
    assert _finished_total(st) == 0  # errors are not finished requests
    ok = post(st, "/v1/completions", {**BODY, "prompt": [1, 2, 3]})
    assert ok.status == 200 and ok.json()["usage"]["completion_tokens"] == 8
    assert _finished_total(st) == 1


def test_engine_death_mid_stream_is_an_error_event_then_503(start_server):
    engine = FakeEngine(num_gpu_blocks=64, max_model_len=2048, step_delay_s=0.01, fail_on_step=4)
    st = _start(start_server, engine)
    r = post(st, "/v1/completions", {**BODY, "prompt": [1, 2, 3], "max_tokens": 50, "stream": True})
    assert r.status == 200
    payloads = sse_payloads(r.text)
    assert payloads[-1] == "[DONE]"
    error = json.loads(payloads[-2])["error"]
    assert error["type"] == "service_unavailable" and "engine failed" in error["message"]
    assert any(json.loads(p).get("choices") for p in payloads[:-2])  # tokens came first
    r = post(st, "/v1/completions", {**BODY, "prompt": [1, 2, 3]})
    assert r.status == 503, r.text
    assert request(st, "GET", "/health").status == 503
