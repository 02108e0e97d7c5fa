"""protos/grpc/health/v1/health.proto (shipped for clients in other languages) describes the
same messages, enum values and methods as the grpc.health.v1 the daemon serves."""

from __future__ import annotations

from pathlib import Path

from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[2]


def _shape(f: descriptor_pb2.FileDescriptorProto) -> tuple:
    messages = {
        m.name: [(x.name, x.number, x.type, x.label) for x in m.field] for m in f.message_type
    }
    enums = {
        e.name: [(v.name, v.number) for v in e.value] for m in f.message_type for e in m.enum_type
    }
    services = {
        s.name: [(x.name, x.input_type, x.output_type, x.server_streaming) for x in s.method]
        for s in f.service
    }
    return f.package, messages, enums, services


def test_shipped_health_proto_matches_the_served_one(tmp_path):
    out = tmp_path / "health.pb"
    args = ["protoc", f"-I{ROOT / 'protos'}", f"--descriptor_set_out={out}"]
    assert protoc.main([*args, "grpc/health/v1/health.proto"]) == 0
    ours = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    served = descriptor_pb2.FileDescriptorProto()
    health_pb2.DESCRIPTOR.CopyToProto(served)
    assert _shape(ours) == _shape(served)
    assert ours.service[0].method[2].server_streaming  # Watch streams
