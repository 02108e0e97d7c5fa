"""Bad requests through raw HTTP: OpenAI's error shape with the right status for each."""

from __future__ import annotations

import http.client
import json
import shutil
import ssl
import subprocess

import pytest
from http_helpers import MODEL, openai_client, post, request, start_http_server

COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def server():
    st = start_http_server()
    yield st
    st.close()


def _error(r, status: int) -> dict:
    assert r.status == status, r.text
    assert r.headers["Content-Type"].startswith("application/json")
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"model": MODEL, "prompt": "hi", "temperature": 101}, "temperature", "[0, 100]"),
        ({"model": MODEL, "prompt": "hi", "top_p": 0}, "top_p", "(0, 1]"),
        ({"model": MODEL, "prompt": "hi", "n": 0}, "n", "n must be"),
        ({"model": MODEL, "prompt": "hi", "presence_penalty": 3}, "presence_penalty", "[-2, 2]"),
        ({"model": MODEL, "prompt": "hi", "logprobs": 21}, "logprobs", "max allowed: 20"),
        ({"model": MODEL, "prompt": "hi", "logprobs": -1}, "logprobs", "of 512 (logprobs -1"),
        ({"model": MODEL, "prompt": "hi", "logprobs": -2}, "logprobs", "positive value or -1"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens", "positive"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 5000}, "max_tokens", "context length"),
        ({"model": MODEL, "prompt": "hi", "min_tokens": 99}, "min_tokens", "[0, max_tokens]"),
        ({"model": MODEL, "prompt": ""}, "prompt", "must be provided and non-empty"),
        ({"model": MODEL, "prompt": []}, "prompt", "The decoder prompt cannot be empty"),
        ({"model": MODEL, "prompt": [[]]}, "prompt", "The decoder prompt cannot be empty"),
        ({"model": MODEL, "prompt": [1, 2, 512]}, "prompt", "Token id 512 is out of vocabulary"),
        ({"model": MODEL, "prompt": "hi", "stop": ["a"] * 17}, "stop", "at most 16"),
        ({"model": MODEL, "prompt": "hi", "stop": [""]}, "stop", "non-empty"),
        (
            {"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}},
            "stream_options",
            "stream: true",
        ),  # fmt: skip
        (
            {"model": MODEL, "prompt": "hi", "logit_bias": {"five": 1.0}},
            "logit_bias",
            "logit_bias contains key(s) that cannot be converted to integer token IDs: ['five']",
        ),
        (
            {"model": MODEL, "prompt": "hi", "logit_bias": {"512": 1.0}},
            "logit_bias",
            "token_id(s) [512] in logit_bias contain out-of-vocab token ids. Vocabulary size: 512",
        ),
        ({"model": MODEL, "prompt": "hi", "temperature": "hot"}, "temperature", "valid number"),
        ({"prompt": "hi"}, "model", "Field required"),
        ({"model": MODEL, "prompt": "hi", "prompt_logprobs": -3}, "prompt_logprobs", "or -1"),
    ],
)
def test_bad_parameter_is_400_naming_it(server, body, param, words):
    error = _error(post(server, COMPLETIONS, body), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert words in error["message"], error


def test_prompt_longer_than_the_context_is_400(server):
    for max_tokens in (None, 1):
        body = {"model": MODEL, "prompt": [7] * 2048, "max_tokens": max_tokens}
        error = _error(post(server, COMPLETIONS, body), 400)
        assert "maximum context length is 2048" in error["message"]
        assert error["param"] == "prompt"


def test_body_that_is_not_json_is_400(server):
    error = _error(post(server, COMPLETIONS, b"{not json"), 400)
    assert "not valid JSON" in error["message"]


def test_unknown_model_is_404(server):
    error = _error(post(server, COMPLETIONS, {"model": "gpt-4", "prompt": "hi"}), 404)
    assert error["code"] == "model_not_found" and "'gpt-4'" in error["message"]
    assert _error(request(server, "GET", "/v1/models/gpt-4"), 404)["code"] == "model_not_found"


def test_unknown_route_and_wrong_method_keep_the_shape(server):
    assert "/v1/embeddings" in _error(post(server, "/v1/embeddings", {}), 404)["message"]
    _error(request(server, "GET", COMPLETIONS), 405)


def test_body_too_large_is_413(server):
    big = b'{"model": "demo", "prompt": "' + b"a" * (17 * 1024 * 1024) + b'"}'
    _error(post(server, COMPLETIONS, big), 413)


def test_api_key_401_and_health_stays_open_metrics_as_metrics_auth_says():
    st = start_http_server(api_key="s3cret")
    try:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
        missing = _error(post(st, COMPLETIONS, body), 401)
        assert missing["code"] == "invalid_api_key" and "Authorization" in missing["message"]
        wrong = _error(post(st, COMPLETIONS, body, {"Authorization": "Bearer nope"}), 401)
        assert wrong["message"] == "invalid api key"
        assert _error(request(st, "GET", "/v1/models"), 401)["code"] == "invalid_api_key"
        assert post(st, COMPLETIONS, body, {"Authorization": "Bearer s3cret"}).status == 200
        assert openai_client(st, api_key="s3cret").models.list().data[0].id == MODEL
        assert request(st, "GET", "/health").status == 200
        assert _error(request(st, "GET", "/metrics"), 401)["code"] == "invalid_api_key"
        assert (
            request(st, "GET", "/metrics", headers={"Authorization": "Bearer s3cret"}).status == 200
        )
    finally:
        st.close()
    st = start_http_server(api_key="s3cret", metrics_auth=False)
    try:
        assert request(st, "GET", "/metrics").status == 200
        assert post(st, COMPLETIONS, {"model": MODEL, "prompt": "hi"}).status == 401
    finally:
        st.close()


def test_full_queue_is_429():
    st = start_http_server(serving=_serving(max_queued_requests=0))
    try:
        error = _error(post(st, COMPLETIONS, {"model": MODEL, "prompt": "hi"}), 429)
        assert error["code"] == "queue_full" and "--max-queued-requests is 0" in error["message"]
    finally:
        st.close()


def test_draining_is_503_and_health_says_so():
    st = start_http_server()
    try:
        assert request(st, "GET", "/health").status == 200
        st.server.http.stop_admitting()  # what drain() does first
        assert _error(request(st, "GET", "/health"), 503)["code"] == "not_serving"
        error = _error(post(st, COMPLETIONS, {"model": MODEL, "prompt": "hi"}), 503)
        assert error["type"] == "service_unavailable"
    finally:
        st.close()


def _serving(**kw):
    from pydaemon.entrypoints.grpc.servicer import ServingOptions

    return ServingOptions(**kw)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make a certificate")
def test_tls_cert_serves_https(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)  # fmt: skip
    st = start_http_server(tls_cert=str(cert), tls_key=str(key))
    try:
        port = st.server.http.port
        context = ssl.create_default_context(cafile=str(cert))
        conn = http.client.HTTPSConnection("localhost", port, timeout=10, context=context)
        conn.request("GET", "/v1/models")
        assert json.loads(conn.getresponse().read())["data"][0]["id"] == MODEL
        conn.close()
        plain = http.client.HTTPConnection("localhost", port, timeout=10)
        with pytest.raises((http.client.HTTPException, ConnectionError)):
            plain.request("GET", "/v1/models")
            plain.getresponse()
        plain.close()
    finally:
        st.close()
