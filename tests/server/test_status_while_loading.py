"""Issue 55 item 19: ``GetServerStatus`` polled while the model loads must not log an error.

While the model loads, the front process is busy (the tokenizer, the engine core's start-up
messages, the start-up heap), and a status poll with a short deadline may be answered
(UNAVAILABLE, "still loading") after its client left. grpc raises ``ExecuteBatchError`` for an
answer sent on a call that is already over; the exception interceptor logged it at ERROR with
a traceback, then tried to abort the dead call again (grpc logged that too). Now it is a
cancelled call, logged at DEBUG.
"""

from __future__ import annotations

import logging
import time

import grpc
import pytest
from server_helpers import ServerThread

from pydaemon.entrypoints.daemon.app import ServerOptions
from pydaemon.proto.pagedd.v1 import generation_pb2 as pb


@pytest.fixture
def loading_server():
    st = ServerThread(ServerOptions(port=0))
    st.listen()  # listening, no engine yet: what a poll sees during the model's load
    yield st
    st.close()


def test_status_polled_during_load_logs_no_error(loading_server, caplog):
    stub = loading_server.stub()
    with pytest.raises(grpc.RpcError) as e:  # the usual answer
        stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "still loading" in e.value.details()

    servicer = loading_server.server.servicer
    require_engine = servicer._require_engine

    async def busy_then_require_engine(context):
        time.sleep(0.3)  # the loop held (by the load) past the poll's deadline
        return await require_engine(context)

    servicer._require_engine = busy_then_require_engine
    caplog.set_level(logging.DEBUG, logger="pydaemon")
    for _ in range(3):
        with pytest.raises(grpc.RpcError) as e:
            stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=0.1)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    time.sleep(0.5)
    loading_server.call(_noop())  # the server has answered the late calls
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not errors, [r.getMessage() for r in errors]
    assert any("the client left" in r.getMessage() for r in caplog.records)  # it did happen

    servicer._require_engine = require_engine
    with pytest.raises(grpc.RpcError) as e:  # and it still answers
        stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


async def _noop() -> None:
    return None
