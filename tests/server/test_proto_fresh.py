"""The committed generated code is what scripts/gen_proto.sh makes from protos/."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("grpc_tools")

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ("generation_pb2.py", "generation_pb2.pyi", "generation_pb2_grpc.py")


def _protoc_version() -> str:
    out = subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "--version"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.split()[-1]  # "libprotoc 35.1" -> "35.1"


def test_generated_proto_code_is_fresh(tmp_path):
    committed_pb2 = (
        ROOT / "pydaemon" / "proto" / "pagedd" / "v1" / "generation_pb2.py"
    ).read_text()
    made_by = re.search(r"# Protobuf Python Version: \d+\.(\d+\.\d+)", committed_pb2).group(1)
    if made_by != _protoc_version():
        pytest.skip(
            f"committed code was made by protoc {made_by}, grpcio-tools here has {_protoc_version()}"
        )
    subprocess.run(
        ["bash", str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)],
        check=True,
        env={**os.environ, "PYTHON": sys.executable},
    )
    for name in GENERATED:
        fresh = (tmp_path / "pagedd" / "v1" / name).read_text()
        committed = (ROOT / "pydaemon" / "proto" / "pagedd" / "v1" / name).read_text()
        assert fresh == committed, (
            f"pydaemon/proto/pagedd/v1/{name} is stale: run scripts/gen_proto.sh"
        )


def test_every_proto_field_and_enum_value_is_commented():
    lines = (ROOT / "protos" / "pagedd" / "v1" / "generation.proto").read_text().splitlines()
    for i, line in enumerate(lines):
        stripped = line.strip()
        is_field = (
            stripped.endswith(";")
            and "=" in stripped
            and not stripped.startswith(("//", "syntax", "package"))
        )
        is_decl = stripped.startswith(("message ", "enum ", "rpc ", "service ", "oneof "))
        if is_field or is_decl:
            assert lines[i - 1].strip().startswith("//"), f"line {i + 1} has no comment: {stripped}"
