"""Issue 55 item 14: the test process kept what every server left behind. Each ServerThread's
event loop had a default executor (the engine's load, chat rendering) whose worker threads
outlived the server: 128 idle threads after tests/server. A closed server leaves none."""

from __future__ import annotations

import threading

from conftest import make_server_thread
from server_helpers import BidiClient

from pydaemon.proto.pagedd.v1 import generation_pb2 as pb


def _executor_threads() -> int:
    return sum(
        1
        for t in threading.enumerate()
        if getattr(getattr(t, "_target", None), "__module__", "") == "concurrent.futures.thread"
    )


def test_a_closed_server_leaves_no_executor_threads():
    before = _executor_threads()
    for _ in range(3):
        st = make_server_thread(http_port=0)  # the load ran on the loop's executor
        chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Hi")])
        start = pb.StartRequest(
            request_id="a", messages=chat, sampling=pb.SamplingParams(max_tokens=2)
        )
        BidiClient(st.stub()).send(pb.GenerateRequest(start=start)).close_send().collect()
        assert _executor_threads() > before  # rendered the chat off the loop
        st.close()
    assert _executor_threads() == before
