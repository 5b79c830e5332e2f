#!/usr/bin/env bash
# The images' build steps as one script: the Dockerfile runs it, and CI runs it into fresh virtual
# environments (there is no Docker engine there), so what an image holds is what CI tested.
#
#   scripts/image-steps.sh engine|slim WHEEL_OR_DIR
#
#   engine  warmfleet[$ENGINE_EXTRA,fetch,tracing]: the engine image (ENGINE_EXTRA=engine-gpu on a base that ships
#           paddlepaddle-gpu; engine installs Paddle's CPU build from PyPI), with the decode-attention
#           kernel built into $WARMFLEET_KERNEL_DIR when that is set.
#   slim    warmfleet[router,operator,fetch,gateway,tracing]: operator, router and EPP pods and the fetch-model init step;
#           no Paddle.
#
# Env: PYTHON (default: python3) is the interpreter installed into. Every smoke step runs from / with -P,
# so a source tree can never stand in for the installed package.
set -euo pipefail
fail() { echo "image-steps: ERROR: $*" >&2; exit 1; }
[[ $# == 2 ]] || fail "usage: $0 engine|slim WHEEL_OR_DIR"
target=$1 wheel=$2
PY=${PYTHON:-python3}
if [[ -d $wheel ]]; then
  shopt -s nullglob; found=("$wheel"/warmfleet-*.whl); shopt -u nullglob
  [[ ${#found[@]} == 1 ]] || fail "expected one warmfleet wheel in $wheel, found ${#found[@]}"
  wheel=${found[0]}
fi
[[ -f $wheel ]] || fail "no wheel at $wheel (build one: python -m build --wheel)"
wheel=$(cd "$(dirname "$wheel")" && pwd)/$(basename "$wheel")

case $target in
  engine) extras="${ENGINE_EXTRA:-engine-gpu},fetch,tracing" ;;  # tracing: spec.tracing renders OTEL_* env
  slim) extras="router,operator,fetch,gateway,tracing" ;;
  *) fail "unknown target '$target' (engine or slim)" ;;
esac

# from / (with -P below): a checkout in the working directory would shadow the package (its warmfleet/ folder)
cd /
echo "== image-steps $target: pip install warmfleet[$extras]"
"$PY" -P -m pip install --quiet --disable-pip-version-check "${wheel}[${extras}]"
# xds-protos (gateway) ships an older copy of opentelemetry/proto that overwrites opentelemetry-proto's (tracing):
# its own files last, as scripts/otel-proto.sh does for the checkout's venv
otel=$("$PY" -P -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))' 2>/dev/null || true)
if [[ -n $otel ]]; then
  "$PY" -P -m pip install --quiet --disable-pip-version-check --force-reinstall --no-deps "opentelemetry-proto==$otel"
  "$PY" -P -c 'from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter' \
    || fail "the OTLP exporter does not import (opentelemetry-proto overwritten?)"
fi

bin=$(dirname "$("$PY" -c 'import sys; print(sys.executable)')")
warmfleet=$bin/warmfleet
[[ -x $warmfleet ]] || fail "the wheel installed no warmfleet command in $bin"
echo "== image-steps $target: smoke (installed package, cwd /)"
"$warmfleet" --version
"$PY" -P - "$target" <<'PY'
"""Import every module the target's pods run, from the installed package."""
import importlib, importlib.util, sys

target = sys.argv[1]
common = ["warmfleet.cli", "warmfleet.fetch", "warmfleet.server.config", "warmfleet.server.hashing",
          "warmfleet.server.router.http.main", "warmfleet.server.router.http.app", "warmfleet.server.router.core.engines"]
modules = {
    "engine": common + ["paddle", "warmfleet.server.api.main", "warmfleet.server.engine.core_proc",
                        "warmfleet.server.tiny_checkpoints.cli"],
    "slim": common + ["warmfleet.operator.wiring.command", "warmfleet.operator.wiring.handlers",
                      "warmfleet.operator.passes.kube_client",
                      "warmfleet.server.router.epp.main", "warmfleet.server.router.epp.service",
                      "warmfleet.server.router.epp.pick", "warmfleet.server.router.epp.app",
                      "warmfleet.server.router.epp.server", "warmfleet.server.router.epp.envoy_bootstrap"],
}[target]
for name in modules:
    mod = importlib.import_module(name)
    if name.startswith("warmfleet") and "site-packages" not in (mod.__file__ or ""):
        sys.exit(f"{name} imported from {mod.__file__}, not from the installed package")
from warmfleet.server import engine_kinds

for kind in engine_kinds.KINDS:  # every engine's router dialect (imported only when a router picks it)
    engine_kinds.dialect_class(kind)
if target == "slim" and importlib.util.find_spec("paddle") is not None:
    sys.exit("the slim image must not hold Paddle")
print(f"imports ok: {len(modules)} modules, {len(engine_kinds.KINDS)} router dialects")
PY
if [[ $target == engine ]]; then
  "$warmfleet" serve --help >/dev/null
  "$PY" -P -c "from warmfleet.server.attention import native; print('kernel', native.build())"
else
  for cmd in "route --help" "operator render --help" "fetch-model --help"; do
    # shellcheck disable=SC2086
    "$warmfleet" $cmd >/dev/null || fail "warmfleet $cmd failed"
  done
fi
echo "== image-steps $target: done"
