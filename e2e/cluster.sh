#!/usr/bin/env bash
# A real Kubernetes control plane on loopback for warmfleet's e2e tests.
#
#   e2e/cluster.sh up   [NAME]  build the toolchain if missing (e2e/tools/build.sh), start a
#                               kwok cluster (real etcd, kube-apiserver, kube-controller-manager,
#                               kube-scheduler; kwok-controller fakes nodes and pods) through
#                               kwokctl's binary runtime, create the fake GPU nodes and wait until
#                               they are Ready. Prints the kubeconfig path as the last stdout line.
#   e2e/cluster.sh down [NAME]  delete the cluster (default: the last one brought up).
#   e2e/cluster.sh env  [NAME]  print `export ...` lines (KUBECONFIG, PATH, WARMFLEET_E2E_*)
#                               for `eval "$(e2e/cluster.sh env)"`.
#   e2e/cluster.sh bin          build if missing and print the toolchain directory.
#   e2e/cluster.sh prune        delete leftover wf-e2e-* clusters whose processes are gone.
#   e2e/cluster.sh gateway-crds fetch (once, cached) the InferencePool (GIE v1.6.0) and HTTPRoute (Gateway API
#                               v1.6.3) CRDs from their Go modules; print their paths.
#
# Nothing is downloaded except Go modules through the Go module proxy during the first build;
# kwokctl gets every binary as a local file. All state lives under
#   ${WARMFLEET_E2E_CACHE:-$HOME/.cache/warmfleet-e2e}  (binaries in bin-<hash>/, kwok in kwok/)
#
# Environment:
#   WARMFLEET_E2E_CACHE         cache root (see above)
#   WARMFLEET_E2E_BIN           use this directory of prebuilt binaries instead of building
#   WARMFLEET_E2E_H200_NODES    number of 8xH200 nodes (default 2)
#   WARMFLEET_E2E_L4_NODES      number of 8xL4 nodes (default 2)
#   WARMFLEET_E2E_UP_TIMEOUT    seconds to wait for the cluster and nodes (default 180)
set -euo pipefail

E2E_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE_ROOT="${WARMFLEET_E2E_CACHE:-$HOME/.cache/warmfleet-e2e}"
export KWOK_WORKDIR="$CACHE_ROOT/kwok"
STATE_DIR="$CACHE_ROOT/state"
UP_TIMEOUT="${WARMFLEET_E2E_UP_TIMEOUT:-180}"
H200_NODES="${WARMFLEET_E2E_H200_NODES:-2}"
L4_NODES="${WARMFLEET_E2E_L4_NODES:-2}"
REQUIRED_BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kubectl etcd kwok kwokctl helm)

log() { echo "[e2e-cluster] $*" >&2; }
die() { echo "[e2e-cluster] ERROR: $*" >&2; exit 1; }

toolchain_dir() {
  if [[ -n "${WARMFLEET_E2E_BIN:-}" ]]; then
    local b
    for b in "${REQUIRED_BINARIES[@]}"; do
      [[ -x "$WARMFLEET_E2E_BIN/$b" ]] || die "WARMFLEET_E2E_BIN=$WARMFLEET_E2E_BIN lacks an executable '$b'"
    done
    echo "$WARMFLEET_E2E_BIN"
    return
  fi
  # build.sh fails with one clear message when Go is missing.
  "$E2E_DIR/tools/build.sh" | tail -n 1
}

last_name() { [[ -f "$STATE_DIR/last" ]] && cat "$STATE_DIR/last" || true; }

cluster_env_file() { echo "$STATE_DIR/$1.env"; }

# `kwokctl` with our workdir and binaries.
kwokctl_() { "$BIN/kwokctl" "$@"; }

write_config() {  # $1 = path
  cat >"$1" <<EOF
apiVersion: config.kwok.x-k8s.io/v1alpha1
kind: KwokctlConfiguration
options:
  runtime: binary
  kubeVersion: ${KUBE_VERSION}
  bindAddress: 127.0.0.1
  quietPull: true
  cacheDir: ${KWOK_WORKDIR}/cache
  kubeApiserverBinary: ${BIN}/kube-apiserver
  kubeControllerManagerBinary: ${BIN}/kube-controller-manager
  kubeSchedulerBinary: ${BIN}/kube-scheduler
  kubectlBinary: ${BIN}/kubectl
  kwokControllerBinary: ${BIN}/kwok
  etcdBinary: ${BIN}/etcd
  # Never fall back to a download: anything not given above points at a path that does
  # not exist, so kwokctl fails instead of reaching out.
  kubeBinaryPrefix: ${BIN}
  kwokBinaryPrefix: ${BIN}
  etcdBinaryPrefix: ${BIN}
EOF
}

# Fake GPU nodes. Labels follow NVIDIA GPU feature discovery (gpu.memory is MiB per GPU);
# kwok manages nodes annotated kwok.x-k8s.io/node=fake and keeps the status given at
# creation (allocatable/capacity). InternalIP is loopback so nothing ever dials elsewhere.
node_manifest() {  # name product mem_mib family cpu memory instance_type
  cat <<EOF
---
apiVersion: v1
kind: Node
metadata:
  name: $1
  annotations:
    kwok.x-k8s.io/node: fake
    node.alpha.kubernetes.io/ttl: "0"
  labels:
    kubernetes.io/arch: amd64
    kubernetes.io/os: linux
    kubernetes.io/hostname: $1
    type: kwok
    node.kubernetes.io/instance-type: $7
    topology.kubernetes.io/zone: e2e-zone-a
    nvidia.com/gpu.present: "true"
    nvidia.com/gpu.count: "8"
    nvidia.com/gpu.product: $2
    nvidia.com/gpu.memory: "$3"
    nvidia.com/gpu.family: $4
status:
  addresses:
  - {type: InternalIP, address: 127.0.0.1}
  - {type: Hostname, address: $1}
  capacity: {cpu: "$5", memory: $6, ephemeral-storage: 7Ti, pods: "110", nvidia.com/gpu: "8"}
  allocatable: {cpu: "$5", memory: $6, ephemeral-storage: 7Ti, pods: "110", nvidia.com/gpu: "8"}
EOF
}

nodes_manifest() {
  local i
  for ((i = 0; i < H200_NODES; i++)); do
    node_manifest "gpu-h200-$i" NVIDIA-H200 143771 hopper 192 2Ti p5e.48xlarge
  done
  for ((i = 0; i < L4_NODES; i++)); do
    node_manifest "gpu-l4-$i" NVIDIA-L4 23034 ada-lovelace 96 384Gi g2-standard-96
  done
}

cmd_up() {
  local name="${1:-${WARMFLEET_E2E_CLUSTER:-wf-e2e-$(date +%Y%m%d%H%M%S)-$$}}"
  [[ "$name" =~ ^[a-z0-9]([-a-z0-9]*[a-z0-9])?$ ]] || die "bad cluster name '$name' (lowercase DNS label)"
  local t0; t0=$(date +%s)
  BIN="$(toolchain_dir)"
  KUBE_VERSION="$(awk '$1=="kubernetes"{print $2}' "$BIN/VERSIONS" 2>/dev/null || true)"
  KUBE_VERSION="${KUBE_VERSION:-$("$BIN/kube-apiserver" --version | awk '{print $2}')}"
  mkdir -p "$KWOK_WORKDIR" "$STATE_DIR"
  # Serialise prune + create across concurrent invocations: prune must not see a cluster
  # that another `up` is still creating (no pids yet), and kwokctl picks free ports by
  # looking at the clusters that already exist.
  exec 8>"$STATE_DIR/.lock"
  flock 8
  cmd_prune_quiet

  local cfg="$STATE_DIR/$name.kwokctl.yaml"
  write_config "$cfg"
  log "creating cluster '$name' (kubernetes $KUBE_VERSION, binaries $BIN)"
  local klog="$STATE_DIR/$name.create.log"
  if ! kwokctl_ --config "$cfg" --name "$name" create cluster \
      --kubeconfig "" --wait "${UP_TIMEOUT}s" --timeout "${UP_TIMEOUT}s" >"$klog" 2>&1 8>&-; then
    cat "$klog" >&2
    kwokctl_ --name "$name" delete cluster >/dev/null 2>&1 || true
    die "kwokctl create cluster '$name' failed (log above, component logs under $KWOK_WORKDIR/clusters/$name/logs)"
  fi
  flock -u 8
  local kubeconfig="$KWOK_WORKDIR/clusters/$name/kubeconfig.yaml"
  [[ -f "$kubeconfig" ]] || die "kwokctl did not write $kubeconfig"
  local kc=("$BIN/kubectl" --kubeconfig "$kubeconfig")

  # The API server may answer /readyz before every built-in API is served; wait for nodes.
  local deadline=$((SECONDS + UP_TIMEOUT))
  until "${kc[@]}" get --raw /readyz >/dev/null 2>&1 && "${kc[@]}" get nodes >/dev/null 2>&1; do
    ((SECONDS < deadline)) || die "API server of '$name' not ready after ${UP_TIMEOUT}s"
    sleep 0.5
  done
  nodes_manifest | "${kc[@]}" apply -f - >/dev/null
  # Nodes turn Ready once kwok's node-initialize stage runs.
  local want=$((H200_NODES + L4_NODES))
  if ((want > 0)); then
    "${kc[@]}" wait --for=condition=Ready node -l type=kwok --timeout="${UP_TIMEOUT}s" >/dev/null \
      || die "fake nodes of '$name' did not become Ready in ${UP_TIMEOUT}s"
  fi
  # Pods need the default ServiceAccount, created by kube-controller-manager.
  until "${kc[@]}" -n default get serviceaccount default >/dev/null 2>&1; do
    ((SECONDS < deadline)) || die "default ServiceAccount of '$name' missing after ${UP_TIMEOUT}s"
    sleep 0.5
  done

  local envf; envf="$(cluster_env_file "$name")"
  cat >"$envf" <<EOF
export WARMFLEET_E2E_CLUSTER=$name
export WARMFLEET_E2E_KUBECONFIG=$kubeconfig
export KUBECONFIG=$kubeconfig
export WARMFLEET_E2E_BIN=$BIN
export WARMFLEET_E2E_KUBECTL=$BIN/kubectl
export WARMFLEET_E2E_HELM=$BIN/helm
export PATH=$BIN:\$PATH
EOF
  echo "$name" >"$STATE_DIR/last"
  log "cluster '$name' up in $(( $(date +%s) - t0 ))s with $want fake GPU nodes; kubeconfig $kubeconfig"
  log "use it with: eval \"\$($E2E_DIR/cluster.sh env $name)\""
  echo "$kubeconfig"
}

cmd_down() {
  local name="${1:-$(last_name)}"
  [[ -n "$name" ]] || die "no cluster name given and no cluster was brought up"
  BIN="$(toolchain_dir)"
  if [[ -d "$KWOK_WORKDIR/clusters/$name" ]]; then
    kwokctl_ --name "$name" delete cluster >&2 || die "kwokctl delete cluster '$name' failed"
  else
    log "cluster '$name' does not exist"
  fi
  rm -f "$(cluster_env_file "$name")" "$STATE_DIR/$name.kwokctl.yaml" "$STATE_DIR/$name.create.log"
  [[ "$(last_name)" == "$name" ]] && rm -f "$STATE_DIR/last"
  log "cluster '$name' deleted"
}

cmd_env() {
  local name="${1:-$(last_name)}"
  [[ -n "$name" ]] || die "no cluster name given and no cluster was brought up"
  local envf; envf="$(cluster_env_file "$name")"
  [[ -f "$envf" ]] || die "no cluster '$name' (no $envf); run: $0 up"
  cat "$envf"
}

# A cluster is stale when none of the processes recorded in its pids/ directory is alive
# (a live pid only counts if its command line is this cluster's: pids get reused).
cluster_alive() {
  local pidf pid
  for pidf in "$KWOK_WORKDIR/clusters/$1"/pids/*.pid; do
    [[ -f "$pidf" ]] || continue
    pid="$(cat "$pidf" 2>/dev/null || true)"
    [[ -n "$pid" && -r "/proc/$pid/cmdline" ]] || continue
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF "/clusters/$1/" && return 0
  done
  return 1
}

cmd_prune_quiet() {
  local d name
  for d in "$KWOK_WORKDIR"/clusters/wf-e2e-*; do
    [[ -d "$d" ]] || continue
    name="$(basename "$d")"
    cluster_alive "$name" && continue
    log "removing stale cluster '$name'"
    kwokctl_ --name "$name" delete cluster >/dev/null 2>&1 8>&- || rm -rf "$d"
    rm -f "$(cluster_env_file "$name")" "$STATE_DIR/$name.kwokctl.yaml" "$STATE_DIR/$name.create.log"
    [[ "$(last_name)" == "$name" ]] && rm -f "$STATE_DIR/last"
  done
  return 0
}

# The CRDs of spec.router.mode: gateway, from their Go modules at exact versions (the module proxy serves exact
# versions, not lists), cached beside the binaries. Not applied by `up`: e2e/test_gateway.py first shows a cluster
# without them, then applies these files itself.
GATEWAY_CRD_FILES=(
  "sigs.k8s.io/gateway-api-inference-extension@v1.6.0 config/crd/bases/inference.networking.k8s.io_inferencepools.yaml"
  "sigs.k8s.io/gateway-api@v1.6.3 config/crd/standard/gateway.networking.k8s.io_httproutes.yaml"
)

cmd_gateway_crds() {  # prints one cached CRD file per line
  local entry module file dir dest
  for entry in "${GATEWAY_CRD_FILES[@]}"; do
    module="${entry%% *}" file="${entry#* }"
    dest="$CACHE_ROOT/gateway-crds/${module//\//_}/$(basename "$file")"
    if [[ ! -s "$dest" ]]; then
      command -v go >/dev/null 2>&1 || die "$dest is not cached and Go is not on PATH ('GOFLAGS=-mod=mod go mod download -json $module' fetches it)"
      dir="$(cd "$CACHE_ROOT" && GOFLAGS=-mod=mod GOTOOLCHAIN=local go mod download -json "$module" \
            | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')" || true
      [[ -n "$dir" && -f "$dir/$file" ]] || die "go mod download $module gave no $file"
      mkdir -p "$(dirname "$dest")" && install -m 0644 "$dir/$file" "$dest"
    fi
    echo "$dest"
  done
}

case "${1:-}" in
  up) shift; cmd_up "$@" ;;
  gateway-crds) cmd_gateway_crds ;;
  down) shift; cmd_down "$@" ;;
  env) shift; cmd_env "$@" ;;
  bin) toolchain_dir ;;
  prune) BIN="$(toolchain_dir)"; mkdir -p "$STATE_DIR"; exec 8>"$STATE_DIR/.lock"; flock 8; cmd_prune_quiet ;;
  *) echo "usage: $0 up|down|env [NAME] | bin | prune | gateway-crds" >&2; exit 2 ;;
esac
