"""Operations (issue 32, finding 8): no open port beyond loopback without a key unless asked;
the metrics port speaks TLS with the daemon's certificate; a malformed HTTP request logs no
traceback; the systemd unit carries the extra hardening directives."""

from __future__ import annotations

import argparse
import logging
import shutil
import socket
import ssl
import subprocess
import time
from pathlib import Path

import pytest
from fake_engine import FakeEngine

from pydaemon.entrypoints.daemon.settings import add_serve_flags, resolve

ROOT = Path(__file__).resolve().parents[2]


def _resolve(*argv: str):
    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    return resolve(parser.parse_args(list(argv)))


@pytest.mark.parametrize(
    "argv",
    [
        ("--host", "0.0.0.0"),
        ("--http-port", "8000", "--http-host", "::"),
        ("--metrics-port", "9400", "--metrics-host", "10.0.0.5"),
        ("--host", "gpu-box.example"),
    ],
)
def test_non_loopback_bind_without_a_key_is_refused(argv, monkeypatch):
    monkeypatch.delenv("PAGEDD_API_KEY", raising=False)
    with pytest.raises(ValueError, match="without an API key"):
        _resolve(*argv)
    _resolve(*argv, "--allow-unauthenticated")
    _resolve(*argv, "--api-key", "k")
    _resolve("--host", "::1", "--http-port", "8000", "--http-host", "localhost")


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make a certificate")
def test_metrics_port_speaks_tls(start_server, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost"],
                   check=True, capture_output=True)  # fmt: skip
    engine = FakeEngine(num_gpu_blocks=64)
    st = start_server(
        lambda: engine, metrics_port=0, api_key="k", tls_cert=str(cert), tls_key=str(key)
    )
    context = ssl.create_default_context(cafile=str(cert))
    context.check_hostname = False
    port = st.server.metrics_server.port
    with socket.create_connection(("127.0.0.1", port)) as raw:
        with context.wrap_socket(raw, server_hostname="localhost") as sock:
            sock.sendall(b"GET /metrics HTTP/1.1\r\nAuthorization: Bearer k\r\n\r\n")
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
    assert reply.startswith(b"HTTP/1.1 200") and b"pagedd_kv_blocks_total" in reply


def test_malformed_http_request_logs_no_traceback(start_server, caplog):
    engine = FakeEngine(num_gpu_blocks=64)
    st = start_server(lambda: engine, http_port=0)
    caplog.set_level(logging.DEBUG)
    for garbage in (b"GARBAGE\r\n\r\n", b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", st.server.http.port)) as sock:
            sock.sendall(garbage)
            assert b" 400 " in sock.recv(65536).split(b"\r\n")[0]
    time.sleep(0.2)
    noisy = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not noisy, [r.getMessage() for r in noisy]


def test_systemd_units_have_the_extra_hardening():
    for unit in (ROOT / "deploy" / "systemd").glob("*.service"):
        text = unit.read_text()
        for directive in (
            "SystemCallFilter=@system-service",
            "ProtectProc=invisible",
            "UMask=0077",
        ):
            assert f"\n{directive}" in text, (unit.name, directive)
