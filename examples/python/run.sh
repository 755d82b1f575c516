#!/usr/bin/env bash
# Generates Python stubs from proto/ and runs produce_consume.py against ADDRESS
# (default: $TIDELOG_BOOTSTRAP or 127.0.0.1:9292).
#
# Writes nothing into the source tree, so it runs from a read-only checkout:
# - the venv (grpcio, grpcio-tools; needs python3 with venv and PyPI) is made once and
#   reused, at $PYTHON_EXAMPLE_VENV, default ${XDG_CACHE_HOME:-$HOME/.cache}/tidelog/python-example-venv;
# - the stubs are generated into a fresh temporary directory, removed on exit.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
proto="$here/../../proto"
venv="${PYTHON_EXAMPLE_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/tidelog/python-example-venv}"
# Checks the import rather than the venv's existence, so an install cut short is redone.
if ! "$venv/bin/python" -c 'import grpc, grpc_tools' 2>/dev/null; then
  mkdir -p "$(dirname "$venv")"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet grpcio grpcio-tools
fi
gen="$(mktemp -d)"
trap 'rm -rf "$gen"' EXIT
"$venv/bin/python" -m grpc_tools.protoc -I "$proto" \
  --python_out="$gen" --grpc_python_out="$gen" \
  "$proto"/tidelog/v1/*.proto
touch "$gen/tidelog/__init__.py" "$gen/tidelog/v1/__init__.py"
PYTHONPATH="$gen" "$venv/bin/python" "$here/produce_consume.py" "$@"
