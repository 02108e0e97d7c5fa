"""What a newcomer tripped on (issue 32, finding 9): a port in use is one clear line (no
traceback, no "draining"); `pagedd info | head` ends quietly; Tokenize says whether it added a
BOS (many models add none, which looked like add_bos being ignored)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from fake_engine import FakeEngine

from pydaemon.proto.pagedd.v1 import generation_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def test_port_in_use_is_one_clear_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [sys.executable, str(Path(__file__).parent / "fake_daemon.py"), str(port), "5"]
        out = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "the port is in use" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "draining" not in out.stderr, out.stderr


def test_info_into_a_closed_pipe_ends_quietly(start_server):
    engine = FakeEngine(num_gpu_blocks=64)
    st = start_server(lambda: engine)
    cmd = [sys.executable, "-m", "pydaemon", "info", "--server", st.address]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # `| head` that has read enough: every write now fails with EPIPE
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()
    assert b"BrokenPipeError" not in err, err.decode()


def test_tokenize_says_whether_it_added_a_bos(start_server):
    engine = FakeEngine(num_gpu_blocks=64)
    st = start_server(lambda: engine)
    stub = st.stub()
    reply = stub.Tokenize(pb.TokenizeRequest(text="hi", add_bos=True))
    assert reply.added_bos and reply.token_ids[0] == engine.tokenizer.bos_token_id
    assert not stub.Tokenize(pb.TokenizeRequest(text="hi")).added_bos
    engine.tokenizer.encode = lambda text, add_bos=True: [5, 6]  # a model that adds no BOS
    assert not stub.Tokenize(pb.TokenizeRequest(text="hi", add_bos=True)).added_bos
