#!/usr/bin/env bash
# What users see, before and after a change: `warmfleet operator render` of every example (YAML, JSON, warnings),
# the CRD, and the help texts of every command, from BASE (a commit) and from the working tree, then `diff -r`.
# A refactor that must not change behaviour shows an empty diff.
#
#   scripts/render-diff.sh [BASE]    (default: HEAD; exit 1 when anything differs)
#
# Each side is installed (no dependencies) into a temporary target and run with this checkout's interpreter
# (PYTHON, default .venv/bin/python) for its dependencies, from outside the checkout (-P), so neither side can
# import the source tree by accident.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
base="${1:-HEAD}"
PY="${PYTHON:-$repo/.venv/bin/python}"
work="$(mktemp -d)"
trap 'git -C "$repo" worktree remove --force "$work/base-src" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
log() { echo "[render-diff] $*" >&2; }

install_side() {  # SRC TARGET
  "$PY" -m pip install -q --no-deps --no-build-isolation --target "$2" "$1" >&2
}

snapshot() {  # TARGET OUT
  local target=$1 out=$2 f n
  mkdir -p "$out"
  run() { (cd "$work" && PYTHONPATH="$target" "$PY" -P -c 'import sys; from warmfleet.cli import main; sys.exit(main())' "$@"); }
  for f in "$repo"/examples/inferenceservice*.yaml; do
    n="$(basename "$f" .yaml)"
    run operator render -f "$f" --nodes "$repo/examples/nodes.yaml" >"$out/$n.yaml" 2>"$out/$n.stderr" || echo "exit $?" >>"$out/$n.stderr"
    run operator render -f "$f" --nodes "$repo/examples/nodes.yaml" -o json >"$out/$n.json" 2>/dev/null || true
  done
  run operator crd >"$out/crd.yaml"
  for c in "" serve route epp operator demo fetch-model make-tiny-model; do
    run $c --help >"$out/help-${c:-warmfleet}.txt" 2>&1 || true
  done
}

log "base $base: installing"
git -C "$repo" worktree add --detach "$work/base-src" "$base" >/dev/null 2>&1
install_side "$work/base-src" "$work/base"
log "working tree: installing"
install_side "$repo" "$work/head"
log "rendering both"
snapshot "$work/base" "$work/out/base"
snapshot "$work/head" "$work/out/head"
# status timestamps are the render's own clock, not behaviour
find "$work/out" -type f -exec sed -i -E 's/(lastTransitionTime|lastRenderedAt)(["]?): ["'"'"']?[0-9T:Z-]+["'"'"']?/\1\2: TIME/' {} +
if diff -r "$work/out/base" "$work/out/head"; then
  log "no difference: $(ls "$work/out/head" | wc -l) files compared"
else
  log "differences above"; exit 1
fi
