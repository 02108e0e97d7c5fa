"""A real daemon (gRPC + the OpenAI HTTP API) on free local ports, and clients for it."""

from __future__ import annotations

import http.client
import json
import urllib.request
from dataclasses import dataclass

import openai
from conftest import make_server_thread, shared_demo_engine
from server_helpers import ServerThread

MODEL = "demo"


def start_http_server(**options) -> ServerThread:
    """A started server on the shared demo engine, with the HTTP API on a free port."""
    return make_server_thread(shared_demo_engine, http_port=0, **options)


def base_url(st: ServerThread) -> str:
    return f"http://127.0.0.1:{st.server.http.port}"


def openai_client(st: ServerThread, api_key: str = "unused", **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url(st) + "/v1", api_key=api_key, max_retries=0, **kw)


def async_openai_client(st: ServerThread, api_key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url(st) + "/v1", api_key=api_key, max_retries=0)


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    text: str

    def json(self):
        return json.loads(self.text)


def request(st: ServerThread, method: str, path: str, body=None,
            headers: dict | None = None) -> RawResponse:  # fmt: skip
    """Raw HTTP: ``body`` as JSON (a dict) or as bytes sent unchanged."""
    conn = http.client.HTTPConnection("127.0.0.1", st.server.http.port, timeout=30)
    try:
        content = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        conn.request(method, path, body=content,
                     headers={"Content-Type": "application/json", **(headers or {})})  # fmt: skip
        r = conn.getresponse()
        return RawResponse(r.status, dict(r.getheaders()), r.read().decode())
    finally:
        conn.close()


def post(st: ServerThread, path: str, body, headers: dict | None = None) -> RawResponse:
    return request(st, "POST", path, body, headers)


def sse_payloads(text: str) -> list[str]:
    """The ``data:`` payloads of a whole SSE body, in order."""
    return [line[len("data: ") :] for line in text.split("\n") if line.startswith("data: ")]


def scrape_metrics(st: ServerThread) -> tuple[dict[str, float], str]:
    """The metrics port's samples ({name{labels}: value}) and its whole text."""
    url = f"http://127.0.0.1:{st.server.metrics_server.port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples, text
