#!/usr/bin/env bash
# Regenerates the Python code of protos/ into pydaemon/proto/ (or into $1), reproducibly.
#
#   PYTHON=/path/to/python scripts/gen_proto.sh [OUT_DIR]
#
# Needs grpcio-tools. After protoc, three documented rewrites make the committed code import
# from inside the package and run on every runtime pyproject.toml allows:
#   1. `from pagedd.v1 import ...` becomes `from pydaemon.proto.pagedd.v1 import ...`;
#   2. the protobuf gencode/runtime version check is removed: protoc pins the runtime to be at
#      least its own version (7.35 for grpcio-tools 1.85), but this file uses nothing newer
#      than protobuf 5.26 (checked by importing it under protobuf 5.26.0 and 7.x);
#   3. GRPC_GENERATED_VERSION is set to 1.64.0, the first grpcio whose runtime has the
#      registered-method API (`_registered_method`, `add_registered_method_handlers`) that the
#      generated stubs use.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
OUT="${1:-pydaemon/proto}"
mkdir -p "$OUT"
"$PYTHON" -m grpc_tools.protoc -I protos \
  --python_out="$OUT" --pyi_out="$OUT" --grpc_python_out="$OUT" \
  protos/pagedd/v1/generation.proto
"$PYTHON" - "$OUT/pagedd/v1" <<'PY'
import pathlib
import re
import sys

out = pathlib.Path(sys.argv[1])
pb2 = out / "generation_pb2.py"
text = pb2.read_text()
text, n_import = re.subn(r"from google\.protobuf import runtime_version as _runtime_version\n", "", text)
text, n_check = re.subn(
    r"_runtime_version\.ValidateProtobufRuntimeVersion\(\n(?:    .*\n)*?\)\n",
    "# (gencode/runtime version check removed by scripts/gen_proto.sh: needs protobuf >= 5.26)\n",
    text,
)
if (n_import, n_check) != (1, 1):
    sys.exit(f"gen_proto.sh: unexpected protoc output in {pb2} ({n_import}, {n_check})")
pb2.write_text(text)

grpc = out / "generation_pb2_grpc.py"
text = grpc.read_text()
text, n_import = re.subn(r"^from pagedd\.v1 import", "from pydaemon.proto.pagedd.v1 import", text, flags=re.M)
text, n_version = re.subn(r"^GRPC_GENERATED_VERSION = '[^']*'", "GRPC_GENERATED_VERSION = '1.64.0'", text, flags=re.M)
if (n_import, n_version) != (1, 1):
    sys.exit(f"gen_proto.sh: unexpected protoc output in {grpc} ({n_import}, {n_version})")
grpc.write_text(text)
PY
for d in "$OUT" "$OUT/pagedd" "$OUT/pagedd/v1"; do
  [ -f "$d/__init__.py" ] || : > "$d/__init__.py"
done
