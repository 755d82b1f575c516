#!/usr/bin/env bash
# Creates a venv with grpcio-tools, generates Python stubs from proto/, and runs
# produce_consume.py against ADDRESS (default: $TIDELOG_BOOTSTRAP or 127.0.0.1:9292).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${TIDELOG_PY_VENV:-$here/.venv}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet grpcio grpcio-tools
fi
gen="$here/generated"
mkdir -p "$gen"
"$venv/bin/python" -m grpc_tools.protoc -I "$here/../../proto" \
  --python_out="$gen" --grpc_python_out="$gen" \
  "$here"/../../proto/tidelog/v1/*.proto
touch "$gen/tidelog/__init__.py" "$gen/tidelog/v1/__init__.py"
PYTHONPATH="$gen" "$venv/bin/python" "$here/produce_consume.py" "$@"
