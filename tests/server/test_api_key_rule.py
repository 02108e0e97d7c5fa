"""The API key's rule (issue 46): ``--api-key ' '`` was taken as a key for a public bind, and
then ``Bearer`` with two spaces was accepted. A key is printable ASCII without spaces; the
header must be exactly ``Bearer <key>`` on the gRPC, HTTP and metrics ports."""

from __future__ import annotations

import argparse
import urllib.error
import urllib.request

import grpc
import pytest
from conftest import make_server_thread
from http_helpers import post

from pydaemon.entrypoints.daemon.settings import add_serve_flags, resolve
from pydaemon.proto.pagedd.v1 import generation_pb2 as pb
from pydaemon.proto.pagedd.v1 import generation_pb2_grpc as pb_grpc


def _resolve(*argv: str):
    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    return resolve(parser.parse_args(list(argv)))


@pytest.mark.parametrize("key", [" ", "  ", "a key", "k\t", "ключ"])
def test_a_key_with_spaces_or_of_whitespace_is_refused(key, monkeypatch):
    monkeypatch.delenv("PAGEDD_API_KEY", raising=False)
    with pytest.raises(ValueError, match="printable ASCII without spaces"):
        _resolve("--api-key", key, "--host", "0.0.0.0")
    monkeypatch.setenv("PAGEDD_API_KEY", key)
    with pytest.raises(ValueError, match="printable ASCII without spaces"):
        _resolve("--host", "0.0.0.0")


def test_an_empty_key_is_refused_not_taken_as_no_key(monkeypatch, tmp_path):
    """Issue 55, 13: ``--api-key ''`` started the daemon with no auth; it is refused like an
    empty key file (and so is a set but empty $PAGEDD_API_KEY), on a loopback bind too."""
    monkeypatch.delenv("PAGEDD_API_KEY", raising=False)
    with pytest.raises(ValueError, match="--api-key is empty"):
        _resolve("--api-key", "")
    config = tmp_path / "pagedd.toml"
    config.write_text('api_key = ""\n')
    with pytest.raises(ValueError, match="--api-key is empty"):
        _resolve("--config", str(config))
    empty_file = tmp_path / "key"
    empty_file.write_text("\n")
    with pytest.raises(ValueError, match="the first line is empty"):
        _resolve("--api-key-file", str(empty_file))
    monkeypatch.setenv("PAGEDD_API_KEY", "")
    with pytest.raises(ValueError, match=r"\$PAGEDD_API_KEY is set but empty"):
        _resolve()
    monkeypatch.delenv("PAGEDD_API_KEY")
    assert _resolve()[1].api_key is None  # no key given at all: serves without one (loopback)


def test_bearer_with_extra_spaces_is_refused_everywhere():
    st = make_server_thread(http_port=0, metrics_port=0, api_key="s3cret")
    try:
        with grpc.insecure_channel(st.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            for header, ok in (("Bearer s3cret", True), ("Bearer  s3cret", False),
                               ("Bearer s3cret ", False), ("bearer s3cret", False)):  # fmt: skip
                call = lambda h=header: stub.GetModelInfo(  # noqa: E731
                    pb.GetModelInfoRequest(), metadata=(("authorization", h),), timeout=10
                )
                if ok:
                    call()
                    continue
                with pytest.raises(grpc.RpcError) as e:
                    call()
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, header
        body = {"model": "fake", "prompt": [5], "max_tokens": 1}
        assert post(st, "/v1/completions", body, {"Authorization": "Bearer s3cret"}).status == 200
        assert post(st, "/v1/completions", body, {"Authorization": "Bearer  s3cret"}).status == 401
        url = f"http://127.0.0.1:{st.server.metrics_server.port}/metrics"
        request = urllib.request.Request(url, headers={"Authorization": "Bearer  s3cret"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(request, timeout=5)
        assert e.value.code == 401
    finally:
        st.close()
