#!/usr/bin/env bash
# Generates Go stubs from proto/, builds produce_consume.go and runs it against ADDRESS
# (default: $TIDELOG_BOOTSTRAP or 127.0.0.1:9292), with an optional TOPIC (default go-example).
#
# Needs (installs nothing itself) Go, protoc, protoc-gen-go, protoc-gen-go-grpc and the Go
# gRPC and protobuf libraries in GOPATH layout under /usr/share/gocode. On Debian:
#   apt-get install golang-go protobuf-compiler protoc-gen-go protoc-gen-go-grpc \
#     golang-google-grpc-dev golang-google-protobuf-dev golang-github-golang-protobuf-1-5-dev
# (github.com/golang/protobuf must be 1.4 or later: grpc-go 1.33 marshals through it, and
# 1.3 cannot handle the messages protoc-gen-go 1.28 generates.)
# It builds in GOPATH mode (GO111MODULE=off), so no Go module is downloaded; GOCODE=DIR
# uses another GOPATH holding google.golang.org/grpc and google.golang.org/protobuf.
#
# Writes nothing into the source tree: the stubs and the binary go to a fresh temporary
# directory, removed on exit (Go's build cache stays in its usual place, `go env GOCACHE`).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
proto="$(cd "$here/../../proto" && pwd)"
gocode="${GOCODE:-/usr/share/gocode}"
for tool in go protoc protoc-gen-go protoc-gen-go-grpc; do
  command -v "$tool" > /dev/null ||
    { echo "run.sh: $tool not found (what it needs is at the top of $0)" >&2; exit 1; }
done
for lib in google.golang.org/grpc google.golang.org/protobuf; do
  [ -d "$gocode/src/$lib" ] ||
    { echo "run.sh: $lib not found under $gocode/src (what it needs is at the top of $0)" >&2; exit 1; }
done
grep -qs google.golang.org/protobuf "$gocode/src/github.com/golang/protobuf/proto/proto.go" ||
  { echo "run.sh: github.com/golang/protobuf under $gocode is older than 1.4 or missing (Debian: golang-github-golang-protobuf-1-5-dev)" >&2; exit 1; }

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# The proto files name no go_package: M options map each one to the Go package tidelogv1,
# import path "tidelog/v1", which protoc writes to $tmp/src/tidelog/v1 for GOPATH=$tmp.
# Public clients need only these four (docs/api.md); broker.proto imports groups.proto.
files=(tidelog/v1/common.proto tidelog/v1/admin.proto tidelog/v1/groups.proto tidelog/v1/broker.proto)
opts=()
for f in "${files[@]}"; do
  opts+=("--go_opt=M$f=tidelog/v1;tidelogv1" "--go-grpc_opt=M$f=tidelog/v1;tidelogv1")
done
mkdir "$tmp/src"
(cd "$proto" && protoc -I . --go_out="$tmp/src" --go-grpc_out="$tmp/src" "${opts[@]}" "${files[@]}")

GO111MODULE=off GOPATH="$tmp:$gocode" GOFLAGS= go build -o "$tmp/produce_consume" "$here/produce_consume.go"
"$tmp/produce_consume" "$@"
