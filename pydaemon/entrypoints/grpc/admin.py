"""`pagedd info | status | health`: what an operator asks a running daemon, without grpcurl.

Exit codes: 0 when the daemon answered (health: and is SERVING), 1 when it answered otherwise
or could not be reached, so the commands fit shell scripts and probes.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pydaemon.entrypoints.grpc.client import add_connection_flags, auth_metadata, open_channel
from pydaemon.entrypoints.grpc.health import SERVICE_NAME
from pydaemon.proto.pagedd.v1 import generation_pb2 as pb
from pydaemon.proto.pagedd.v1 import generation_pb2_grpc as pb_grpc


def add_admin_parsers(sub) -> None:
    info = sub.add_parser("info", help="the served model (GetModelInfo)")
    status = sub.add_parser("status", help="load, KV blocks and counters (GetServerStatus)")
    health = sub.add_parser("health", help="grpc.health.v1 status; exit 0 when SERVING")
    for parser in (info, status, health):
        add_connection_flags(parser)
        parser.add_argument("--timeout", type=float, default=10.0, help="gRPC deadline (s)")
        parser.add_argument("--json", action="store_true", help="print JSON")
    health.add_argument(
        "--wait", type=float, default=0.0, metavar="S", help="poll up to S seconds for SERVING"
    )


def run_admin(args: argparse.Namespace, out=sys.stdout, err=sys.stderr) -> int:
    with open_channel(args) as channel:
        try:
            if args.command == "health":
                return _health(args, channel, out)
            stub = pb_grpc.GenerationStub(channel)
            if args.command == "info":
                reply = stub.GetModelInfo(
                    pb.GetModelInfoRequest(), timeout=args.timeout, metadata=auth_metadata(args)
                )
            else:
                reply = stub.GetServerStatus(
                    pb.GetServerStatusRequest(), timeout=args.timeout, metadata=auth_metadata(args)
                )
        except grpc.RpcError as e:
            print(f"error: {args.server}: {e.code().name}: {e.details()}", file=err)
            return 1
    _print(_plain_fields(reply), args.json, out)
    return 0


def _plain_fields(message) -> dict:
    """A reply's fields as JSON-ready values: repeated fields as lists, messages as dicts,
    float32 fields as the shortest decimal that reads back as the same float32 (0.2, not the
    0.20000000298023224 that the wire's float32 widens to)."""
    fields: dict = {}
    for f in message.DESCRIPTOR.fields:
        value = getattr(message, f.name)
        if f.message_type is not None and not f.is_repeated:
            if not message.HasField(f.name):
                continue  # the feature is off (speculative decoding, KV tiers)
            value = {  # zeros included (a counter at 0 says something), unset optionals not
                g.name: _plain_value(g, getattr(value, g.name))
                for g in value.DESCRIPTOR.fields
                if not (g.has_presence and not value.HasField(g.name))
            }
        else:
            value = _plain_value(f, value)
        fields[f.name] = value
    return fields


def _plain_value(field, value):
    if field.is_repeated:
        return [_plain_value_one(field, v) for v in value]
    return _plain_value_one(field, value)


def _plain_value_one(field, value):
    if field.message_type is not None:
        return {g.name: _plain_value(g, v) for g, v in value.ListFields()}
    return _float32(value) if field.type == field.TYPE_FLOAT else value


def _float32(value: float) -> float:
    """The shortest decimal that is the same float32 as ``value``."""
    exact = struct.pack("<f", value)
    for digits in range(6, 10):
        short = float(f"{value:.{digits}g}")
        if struct.pack("<f", short) == exact:
            return short
    return value


def _health(args: argparse.Namespace, channel: grpc.Channel, out) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + args.wait
    while True:
        try:
            reply = stub.Check(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=args.timeout
            )
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.RpcError as e:
            status = f"{e.code().name}: {e.details()}"
        if status == "SERVING" or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    _print({"server": args.server, "status": status}, args.json, out)
    return 0 if status == "SERVING" else 1


def _print(fields: dict, as_json: bool, out) -> None:
    if as_json:
        out.write(json.dumps(fields, indent=2) + "\n")
        return
    lines = []  # a message's fields one a line, under its name: kv_tiers.cpu_hit_tokens
    for name, value in fields.items():
        if isinstance(value, dict):
            lines += [(f"{name}.{sub}", v) for sub, v in value.items()]
        else:
            lines.append((name, value))
    width = max((len(name) for name, _ in lines), default=0)
    for name, value in lines:
        out.write(f"{name:<{width}}  {value}\n")
