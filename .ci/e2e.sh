#!/usr/bin/env bash
# warmfleet e2e suite: a real Kubernetes control plane (kwok cluster on loopback) built from
# Go modules pinned in e2e/tools/go.mod, then `pytest e2e`.
#
# Fails (never skips) with a clear message when the toolchain cannot be had: Go missing, the
# module proxy unreachable on a cold cache, a build error. The first build on a machine takes
# tens of minutes on 2 cores; binaries are cached in ${WARMFLEET_E2E_CACHE:-~/.cache/warmfleet-e2e}.
#
# Env: PYTHON (default: python3), WARMFLEET_E2E_INSTALL=0 to skip pip installs,
#      WARMFLEET_E2E_PYTEST_ARGS extra pytest arguments, WARMFLEET_E2E_IMAGES (.ci/installed.sh prints it)
#      the installed environments that stand for the images the pods run.
set -euo pipefail
cd "$(dirname "$0")/.."

fail() { echo "e2e: ERROR: $*" >&2; exit 1; }
PY="${PYTHON:-python3}"

echo "== e2e: toolchain"
command -v "$PY" >/dev/null 2>&1 || fail "$PY not found"
if [[ -z "${WARMFLEET_E2E_BIN:-}" ]]; then
  command -v go >/dev/null 2>&1 || fail "Go is required for the e2e suite (it builds kube-apiserver,
  etcd, kwok, kubectl and helm from Go modules pinned in e2e/tools/go.mod) and 'go' is not on PATH.
  Install Go >= 1.26, or set WARMFLEET_E2E_BIN to a directory with prebuilt binaries."
  go version
fi
t0=$(date +%s)
BIN="$(e2e/cluster.sh bin | tail -n 1)" || fail "the e2e toolchain is not available (see above)"
echo "toolchain ready in $(( $(date +%s) - t0 ))s: $BIN"
cat "$BIN/VERSIONS" 2>/dev/null || true
export WARMFLEET_E2E_BIN="$BIN"

echo "== e2e: python dependencies"
# The suite runs the operator, replicas and router from this interpreter's environment: it needs
# warmfleet installed with its extras (the project venv of `make test` has them).
if [[ "${WARMFLEET_E2E_INSTALL:-1}" != 0 ]]; then
  "$PY" -P -c 'import pytest' 2>/dev/null || "$PY" -m pip install -q 'pytest>=8'
fi
missing="$("$PY" -P -c '
import importlib.util as u
mods = ["pytest", "warmfleet.cli", "warmfleet.operator.passes.kube_client", "kopf", "httpx", "openai", "yaml", "PIL", "numpy", "paddle"]
print(" ".join(m for m in mods if u.find_spec(m.split(".")[0]) is None or (u.find_spec(m) is None)))
')" || fail "$PY cannot inspect its packages"
[[ -z "$missing" ]] || fail "$PY lacks: $missing. The e2e suite needs warmfleet with its extras:
  run 'make test' (creates .venv) and PYTHON=.venv/bin/python .ci/e2e.sh, or pip install -e '.[all]'."
[[ -x "$(dirname "$PY")/warmfleet" ]] || "$PY" -P -c 'import warmfleet.cli' \
  || fail "the warmfleet command is not installed for $PY"

if [[ -n "${WARMFLEET_E2E_IMAGES:-}" ]]; then
  echo "== e2e: pods' processes run from the environments standing for their images: ${WARMFLEET_E2E_IMAGES}"
else
  echo "== e2e: pods' processes run from $PY's environment (set WARMFLEET_E2E_IMAGES, as .ci/run does, for installed ones)"
fi
echo "== e2e: pytest e2e (cluster up, chart, operator, data plane, cluster down)"
t1=$(date +%s)
# -P: keep the repo root off sys.path: its warmfleet/ folder is only part of the package (server/ and the
# operator's rooms are mapped in), so $PY's installed warmfleet must be what is imported.
set +e
# shellcheck disable=SC2086
"$PY" -P -m pytest e2e -v -p no:cacheprovider --durations=12 ${WARMFLEET_E2E_PYTEST_ARGS:-}
rc=$?
set -e
case $rc in
  0) echo "e2e: passed in $(( $(date +%s) - t1 ))s (toolchain check $(( t1 - t0 ))s)" ;;
  5) fail "pytest collected no e2e tests" ;;
  *) fail "pytest e2e failed (exit $rc)" ;;
esac
