"""Every way an HTTP request ends early frees all of its KV blocks at once; the drain answers
requests past the grace period with finish_reason "abort"; /metrics counts HTTP requests."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time

import pytest
from http_helpers import MODEL, request, sse_payloads, start_http_server

LONG = {"model": MODEL, "prompt": [3, 4, 5], "max_tokens": 1000, "ignore_eos": True}


@pytest.fixture
def server():
    st = start_http_server()
    yield st
    st.close()


def _open_stream(st, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", st.server.http.port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json"})  # fmt: skip
    response = conn.getresponse()
    assert response.status == 200
    assert response.getheader("Content-Type") == "text/event-stream"
    return conn, response


def _first_event(response: http.client.HTTPResponse) -> dict:
    while True:
        line = response.readline().decode()
        if line.startswith("data: "):
            return json.loads(line[len("data: ") :])


def _finished_count(st, reason: str) -> int:
    text = request(st, "GET", "/metrics").text
    for line in text.splitlines():
        if line.startswith(f'pagedd_requests_finished_total{{finish_reason="{reason}"}}'):
            return int(line.split()[-1])
    return 0


def test_client_disconnect_mid_stream_frees_every_block(server):
    total = server.stats().num_gpu_blocks
    conns = [_open_stream(server, LONG) for _ in range(2)]
    for _, response in conns:
        assert _first_event(response)["choices"][0]["index"] == 0
    assert server.stats().num_free_gpu_blocks < total
    cancelled_before = _finished_count(server, "cancelled")
    for conn, _ in conns:
        conn.sock.close()  # the client goes away without a word
        conn.close()
    stats = server.wait_all_blocks_free()
    assert stats.num_free_gpu_blocks == total
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert server.server.http.num_live_requests == 0
    assert _finished_count(server, "cancelled") == cancelled_before + 2


def test_client_timeout_on_a_non_streaming_request_frees_every_block(server):
    total = server.stats().num_gpu_blocks
    conn = http.client.HTTPConnection("127.0.0.1", server.server.http.port, timeout=0.5)
    conn.request("POST", "/v1/completions", body=json.dumps(LONG),
                 headers={"Content-Type": "application/json"})  # fmt: skip
    with pytest.raises(TimeoutError):
        conn.getresponse()
    conn.close()
    assert server.wait_all_blocks_free().num_free_gpu_blocks == total
    assert server.stats().num_running == 0


def test_drain_lets_a_stream_finish_within_the_grace_period(server):
    conn, response = _open_stream(server, {**LONG, "max_tokens": 30})
    _first_event(response)
    drain = threading.Thread(target=server.drain)
    drain.start()
    rest = response.read().decode()
    drain.join(30)
    payloads = sse_payloads(rest)
    assert payloads[-1] == "[DONE]"
    assert json.loads(payloads[-2])["choices"][0]["finish_reason"] == "length"
    conn.close()


def test_drain_past_the_grace_period_answers_abort(start_server):
    from conftest import shared_demo_engine

    st = start_server(shared_demo_engine, http_port=0, grace_period_s=0.3)
    total = st.stats().num_gpu_blocks
    conn, response = _open_stream(st, LONG)
    _first_event(response)
    whole = {}

    def non_streaming():
        whole["r"] = request(st, "POST", "/v1/completions", LONG)

    waiter = threading.Thread(target=non_streaming)
    waiter.start()
    time.sleep(0.3)
    assert st.server.http.num_live_requests == 2
    before = st.stats()
    assert before.num_free_gpu_blocks < total
    t0 = time.monotonic()
    st.drain()
    assert time.monotonic() - t0 < 10
    payloads = sse_payloads(response.read().decode())
    assert payloads[-1] == "[DONE]"
    assert json.loads(payloads[-2])["choices"][0]["finish_reason"] == "abort"
    waiter.join(10)
    body = whole["r"].json()
    assert whole["r"].status == 200 and body["choices"][0]["finish_reason"] == "abort"
    assert 0 < body["usage"]["completion_tokens"] < 1000
    conn.close()


def test_a_client_that_stops_reading_is_dropped_after_the_stall_timeout(start_server, monkeypatch):
    from aiohttp import web
    from conftest import shared_demo_engine

    from pydaemon.entrypoints.grpc.servicer import ServingOptions

    # A client that stops reading, as the server sees it: after the first two chunks, writes
    # to the event stream never complete (the socket buffers are full).
    real_write = web.StreamResponse.write
    num_writes = {"n": 0}

    async def write(self, data):
        if self.content_type == "text/event-stream":
            num_writes["n"] += 1
            if num_writes["n"] > 2:
                await asyncio.Event().wait()
        return await real_write(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", write)
    st = start_server(shared_demo_engine, http_port=0, serving=ServingOptions(stall_timeout_s=0.3))
    total = st.stats().num_gpu_blocks
    before = st.stats().num_generation_tokens
    conn, response = _open_stream(st, LONG)
    assert _first_event(response)["choices"][0]["index"] == 0
    deadline = time.monotonic() + 30
    while st.server.http.num_live_requests and time.monotonic() < deadline:
        time.sleep(0.05)
    assert st.server.http.num_live_requests == 0
    assert st.wait_all_blocks_free().num_free_gpu_blocks == total
    assert st.stats().num_generation_tokens - before < 1000  # cut short
    assert _finished_count(st, "cancelled") == 1
    with pytest.raises((http.client.HTTPException, ConnectionError)):
        response.read()  # the server closed the connection mid-stream
    conn.close()
