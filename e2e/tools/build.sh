#!/usr/bin/env bash
# Build the e2e control-plane toolchain from Go modules pinned in e2e/tools/go.mod:
#   kube-apiserver kube-controller-manager kube-scheduler kubectl  (k8s.io/kubernetes)
#   etcd                                                          (go.etcd.io/etcd/server/v3)
#   kwok kwokctl                                                  (sigs.k8s.io/kwok)
#   helm                                                          (helm.sh/helm/v4)
#
# Binaries land in ${WARMFLEET_E2E_CACHE:-$HOME/.cache/warmfleet-e2e}/bin-<hash>, where
# <hash> covers go.mod, go.sum, tools.go, the build flags and the Go version, so a second
# run (or a run from a fresh clone on the same machine) is instant. Only the Go module proxy
# is contacted, and only when the module cache lacks something.
#
# Usage: e2e/tools/build.sh      (logs on stderr; the bin dir is the last line on stdout)
# Env:   WARMFLEET_E2E_CACHE, WARMFLEET_E2E_NICE (default 10)
set -euo pipefail

TOOLS_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE_ROOT="${WARMFLEET_E2E_CACHE:-$HOME/.cache/warmfleet-e2e}"
BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kubectl etcd kwok kwokctl helm)
RECIPE=2   # bump when the build steps below change in a way the flags do not show

log() { echo "[e2e-tools] $*" >&2; }
die() { echo "[e2e-tools] ERROR: $*" >&2; exit 1; }

if ! command -v go >/dev/null 2>&1; then
  die "Go is not installed (no 'go' on PATH). The e2e control plane (kube-apiserver, etcd,
  kwok, helm, kubectl) is built from Go modules pinned in e2e/tools/go.mod and needs Go >= 1.26.
  Install Go 1.26 or put it on PATH, or set WARMFLEET_E2E_BIN to a directory that already
  holds: ${BINARIES[*]}"
fi
export GOTOOLCHAIN=local CGO_ENABLED=0
export GOFLAGS="-trimpath -mod=readonly -buildvcs=false"

# Version of a required module, read from go.mod (the single source of truth).
modver() { awk -v m="$1" '$1==m && $2 ~ /^v/ {print $2; exit}' "$TOOLS_DIR/go.mod"; }
KUBE_VERSION="$(modver k8s.io/kubernetes)"
KWOK_VERSION="$(modver sigs.k8s.io/kwok)"
HELM_VERSION="$(modver helm.sh/helm/v4)"
ETCD_VERSION="$(modver go.etcd.io/etcd/server/v3)"
[[ -n "$KUBE_VERSION" && -n "$KWOK_VERSION" && -n "$HELM_VERSION" && -n "$ETCD_VERSION" ]] \
  || die "could not read tool versions from $TOOLS_DIR/go.mod"

# Version stamps: kwokctl reads `<binary> --version` to pick flags, so they must be real.
KUBE_MAJOR="${KUBE_VERSION#v}"; KUBE_MAJOR="${KUBE_MAJOR%%.*}"
KUBE_MINOR="${KUBE_VERSION#v*.}"; KUBE_MINOR="${KUBE_MINOR%%.*}"
BUILD_DATE="2000-01-01T00:00:00Z"   # fixed: reproducible binaries
LDFLAGS="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  LDFLAGS+=" -X $pkg.gitVersion=$KUBE_VERSION -X $pkg.gitMajor=$KUBE_MAJOR -X $pkg.gitMinor=$KUBE_MINOR"
  LDFLAGS+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$BUILD_DATE"
done
LDFLAGS+=" -X sigs.k8s.io/kwok/pkg/consts.Version=${KWOK_VERSION#v}"
LDFLAGS+=" -X sigs.k8s.io/kwok/pkg/consts.KubeVersion=${KUBE_VERSION#v}"
LDFLAGS+=" -X helm.sh/helm/v4/internal/version.version=$HELM_VERSION"
LDFLAGS+=" -X helm.sh/helm/v4/internal/version.gitTreeState=clean"

GO_VERSION="$(go env GOVERSION)"
HASH="$( { cat "$TOOLS_DIR/go.mod" "$TOOLS_DIR/go.sum" "$TOOLS_DIR/tools.go"; \
           echo "recipe=$RECIPE ldflags=$LDFLAGS goflags=$GOFLAGS cgo=$CGO_ENABLED"; \
           echo "$GO_VERSION $(go env GOOS)/$(go env GOARCH)"; } | sha256sum | cut -c1-16)"
BIN_DIR="$CACHE_ROOT/bin-$HASH"

have_all() {
  local b
  for b in "${BINARIES[@]}"; do [[ -x "$BIN_DIR/$b" ]] || return 1; done
  [[ -f "$BIN_DIR/VERSIONS" ]]
}

if have_all; then
  log "cached toolchain: $BIN_DIR"
  echo "$BIN_DIR"
  exit 0
fi

mkdir -p "$CACHE_ROOT"
# One builder at a time per cache root (pytest + a manual run, or two CI jobs).
exec 9>"$CACHE_ROOT/.build.lock"
if ! flock -n 9; then
  log "another build holds $CACHE_ROOT/.build.lock; waiting for it"
  flock 9
fi
if have_all; then
  log "cached toolchain (built by the other process): $BIN_DIR"
  echo "$BIN_DIR"
  exit 0
fi

log "building toolchain into $BIN_DIR (kubernetes $KUBE_VERSION, etcd $ETCD_VERSION, kwok $KWOK_VERSION, helm $HELM_VERSION, $GO_VERSION)"
log "a cold build takes tens of minutes on 2 cores; later runs reuse the cache"

STAGE="$(mktemp -d "$CACHE_ROOT/.stage-XXXXXX")"
trap 'rm -rf "$STAGE"' EXIT
NICE=(nice -n "${WARMFLEET_E2E_NICE:-10}")
start=$(date +%s)
cd "$TOOLS_DIR"
"${NICE[@]}" go build -ldflags "$LDFLAGS" -o "$STAGE/" \
  k8s.io/kubernetes/cmd/kube-apiserver \
  k8s.io/kubernetes/cmd/kube-controller-manager \
  k8s.io/kubernetes/cmd/kube-scheduler \
  k8s.io/kubernetes/cmd/kubectl \
  sigs.k8s.io/kwok/cmd/kwok \
  sigs.k8s.io/kwok/cmd/kwokctl \
  helm.sh/helm/v4/cmd/helm \
  || die "go build of the kubernetes/kwok/helm binaries failed (see above)"
# The etcd main package is the module root (.../server/v3), so name its output explicitly.
"${NICE[@]}" go build -ldflags "-s -w" -o "$STAGE/etcd" go.etcd.io/etcd/server/v3 \
  || die "go build of etcd failed (see above)"

cat >"$STAGE/VERSIONS" <<EOF
kubernetes $KUBE_VERSION
etcd $ETCD_VERSION
kwok $KWOK_VERSION
helm $HELM_VERSION
go $GO_VERSION
hash $HASH
build_seconds $(( $(date +%s) - start ))
EOF
chmod 755 "$STAGE"
rm -rf "$BIN_DIR"
mv "$STAGE" "$BIN_DIR"
trap - EXIT
log "built in $(( $(date +%s) - start ))s: $BIN_DIR ($(du -sh "$BIN_DIR" | cut -f1))"
echo "$BIN_DIR"
