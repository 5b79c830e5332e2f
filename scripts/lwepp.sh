#!/usr/bin/env bash
# Build (once) GIE's reference light-weight EPP, `lwepp` (round-robin over an InferencePool's pods),
# from the exact module version, for the gateway benchmark's Envoy + lwepp front.
#
# `go install sigs.k8s.io/gateway-api-inference-extension/cmd/lwepp@v1.6.0` cannot work here: the
# module proxy refuses version lists (403) and `go install` asks for one (deprecation check). The
# proxy does serve the exact version, so: `go mod download` it, then `go build ./cmd/lwepp` inside
# the module directory with the module's own go.mod/go.sum (GOWORK=off: the module ships a go.work
# naming ./conformance, which is not in the module zip). The binary is cached under
# ${WARMFLEET_GIE_DIR} and reused while its stamp matches; the last line on stdout is its path.
#
# NOTE: lwepp has no static endpoint list; it learns endpoints only by watching an InferencePool and
# its pods through a Kubernetes API (controller-runtime's kubeconfig lookup: --kubeconfig or
# KUBECONFIG). bench/gateway.py gives it one from the e2e kwok cluster.
#
# Env: WARMFLEET_GIE_DIR (default ~/.cache/warmfleet-gie), GO (default go)
set -euo pipefail
MODULE=sigs.k8s.io/gateway-api-inference-extension
VERSION=v1.6.0
RECIPE=1   # bump when the steps below change
DIR="${WARMFLEET_GIE_DIR:-$HOME/.cache/warmfleet-gie}"
GO="${GO:-go}"
BIN="$DIR/lwepp-$VERSION"
STAMP="$BIN.stamp"
log() { echo "[lwepp] $*" >&2; }

if [[ -x "$BIN" && -f "$STAMP" && "$(cat "$STAMP")" == "$MODULE@$VERSION recipe=$RECIPE" ]]; then
  log "cached: $BIN"
  echo "$BIN"
  exit 0
fi
mkdir -p "$DIR"
cd "${TMPDIR:-/tmp}"
log "downloading $MODULE@$VERSION"
SRC="$(GOWORK=off GOFLAGS=-mod=mod "$GO" mod download -json "$MODULE@$VERSION" \
  | python3 -c 'import json, sys; print(json.load(sys.stdin)["Dir"])')"
log "building cmd/lwepp from $SRC (first run: a few minutes)"
cd "$SRC"
GOWORK=off GOFLAGS=-mod=readonly "$GO" build -trimpath -o "$BIN.tmp" ./cmd/lwepp >&2
mv "$BIN.tmp" "$BIN"
echo "$MODULE@$VERSION recipe=$RECIPE" > "$STAMP"
log "ready: $BIN"
echo "$BIN"
