"""Connections to the gRPC port that never send the HTTP/2 preface (issue 46: held ~60 s, and
1,100 of them under `ulimit -n 1024` stopped gRPC, HTTP and /health): closed after the
handshake timeout, and never more than --max-grpc-connections held."""

from __future__ import annotations

import socket
import time

from conftest import make_server_thread


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(64) == b""  # a settings frame first would mean it is being served
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def _wait(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_silent_connections_are_closed_and_capped():
    st = make_server_thread(handshake_timeout_s=1.0, max_grpc_connections=4)
    socks = []
    try:
        host, port = st.address.rsplit(":", 1)
        socks = [socket.create_connection((host, int(port))) for _ in range(8)]
        for sock in socks:
            sock.setblocking(False)
        # beyond the cap: closed at once; the others once the handshake timeout passes
        assert _wait(lambda: sum(_closed(s) for s in socks) >= 4, 5.0)
        assert _wait(lambda: all(_closed(s) for s in socks), 20.0)
        from pydaemon.proto.pagedd.v1 import generation_pb2 as pb

        assert st.stub().GetModelInfo(pb.GetModelInfoRequest(), timeout=10).model_name
    finally:
        for sock in socks:
            sock.close()
        st.close()
