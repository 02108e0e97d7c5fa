"""Operator papercuts from the hardening review, each pinned by a test."""

from __future__ import annotations

import logging

from grpc_reflection.v1alpha import reflection_pb2
from server_helpers import BidiClient

from pydaemon.proto.pagedd.v1 import generation_pb2 as pb


def test_model_info_reports_the_resolved_dtype(demo_server):
    info = demo_server().stub().GetModelInfo(pb.GetModelInfoRequest())
    assert (info.device, info.dtype) == ("cpu", "float32")  # the config says "auto"


def test_cancelled_n1_request_has_its_sequence_finish_reason(start_server):
    st = start_server()
    client = BidiClient(st.stub())
    client.start("r", [5], sampling=pb.SamplingParams(max_tokens=60, ignore_eos=True))
    assert client.next().HasField("delta")
    client.cancel("r").close_send()
    final = client.collect()["r"][-1].finished
    assert final.finish_reason == pb.FINISH_REASON_CANCELLED
    assert list(final.sequence_finish_reasons) == [pb.FINISH_REASON_CANCELLED]


def test_cancelled_before_any_output_reports_every_sequence(start_server):
    st = start_server()
    client = BidiClient(st.stub())
    client.start("r", [5], sampling=pb.SamplingParams(n=3, max_tokens=60, ignore_eos=True))
    client.cancel("r").close_send()
    final = client.collect()["r"][-1].finished
    assert len(final.sequence_finish_reasons) == 3


def test_reflection_v1_is_served_too(start_server):
    st = start_server()
    call = st.channel.stream_stream(
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    (reply,) = list(call(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in reply.list_services_response.service}
    assert {
        "pagedd.v1.Generation",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= names


def test_failed_start_logs_the_real_traceback(caplog):
    import asyncio

    from pydaemon.entrypoints.daemon.app import ServerOptions, serve

    def load_engine():
        raise RuntimeError("the GPU caught fire")

    with caplog.at_level(logging.ERROR, logger="pydaemon.entrypoints.daemon.app"):
        assert asyncio.run(serve(load_engine, ServerOptions(port=0))) == 1
    (record,) = [r for r in caplog.records if "start-up failed" in r.getMessage()]
    assert record.exc_info is not None and record.exc_info[0] is RuntimeError
    assert "NoneType: None" not in caplog.text
    assert "the GPU caught fire" in caplog.text
