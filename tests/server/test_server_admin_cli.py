"""`pagedd info | status | health` against a real in-process server."""

from __future__ import annotations

import io
import json
import socket
import threading

from pydaemon.entrypoints.cli import build_parser
from pydaemon.entrypoints.grpc.admin import run_admin


def _run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = run_admin(build_parser().parse_args(list(argv)), out, err)
    return code, out.getvalue(), err.getvalue()


def test_info_status_health(start_server):
    st = start_server(api_key="k")
    code, out, _ = _run("info", "--server", st.address, "--api-key", "k", "--json")
    info = json.loads(out)
    assert code == 0 and info["model_name"] == "fake" and info["max_model_len"] == 64
    code, out, _ = _run("status", "--server", st.address, "--api-key", "k")
    assert code == 0
    lines = dict(line.split(None, 1) for line in out.splitlines())
    assert lines["is_serving"] == "True" and lines["num_gpu_blocks"] == "256"
    code, out, _ = _run("health", "--server", st.address)  # health needs no key
    assert code == 0 and "SERVING" in out
    code, _, err = _run("info", "--server", st.address)  # no key
    assert code == 1 and "UNAUTHENTICATED" in err
    st.drain()
    code, out, _ = _run("health", "--server", st.address, "--timeout", "2")
    assert code == 1 and "SERVING" not in out.replace("NOT_SERVING", "")


def test_unreachable_server_exits_1():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, out, err = _run("status", "--server", f"127.0.0.1:{port}", "--timeout", "2")
    assert code == 1 and "UNAVAILABLE" in err
    code, out, _ = _run("health", "--server", f"127.0.0.1:{port}", "--timeout", "1", "--json")
    assert code == 1 and json.loads(out)["status"].startswith("UNAVAILABLE")


def test_health_wait_until_serving():
    from fake_engine import FakeEngine
    from server_helpers import ServerThread

    from pydaemon.entrypoints.daemon.app import ServerOptions

    st = ServerThread(ServerOptions(port=0))
    try:
        st.listen()
        code, out, _ = _run("health", "--server", st.address, "--timeout", "2")
        assert code == 1 and "NOT_SERVING" in out  # listening, model not loaded yet
        timer = threading.Timer(1.0, st.start_async, args=(FakeEngine,))
        timer.start()
        code, out, _ = _run("health", "--server", st.address, "--wait", "30")
        timer.join()
        assert code == 0 and "SERVING" in out
    finally:
        st.close()


def test_info_prints_float32_fields_without_noise():
    """Issue 46: `pagedd info` printed generation defaults as 0.20000000298023224."""
    from pydaemon.entrypoints.grpc.admin import _plain_fields
    from pydaemon.proto.pagedd.v1 import generation_pb2 as pb

    reply = pb.ModelInfo(
        model_name="m", generation_defaults=pb.GenerationDefaults(temperature=0.2, top_p=0.95)
    )
    fields = _plain_fields(reply)
    assert fields["generation_defaults"] == {"temperature": 0.2, "top_p": 0.95}
    assert json.dumps(fields["generation_defaults"]) == '{"temperature": 0.2, "top_p": 0.95}'
