"""The metrics endpoint: no thread per connection, idle connections timed out, optional auth,
and counters that start at zero when serving starts (the warm-up is not counted)."""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request

import pytest


def _get(st, headers: dict | None = None) -> tuple[int, str]:
    url = f"http://127.0.0.1:{st.server.metrics_server.port}/metrics"
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, headers=headers or {}), timeout=10
        ) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_idle_connections_take_no_thread_and_are_closed(start_server):
    st = start_server(metrics_port=0)
    st.server.metrics_server.header_timeout_s = 0.5
    threads_before = threading.active_count()
    port = st.server.metrics_server.port
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(50)]
    try:
        time.sleep(0.2)
        assert threading.active_count() - threads_before < 5
        status, _ = _get(st)  # still answers while 50 sockets sit idle
        assert status == 200
        for s in idle:  # each idle connection is closed by the server after the timeout
            assert s.recv(1) == b""
    finally:
        for s in idle:
            s.close()


def test_head_too_large_or_malformed_is_dropped_or_refused(start_server):
    st = start_server(metrics_port=0)
    port = st.server.metrics_server.port
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"garbage\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 400")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\n" + b"X: " + b"y" * 20000)
        assert s.recv(100) == b""
    assert _get(st)[0] == 200


@pytest.mark.parametrize("metrics_auth", [True, False])
def test_metrics_auth_reuses_the_api_key(start_server, metrics_auth):
    st = start_server(metrics_port=0, api_key="sekrit", metrics_auth=metrics_auth)
    status, body = _get(st)
    if metrics_auth:
        assert status == 401 and "Bearer" in body
        assert _get(st, {"Authorization": "Bearer wrong"})[0] == 401
    else:
        assert status == 200
    status, body = _get(st, {"Authorization": "Bearer sekrit"})
    assert status == 200 and "pagedd_kv_blocks_total" in body


def test_warmup_is_not_counted(demo_server):
    st = demo_server(metrics_port=0)
    _, body = _get(st)
    samples = dict(line.rsplit(" ", 1) for line in body.splitlines() if not line.startswith("#"))
    assert st.stats().num_generation_tokens > 0  # the engine did run the warm-up
    assert float(samples["pagedd_generation_tokens_total"]) == 0
    assert float(samples["pagedd_prompt_tokens_total"]) == 0
