"""Server reflection under both names: grpc.reflection.v1 (what grpcurl and current clients
ask for first) and v1alpha (older clients). The two protocols are the same messages in
different packages, so one servicer answers both with the same wire bytes."""

from __future__ import annotations

import grpc
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2
from grpc_reflection.v1alpha import reflection_pb2_grpc as v1alpha_grpc
from grpc_reflection.v1alpha._async import ReflectionServicer

V1ALPHA_SERVICE_NAME = "grpc.reflection.v1alpha.ServerReflection"
V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"


def enable_server_reflection(service_names: tuple[str, ...], server: grpc.aio.Server) -> None:
    servicer = ReflectionServicer((*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME))
    v1alpha_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1_handler = grpc.method_handlers_generic_handler(
        V1_SERVICE_NAME,
        {
            "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                servicer.ServerReflectionInfo,
                request_deserializer=v1alpha_pb2.ServerReflectionRequest.FromString,
                response_serializer=v1alpha_pb2.ServerReflectionResponse.SerializeToString,
            )
        },
    )
    server.add_generic_rpc_handlers((v1_handler,))
