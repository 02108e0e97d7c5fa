"""vLLM's --root-path (issue 55, item 23): the HTTP API answers under the prefix a proxy serves
it at, and without it; the API key guards every path but the open ones, under the prefix too
(the auth is an allow-list: a prefixed /v1 path must not slip past it)."""

from __future__ import annotations

import pytest
from http_helpers import post, request

from pydaemon.entrypoints.daemon.app import ServerOptions

KEY = {"Authorization": "Bearer k"}


def test_routes_answer_under_the_root_path_and_the_key_guards_them(start_server):
    st = start_server(http_port=0, api_key="k", root_path="/llm")
    for path in ("/v1/models", "/llm/v1/models"):
        assert request(st, "GET", path).status == 401, path
        r = request(st, "GET", path, headers=KEY)
        assert r.status == 200 and r.json()["data"], (path, r.text)
    body = {"model": "fake", "prompt": "Hi", "max_tokens": 2}
    assert post(st, "/llm/v1/completions", body).status == 401
    r = post(st, "/llm/v1/completions", body, KEY)
    assert r.status == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    assert post(st, "/llm/tokenize", {"prompt": "hi"}).status == 401
    for path in ("/health", "/llm/health", "/version", "/llm/version"):
        assert request(st, "GET", path).status == 200, path
    assert request(st, "GET", "/llm/metrics").status == 401
    assert request(st, "GET", "/other/v1/models", headers=KEY).status == 404


@pytest.mark.parametrize("bad", ["llm", "/llm/", "/", "/a b", "/../x"])
def test_a_bad_root_path_is_refused_naming_the_flag(bad):
    with pytest.raises(ValueError, match="--root-path"):
        ServerOptions(root_path=bad)
