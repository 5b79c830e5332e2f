#!/usr/bin/env bash
# Installed-package stage: what users install, tested as installed.
#
# Builds the sdist and the wheel from this clone's HEAD (as PyPI users get them), runs the images'
# build steps (scripts/image-steps.sh) into two fresh virtual environments outside the checkout, one per
# image (engine: warmfleet[engine,fetch]; slim: warmfleet[router,operator,fetch], no Paddle), and from
# there runs the commands users run: --version, doctor, make-tiny-model, serve + route with a chat and an
# image request, promtool on both /metrics, fetch-model --help. (`operator render` of every example runs
# from the slim environment in .ci/static.sh, which validates what it prints.)
#
# Prints, as its last line, the WARMFLEET_E2E_IMAGES value that makes the e2e suite start its data plane
# (the processes of the rendered pod specs) from these environments.
#
# Env: PYTHON (default python3) creates the environments; WARMFLEET_INSTALLED_DIR (default: a new
# directory under /tmp) holds them.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PY=${PYTHON:-python3}
WORK=${WARMFLEET_INSTALLED_DIR:-$(mktemp -d /tmp/warmfleet-installed.XXXXXX)}
mkdir -p "$WORK"
fail() { echo "installed: ERROR: $*" >&2; exit 1; }
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
t0=$(date +%s)

echo "== installed: sdist and wheel from $(git rev-parse --short HEAD) into $WORK/dist"
rm -rf "$WORK/src" "$WORK/dist" && mkdir -p "$WORK/src"
git archive HEAD | tar -x -C "$WORK/src"
# every environment is made from / so that no checkout is on sys.path (its warmfleet/ is part of the package only)
(cd / && "$PY" -m venv "$WORK/build") && "$WORK/build/bin/pip" install -q --disable-pip-version-check build
(cd / && "$WORK/build/bin/python" -m build --outdir "$WORK/dist" "$WORK/src" >"$WORK/build.log" 2>&1) \
  || { tail -n 30 "$WORK/build.log"; fail "python -m build failed (log: $WORK/build.log)"; }
ls "$WORK/dist"

for target in engine slim; do
  rm -rf "${WORK:?}/$target" && (cd / && "$PY" -m venv "$WORK/$target")
  PYTHON="$WORK/$target/bin/python" ENGINE_EXTRA=engine WARMFLEET_KERNEL_DIR="$WORK/kernels" \
    scripts/image-steps.sh "$target" "$WORK/dist"
done
E="$WORK/engine/bin/warmfleet" S="$WORK/slim/bin/warmfleet"

cd "$WORK"
echo "== installed: the commands users run (cwd $WORK)"
[[ "$("$E" --version)" == "$("$S" --version)" ]] || fail "the two environments report different versions"
"$E" doctor || fail "warmfleet doctor failed in the engine environment (its fail lines say what to change)"
"$E" make-tiny-model "$WORK/tiny-vl" --arch qwen2_vl >/dev/null
"$S" fetch-model --help >/dev/null

port() { "$WORK/engine/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
rp=$(port) ep=$(port) qp=$(port)
WARMFLEET_KERNEL_DIR="$WORK/kernels" "$E" serve --model "$WORK/tiny-vl" --host 127.0.0.1 --port "$rp" \
  --kv-events-host 127.0.0.1 --kv-events-port "$ep" --dtype float32 >"$WORK/serve.log" 2>&1 & pids+=($!)
"$S" route --model "$WORK/tiny-vl" --replica "http://127.0.0.1:$rp,events=tcp://127.0.0.1:$ep" \
  --host 127.0.0.1 --port "$qp" >"$WORK/route.log" 2>&1 & pids+=($!)
if ! "$WORK/engine/bin/python" -P "$REPO/.ci/installed_smoke.py" "http://127.0.0.1:$rp" "http://127.0.0.1:$qp"; then
  echo "---- serve.log"; tail -n 40 "$WORK/serve.log"; echo "---- route.log"; tail -n 40 "$WORK/route.log"
  fail "serve + route from the installed environments did not answer as expected"
fi
WARMFLEET_BIN="$WORK/slim/bin" "$REPO/.ci/static.sh" metrics "http://127.0.0.1:$rp/metrics" "http://127.0.0.1:$qp/metrics"
cleanup; pids=()

echo "== installed: passed in $(( $(date +%s) - t0 ))s"
echo "WARMFLEET_E2E_IMAGES=ghcr.io/warmfleet/warmfleet=$WORK/engine/bin,ghcr.io/warmfleet/warmfleet-slim=$WORK/slim/bin"
