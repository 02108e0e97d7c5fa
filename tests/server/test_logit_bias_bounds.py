"""logit_bias bounds (issue 55, items 7 and 13): a million keys are refused by their number
before the body is parsed (gRPC: before the map is copied), without stalling the event loop
that every other stream runs on; a key is a token id in canonical decimal, nothing int() would
also read."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from fake_engine import FakeEngine
from http_helpers import post
from server_helpers import BidiClient

from pydaemon.proto.pagedd.v1 import generation_pb2 as pb
from pydaemon.sampling_params import MAX_LOGIT_BIAS_TOKENS

NUM_KEYS = 1_000_000  # ~14 MB of JSON, as in the issue
# Before: the body was parsed (~1.5 s) and its keys converted (~0.5 s) on the event loop. Now
# it is refused by a scan of the raw bytes (~10 ms); the largest gap left is reading the body.
MAX_LOOP_GAP_S = 0.5


class LoopGapProbe:
    """The longest the server's event loop went without running a 5 ms timer, while on."""

    def __init__(self, st) -> None:
        self.is_on = True
        self.longest_s = 0.0
        self._future = asyncio.run_coroutine_threadsafe(self._run(), st.loop)

    async def _run(self) -> None:
        while self.is_on:
            t0 = time.monotonic()
            await asyncio.sleep(0.005)
            self.longest_s = max(self.longest_s, time.monotonic() - t0)

    def stop(self) -> float:
        self.is_on = False
        self._future.result(5)
        return self.longest_s


def _huge_body() -> bytes:
    entries = b", ".join(b'"%d": 1.0' % i for i in range(NUM_KEYS))
    return b'{"model": "fake", "prompt": "hi", "max_tokens": 2, "logit_bias": {' + entries + b"}}"


def _error(r) -> dict:
    assert r.status == 400, r.text
    return r.json()["error"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_million_key_logit_bias_is_refused_before_parsing(start_server, path):
    st = start_server(http_port=0)
    body = _huge_body()
    if path.endswith("chat/completions"):
        body = body.replace(b'"prompt": "hi"', b'"messages": [{"role": "user", "content": "hi"}]')
    probe = LoopGapProbe(st)
    t0 = time.monotonic()
    error = _error(post(st, path, body))
    elapsed_s = time.monotonic() - t0
    longest_gap_s = probe.stop()
    assert longest_gap_s < MAX_LOOP_GAP_S, (longest_gap_s, elapsed_s)
    assert error["param"] == "logit_bias"
    assert f"more than {MAX_LOGIT_BIAS_TOKENS} entries" in error["message"]


def test_a_logit_bias_the_scan_cannot_see_is_refused_by_the_field_bound(start_server):
    """A \\u escape in the key's name hides it from the raw scan; the parsed field's own bound
    still refuses it (at the cost of parsing, which any body of that size has)."""
    st = start_server(http_port=0)
    entries = ", ".join(f'"{i}": 1.0' for i in range(MAX_LOGIT_BIAS_TOKENS + 1))
    body = '{"model": "fake", "prompt": "hi", "logit\\u005fbias": {' + entries + "}}"
    error = _error(post(st, "/v1/completions", body.encode()))
    assert error["param"] == "logit_bias"
    assert str(MAX_LOGIT_BIAS_TOKENS) in error["message"]


def test_the_bound_itself_is_accepted(start_server):
    engine = FakeEngine()
    engine.vocab_size = 2 * MAX_LOGIT_BIAS_TOKENS
    st = start_server(lambda: engine, http_port=0)
    bias = {str(i): 0.5 for i in range(MAX_LOGIT_BIAS_TOKENS)}
    body = {"model": "fake", "prompt": "hi", "max_tokens": 2, "logit_bias": bias}
    r = post(st, "/v1/completions", body)
    assert r.status == 200, r.text


def test_grpc_logit_bias_map_is_refused_by_its_size(start_server):
    st = start_server()
    sampling = pb.SamplingParams(max_tokens=2)
    sampling.logit_bias.update(dict.fromkeys(range(NUM_KEYS), 1.0))
    client = BidiClient(st.stub())
    probe = LoopGapProbe(st)
    client.start("big", [3], sampling=sampling)
    [frame] = client.close_send().collect()["big"]
    longest_gap_s = probe.stop()
    assert longest_gap_s < MAX_LOOP_GAP_S
    assert frame.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "sampling.logit_bias" in frame.error.message
    assert f"at most {MAX_LOGIT_BIAS_TOKENS}" in frame.error.message


@pytest.mark.parametrize("key", [" 5", "5 ", "+5", "05", "\u0665", "-1", "5.0", "1e3"])
def test_logit_bias_keys_are_canonical_token_ids(start_server, key):
    """Issue 55, 13: int() reads " 5", "+5", "05" and the Arabic-Indic digit five as 5 (and
    "05" collided with "5"); only digits with no sign, space or leading zero are token ids."""
    st = start_server(http_port=0)
    body = {"model": "fake", "prompt": "hi", "max_tokens": 2, "logit_bias": {"5": 1, key: 1}}
    error = _error(post(st, "/v1/completions", body))
    assert error["param"] == "logit_bias"
    assert "cannot be converted to integer token IDs" in error["message"]
    assert repr(key) in error["message"]
    ok = {"model": "fake", "prompt": "hi", "max_tokens": 2, "logit_bias": {"0": 1, "5": 1}}
    assert post(st, "/v1/completions", ok).status == 200
