#!/usr/bin/env bash
# Build (once) LMCache for the vLLM CPU environment, beside it, never inside it: tests/vllm/test_vllm_lmcache.py
# runs `lmcache server` and vLLM's LMCacheMPConnector from it (docs/node-tier.md "vLLM pools").
#
# `pip install lmcache==0.5.6` into the vLLM environment would pull CUDA-only packages (cupy-cuda13x,
# cuda-python, cufile-python) and downgrade pins vLLM's own set satisfies (numpy<=2.2.6, protobuf<7, ...).
# Instead: the wheel with --no-deps into its own folder, plus the few pure-Python packages it imports that
# the vLLM environment lacks; the caller puts the folder on PYTHONPATH. The last line on stdout is the folder.
#
# Env: WARMFLEET_LMCACHE_DIR (default ~/.cache/warmfleet-vllm/lmcache-0.5.6), WARMFLEET_VLLM_PYTHON (default:
# scripts/vllm-env.sh's python)
set -euo pipefail
VERSION=0.5.6
RECIPE=1   # bump when the steps below change
DEPS="aiofile==3.12.3 caio==0.12.10 aiofiles==25.1.0 sortedcontainers==2.4.0 nvtx==0.2.17 redis==8.2.0"
DIR="${WARMFLEET_LMCACHE_DIR:-$HOME/.cache/warmfleet-vllm/lmcache-$VERSION}"
STAMP="$DIR/.warmfleet-stamp"
log() { echo "[lmcache-env] $*" >&2; }

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "lmcache==$VERSION recipe=$RECIPE" ]]; then
  log "cached: $DIR"
  echo "$DIR"
  exit 0
fi
HERE="$(cd "$(dirname "$0")" && pwd)"
VPY="${WARMFLEET_VLLM_PYTHON:-$("$HERE/vllm-env.sh" | tail -n 1)}"
cd "${TMPDIR:-/tmp}"   # not the repo root: its operator/ folder would shadow the standard library's
log "installing lmcache $VERSION beside the vLLM environment in $DIR"
rm -rf "$DIR"
"$VPY" -m pip install -q --target "$DIR" --no-deps "lmcache==$VERSION" $DEPS >&2
PYTHONPATH="$DIR" LMCACHE_DISABLE_BANNER=1 "$VPY" -c \
  'import lmcache.v1.multiprocess.server, lmcache.integration.vllm.lmcache_mp_connector' >&2
echo "lmcache==$VERSION recipe=$RECIPE" > "$STAMP"
log "ready: $DIR"
echo "$DIR"
