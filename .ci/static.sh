#!/usr/bin/env bash
# Static checks with the field's own tools (issue 22):
#   kubeconform -strict  every manifest we ship or render, against Kubernetes 1.37's JSON schemas and
#                        our CRD's (InferenceService examples)
#   kube-score score     the same manifests; findings we keep on purpose are listed, with the reason, in
#                        docs/security.md and matched below by message (KUBE_SCORE_KEPT); any other fails
#   promtool check rules every recording/alerting rule (PrometheusRule objects of the chart) and every
#                        PromQL expression of the Grafana dashboard (charts/warmfleet/files/dashboard.json)
#   promtool test rules  the alerts' unit tests in tests/alerts against the chart's PrometheusRule
#   promtool check metrics  live /metrics of running servers and routers (the `metrics` mode)
#
# Usage:
#   .ci/static.sh [check]         install/cached tools, render everything, run the three checks (default)
#   .ci/static.sh metrics URL...  curl each URL, pipe it into `promtool check metrics`; fails on a parse
#                                 error or on any lint problem except the kept ones (docs/security.md)
#   .ci/static.sh tools           install the tools only and print their directory
#
# Tools are installed once and cached in ${WARMFLEET_TOOLS_CACHE:-$HOME/.cache/warmfleet-tools}:
#   kubeconform v0.8.0, kube-score v1.20.0   `go install` through the Go module proxy
#   promtool                                 Debian's `prometheus` package (apt-get download + dpkg-deb -x)
#   Kubernetes 1.37 JSON schemas             from the kubernetes-validate wheel (a test dependency), their
#                                            /api/_definitions.json references inlined so they work offline
#   InferencePool, HTTPRoute CRDs            gateway mode's kinds: `GOFLAGS=-mod=mod go mod download -json` of
#                                            sigs.k8s.io/gateway-api-inference-extension@v1.6.0 and
#                                            sigs.k8s.io/gateway-api@v1.6.3, converted like our CRD
#   helm                                     $WARMFLEET_HELM, else the one the chart tests fetched
#                                            (.cache/bin), else the e2e toolchain's, else scripts/get-helm.sh
# After those downloads nothing touches the network: kubeconform gets only local schema locations, the
# operator renders with HF_HUB_OFFLINE=1 and closed loopback hub and S3 endpoints.
# Runtime on 2 cores: ~10 s with the cache; a first run ~1-2 min (two go installs, one .deb).
#
# Env: WARMFLEET_BIN (default .venv/bin: the `warmfleet` that renders), WARMFLEET_TOOLS_PYTHON (default
#      .venv/bin/python: a Python with kubernetes-validate and PyYAML for the helpers), WARMFLEET_TOOLS_CACHE,
#      WARMFLEET_HELM, WARMFLEET_STATIC_KEEP=DIR (keep the rendered manifests there).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"

KUBECONFORM_VERSION=v0.8.0
KUBE_SCORE_VERSION=v1.20.0
K8S_VERSION=1.37.0
CACHE="${WARMFLEET_TOOLS_CACHE:-$HOME/.cache/warmfleet-tools}"
WF_BIN="${WARMFLEET_BIN:-.venv/bin}"
[[ "$WF_BIN" = /* ]] || WF_BIN="$REPO/$WF_BIN"
WARMFLEET="$WF_BIN/warmfleet"
# The checks' own Python helpers (schema conversion, openapi2jsonschema.py, PromQL extraction) need
# kubernetes-validate and PyYAML: the checkout's venv has them, a slim WARMFLEET_BIN need not.
if [[ -n "${WARMFLEET_TOOLS_PYTHON:-}" ]]; then PY="$WARMFLEET_TOOLS_PYTHON"
elif [[ -x "$REPO/.venv/bin/python" ]]; then PY="$REPO/.venv/bin/python"
else PY="$WF_BIN/python"; fi

log() { echo "[static] $*" >&2; }
die() { echo "[static] ERROR: $*" >&2; exit 1; }

# ---------------------------------------------------------------------------------------------------
# tools

go_tool() {  # name module-path version -> prints the binary
  local name="$1" pkg="$2" ver="$3" dir="$CACHE/go/$1-$3"
  if [[ ! -x "$dir/$name" ]]; then
    command -v go >/dev/null 2>&1 || die "'$name' $ver is not cached in $dir and Go is not on PATH: it is
  installed with 'go install $pkg@$ver' through the Go module proxy. Install Go >= 1.24, or put a
  prebuilt '$name' at $dir/$name."
    log "installing $name $ver (go install $pkg@$ver) into $dir"
    mkdir -p "$dir.tmp"
    GOBIN="$dir.tmp" GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-trimpath -buildvcs=false" \
      nice -n 10 go install "$pkg@$ver" >&2 || die "go install $pkg@$ver failed (see above); the Go module proxy must serve it"
    rm -rf "$dir" && mv "$dir.tmp" "$dir"
  fi
  echo "$dir/$name"
}

promtool_bin() {  # Debian's prometheus package, unpacked (promtool needs only libc)
  local found
  found="$(ls -d "$CACHE"/prometheus-deb/*/usr/bin/promtool 2>/dev/null | sort | tail -n 1 || true)"
  if [[ -n "$found" && -x "$found" ]]; then echo "$found"; return; fi
  command -v apt-get >/dev/null 2>&1 && command -v dpkg-deb >/dev/null 2>&1 \
    || die "promtool is not cached under $CACHE/prometheus-deb and apt-get/dpkg-deb are missing: it comes from
  Debian's 'prometheus' package (apt-get download prometheus; dpkg-deb -x)."
  local tmp; tmp="$(mktemp -d)"
  log "downloading Debian's prometheus package for promtool"
  if ! (cd "$tmp" && apt-get download prometheus >&2 2>"$tmp/err"); then
    log "apt-get download failed ($(tail -n 1 "$tmp/err")); running apt-get update once"
    apt-get update -qq >&2 || true
    (cd "$tmp" && apt-get download prometheus >&2) || { rm -rf "$tmp"; die "apt-get download prometheus failed: promtool cannot be had"; }
  fi
  local deb; deb="$(ls "$tmp"/prometheus_*.deb | head -n 1)"
  local ver; ver="$(dpkg-deb -f "$deb" Version)"
  local dest="$CACHE/prometheus-deb/$ver"
  dpkg-deb -x "$deb" "$tmp/x" || { rm -rf "$tmp"; die "dpkg-deb -x $deb failed"; }
  rm -rf "$dest" && mkdir -p "$dest/usr/bin"
  install -m 0755 "$tmp/x/usr/bin/promtool" "$dest/usr/bin/promtool" || { rm -rf "$tmp"; die "the prometheus package $ver has no usr/bin/promtool"; }
  rm -rf "$tmp"
  [[ -x "$dest/usr/bin/promtool" ]] || die "the prometheus package $ver has no usr/bin/promtool"
  echo "$dest/usr/bin/promtool"
}

helm_bin() {
  if [[ -n "${WARMFLEET_HELM:-}" ]]; then
    [[ -x "$WARMFLEET_HELM" ]] || die "WARMFLEET_HELM=$WARMFLEET_HELM is not executable"
    echo "$WARMFLEET_HELM"; return
  fi
  local c
  for c in "$REPO/.cache/bin/helm" "$CACHE/helm/helm" \
           $(ls -t "${WARMFLEET_E2E_CACHE:-$HOME/.cache/warmfleet-e2e}"/bin-*/helm 2>/dev/null || true); do
    [[ -x "$c" ]] && { echo "$c"; return; }
  done
  log "fetching helm (scripts/get-helm.sh into $CACHE/helm)"
  scripts/get-helm.sh "$CACHE/helm" | tail -n 1 || die "no helm: set WARMFLEET_HELM, or let scripts/get-helm.sh fetch it (npm)"
}

kubeconform_src() {  # the module's scripts/openapi2jsonschema.py, kept beside the cached binary
  local cached="$CACHE/go/kubeconform-$KUBECONFORM_VERSION/openapi2jsonschema.py" dir
  if [[ ! -f "$cached" ]]; then
    dir="$(GOFLAGS=-mod=mod GOTOOLCHAIN=local go mod download -json "github.com/yannh/kubeconform@$KUBECONFORM_VERSION" \
          | "$PY" -c 'import json,sys; print(json.load(sys.stdin).get("Dir", ""))')" || true
    [[ -n "$dir" && -f "$dir/scripts/openapi2jsonschema.py" ]] \
      || die "go mod download github.com/yannh/kubeconform@$KUBECONFORM_VERSION gave no scripts/openapi2jsonschema.py"
    install -m 0644 "$dir/scripts/openapi2jsonschema.py" "$cached"
  fi
  echo "$cached"
}

# Kubernetes schemas of the kubernetes-validate wheel, made standalone: every resource schema gets the
# definitions it reaches (transitively) as its own $defs, and "/api/_definitions.json#/$defs/X" (resolved
# against https://kubernetes.io/...: a download) becomes "#/$defs/X". Cached per wheel version.
k8s_schemas() {
  local kv
  kv="$("$PY" -c 'import importlib.metadata as m; print(m.version("kubernetes-validate"))' 2>/dev/null)" \
    || die "$PY lacks kubernetes-validate (a test dependency: pip install -e '.[all]', or set WARMFLEET_TOOLS_PYTHON)"
  local out="$CACHE/schemas/kubernetes-validate-$kv/v$K8S_VERSION-standalone-strict"
  if [[ ! -f "$out/.complete" ]]; then
    log "converting kubernetes-validate $kv's v$K8S_VERSION schemas for offline use into $out"
    rm -rf "$out" && mkdir -p "$out"
    "$PY" - "$K8S_VERSION" "$out" <<'EOF' || die "schema conversion failed"
import importlib.util, json, os, re, sys
version, out = sys.argv[1], sys.argv[2]
spec = importlib.util.find_spec("kubernetes_validate")
src = os.path.join(os.path.dirname(spec.origin), "kubernetes-json-schema", f"v{version}-local-strict")
if not os.path.isdir(src):
    sys.exit(f"kubernetes-validate has no v{version}-local-strict schemas ({src})")
defs = json.load(open(os.path.join(src, "_definitions.json")))["$defs"]
REF = re.compile(r'"(?:/api/_definitions\.json)?#/\$defs/([^"]+)"')
def closure(obj):
    seen, todo = set(), [obj]
    while todo:
        for name in REF.findall(json.dumps(todo.pop())):
            if name not in seen:
                seen.add(name)
                todo.append(defs[name])
    return seen
n = 0
for f in sorted(os.listdir(src)):
    if f in ("_definitions.json", "all.json") or not f.endswith(".json"):
        continue
    schema = json.load(open(os.path.join(src, f)))
    props = schema.get("properties", {})
    if "kind" not in props or "apiVersion" not in props:  # only top-level kinds are validated
        continue
    schema.pop("$id", None)
    schema["$defs"] = {k: defs[k] for k in sorted(closure(schema))}
    text = json.dumps(schema).replace('"/api/_definitions.json#/$defs/', '"#/$defs/')
    assert "_definitions.json" not in text, f
    open(os.path.join(out, f), "w").write(text)
    n += 1
print(f"{n} standalone schemas", file=sys.stderr)
EOF
    touch "$out/.complete"
  fi
  echo "$out"
}

# CRDs of the kinds gateway mode renders (InferencePool, HTTPRoute), from their Go modules at exact versions (the
# proxy serves exact versions, not version lists), kept in the cache; printed as the files to convert.
GIE_MODULE=sigs.k8s.io/gateway-api-inference-extension@v1.6.0
GATEWAY_API_MODULE=sigs.k8s.io/gateway-api@v1.6.3
GATEWAY_CRD_FILES=(
  "$GIE_MODULE config/crd/bases/inference.networking.k8s.io_inferencepools.yaml"
  "$GATEWAY_API_MODULE config/crd/standard/gateway.networking.k8s.io_httproutes.yaml"
)

gateway_crds() {
  local entry module file dir dest out=()
  for entry in "${GATEWAY_CRD_FILES[@]}"; do
    module="${entry%% *}" file="${entry#* }"
    dest="$CACHE/crds/${module//\//_}/$(basename "$file")"
    if [[ ! -s "$dest" ]]; then
      command -v go >/dev/null 2>&1 || die "$dest is not cached and Go is not on PATH: it comes from 'GOFLAGS=-mod=mod go mod download -json $module'"
      dir="$(GOFLAGS=-mod=mod GOTOOLCHAIN=local go mod download -json "$module" \
            | "$PY" -c 'import json,sys; print(json.load(sys.stdin).get("Dir", ""))')" || true
      [[ -n "$dir" && -f "$dir/$file" ]] || die "go mod download $module gave no $file"
      mkdir -p "$(dirname "$dest")" && install -m 0644 "$dir/$file" "$dest"
    fi
    out+=("$dest")
  done
  echo "${out[@]}"
}

ensure_tools() {
  [[ -x "$PY" ]] || die "$PY not found: create the venv (make .venv/bin/warmfleet) or set WARMFLEET_TOOLS_PYTHON"
  "$PY" -c 'import yaml' 2>/dev/null || die "$PY lacks PyYAML (set WARMFLEET_TOOLS_PYTHON to the checkout's .venv/bin/python)"
  mkdir -p "$CACHE"
  exec 9>"$CACHE/.lock"
  flock 9
  KUBECONFORM="$(go_tool kubeconform github.com/yannh/kubeconform/cmd/kubeconform "$KUBECONFORM_VERSION")"
  KUBE_SCORE="$(go_tool kube-score github.com/zegl/kube-score/cmd/kube-score "$KUBE_SCORE_VERSION")"
  OPENAPI2JSONSCHEMA="$(kubeconform_src)"
  PROMTOOL="$(promtool_bin)"
  HELM="$(helm_bin)"
  K8S_SCHEMAS="$(k8s_schemas)"
  GATEWAY_CRDS="$(gateway_crds)"
  flock -u 9
  log "tools: kubeconform $KUBECONFORM_VERSION, kube-score $KUBE_SCORE_VERSION, $("$PROMTOOL" --version 2>&1 | head -n 1), helm $("$HELM" version --short 2>/dev/null)"
}

# ---------------------------------------------------------------------------------------------------
# metrics mode: promtool check metrics on live endpoints

# Lint problems kept on purpose (docs/security.md, "promtool"): the engine-prefixed names. vLLM's
# `vllm:*` names are what the Gateway API Inference Extension's endpoint picker, vLLM dashboards and users
# query; warmfleet's own `warmfleet:*` series sit beside them in the same `<engine>:` style.
KEPT_LINT='^(vllm|warmfleet):[a-zA-Z0-9_:]+ metric names should not contain '"':'"'$'

check_metrics() {
  [[ $# -gt 0 ]] || die "usage: .ci/static.sh metrics URL..."
  PROMTOOL="$(promtool_bin)"
  local url rc failed=0 body problems bad kept
  for url in "$@"; do
    body="$(mktemp)"
    if ! curl -fsS --max-time 20 "$url" -o "$body"; then
      log "FAIL $url: cannot fetch"; failed=1; rm -f "$body"; continue
    fi
    [[ -s "$body" ]] || { log "FAIL $url: empty body"; failed=1; rm -f "$body"; continue; }
    set +e
    problems="$("$PROMTOOL" check metrics <"$body" 2>&1)"
    rc=$?
    set -e
    local series; series="$(grep -c '^[a-zA-Z_:]' "$body" || true)"
    rm -f "$body"
    case $rc in
      0) log "ok   $url ($series samples, no lint problems)" ;;
      3)
        bad="$(grep -Ev "$KEPT_LINT" <<<"$problems" | grep -v '^$' || true)"
        kept="$(grep -Ec "$KEPT_LINT" <<<"$problems" || true)"
        if [[ -n "$bad" ]]; then
          log "FAIL $url: promtool check metrics found:"; echo "$bad" >&2; failed=1
        else
          log "ok   $url ($series samples; $kept kept naming findings: vllm:/warmfleet: colons, docs/security.md)"
        fi ;;
      *) log "FAIL $url: promtool check metrics exit $rc (unparsable exposition):"; echo "$problems" >&2; failed=1 ;;
    esac
  done
  [[ $failed == 0 ]] || die "promtool check metrics failed for at least one endpoint (above)"
}

# ---------------------------------------------------------------------------------------------------
# render

render_all() {  # $1 = output dir; fills chart-*.yaml and operator-*.yaml
  local out="$1"
  [[ -x "$WARMFLEET" ]] || die "$WARMFLEET not found: create the venv (make .venv/bin/warmfleet) or set WARMFLEET_BIN"
  export HELM_CACHE_HOME="$out/.helm" HELM_CONFIG_HOME="$out/.helm" HELM_DATA_HOME="$out/.helm"
  local chart=charts/warmfleet
  log "helm template $chart: defaults, everything on, everything external"
  "$HELM" template wf "$chart" --namespace warmfleet-system >"$out/chart-defaults.yaml" \
    || die "helm template (defaults) failed"
  "$HELM" template wf "$chart" --namespace warmfleet-system \
    --set metrics.serviceMonitor.enabled=true --set metrics.dashboard.enabled=true \
    --set metrics.prometheusRule.enabled=true \
    --set 'operator.watchNamespaces={ml,research}' --set operator.verbose=true \
    --set admission.enabled=true --set 'admission.allowedImagePrefixes={ghcr.io/warmfleet/,vllm/,ccr-2vdh3abv-pub.cnc.bj.baidubce.com/paddlepaddle/}' >"$out/chart-full.yaml" \
    || die "helm template (everything on) failed"
  "$HELM" template wf "$chart" --namespace warmfleet-system \
    --set crds.install=false --set rbac.create=false --set serviceAccount.create=false \
    --set serviceAccount.name=warmfleet-operator --set operator.readModelCredentials=false \
    --set operator.podDeletionCost=false >"$out/chart-external.yaml" \
    || die "helm template (external CRD/RBAC/ServiceAccount) failed"

  # Offline rendering: no hub. The hf:// (s3://) examples let the operator read config.json from the hub;
  # here they get the two values it would learn (hiddenSize, dtype: Qwen2-VL-7B's), so the same children
  # render without a download.
  export HF_HUB_OFFLINE=1 HF_ENDPOINT=http://127.0.0.1:9 AWS_ENDPOINT_URL=http://127.0.0.1:9
  local ex name input
  for ex in examples/inferenceservice*.yaml; do
    name="$(basename "$ex" .yaml)"
    input="$ex"
    if grep -Eq '^ *source: *(hf|s3)://' "$ex"; then
      input="$out/$name.input.yaml"
      "$PY" - "$ex" "$input" <<'EOF'
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
for d in docs:
    d["spec"]["model"].setdefault("hiddenSize", 3584)
    d["spec"]["model"].setdefault("dtype", "bfloat16")
yaml.safe_dump_all(docs, open(sys.argv[2], "w"), sort_keys=False)
EOF
    fi
    log "warmfleet operator render -f $ex --nodes examples/nodes.yaml"
    "$WARMFLEET" operator render -f "$input" --nodes examples/nodes.yaml >"$out/operator-$name.yaml" 2>"$out/operator-$name.log" \
      || { cat "$out/operator-$name.log" >&2; die "warmfleet operator render -f $ex failed"; }
    grep -q '^kind: Deployment' "$out/operator-$name.yaml" || die "render of $ex produced no Deployment"
  done
}

# ---------------------------------------------------------------------------------------------------
# checks

run_kubeconform() {  # $1 = work dir
  local out="$1" crd_dir="$1/crd-schemas"
  mkdir -p "$crd_dir"
  # our CRD, and the InferencePool (GIE) and HTTPRoute (Gateway API) CRDs of gateway mode, converted alike
  # shellcheck disable=SC2086  # GATEWAY_CRDS: cache paths without spaces
  (cd "$crd_dir" && "$PY" "$OPENAPI2JSONSCHEMA" "$REPO"/crds/*.yaml $GATEWAY_CRDS >/dev/null) \
    || die "openapi2jsonschema.py could not convert crds/*.yaml and the gateway CRDs ($GATEWAY_CRDS)"
  for kind in inferencepool_v1 httproute_v1; do
    [[ -f "$crd_dir/$kind.json" ]] || die "no $kind.json schema from the gateway CRDs: kubeconform would not check that kind"
  done
  log "kubeconform -strict: $(ls "$crd_dir" | tr '\n' ' ')from crds/ and $GIE_MODULE, $GATEWAY_API_MODULE; Kubernetes v$K8S_VERSION schemas"
  # ServiceMonitor and PrometheusRule (monitoring.coreos.com) are skipped: no schema of them can be had
  # offline here (the prometheus-operator module is refused by the Go module proxy); promtool and the chart
  # tests cover them.
  "$KUBECONFORM" -strict -summary -output text -kubernetes-version "$K8S_VERSION" \
    -schema-location "$K8S_SCHEMAS/{{ .ResourceKind }}{{ .KindSuffix }}.json" \
    -schema-location "$crd_dir/{{ .ResourceKind }}_{{ .ResourceAPIVersion }}.json" \
    -skip ServiceMonitor,PrometheusRule \
    "$out"/chart-*.yaml "$out"/operator-*.yaml examples/inferenceservice*.yaml examples/networkpolicy*.yaml crds/*.yaml >&2 \
    || die "kubeconform found invalid manifests (above)"
}

# kube-score findings kept on purpose, each explained in docs/security.md ("kube-score"); matched against
# its `-o ci` lines, so a kept finding is one message, never a whole test (every other line fails the run).
KUBE_SCORE_KEPT=(
  'ImagePullPolicy is not set to Always'                   # IfNotPresent by default; Always is one setting away
  'Container has the same readiness and liveness probe'    # vLLM and FastDeploy serve one health endpoint
  'Deployment does not have a host podAntiAffinity set'    # topologySpreadConstraints spread pods over nodes
  'Deployment few replicas'                                # a pool's replica count is the service's call
  'The pod does not have a matching egress NetworkPolicy'  # egress targets are cluster-specific addresses
)

run_kube_score() {  # $1 = work dir
  local out="$1" kept_re
  kept_re="$(IFS='|'; echo "${KUBE_SCORE_KEPT[*]}")"
  # The operator's children are scored with examples/networkpolicy.yaml (gateway mode's with
  # examples/networkpolicy-gateway.yaml), the ingress policies docs/security.md
  # asks users to apply (who may reach a service is the cluster's call, so the operator renders none).
  local sets=("$out/chart-defaults.yaml" "$out/chart-full.yaml" "$out/chart-external.yaml") f failed=0
  for f in "$out"/operator-*.yaml; do sets+=("$f"); done
  for f in "${sets[@]}"; do
    local extra=() rc
    [[ "$(basename "$f")" == operator-* ]] && extra=(examples/networkpolicy.yaml)
    [[ "$(basename "$f")" == operator-inferenceservice-gateway.yaml ]] && extra=(examples/networkpolicy-gateway.yaml)
    set +e
    "$KUBE_SCORE" score --kubernetes-version v1.37 --output-format ci "$f" "${extra[@]}" >"$f.kube-score" 2>&1
    rc=$?
    set -e
    [[ $rc == 0 || $rc == 1 ]] || { cat "$f.kube-score" >&2; die "kube-score could not score $f (exit $rc)"; }
    local findings bad kept
    findings="$(grep -E '^\[(CRITICAL|WARNING)\]' "$f.kube-score" || true)"
    bad="$(grep -Ev "$kept_re" <<<"$findings" | grep -v '^$' || true)"
    kept="$(grep -Ec "$kept_re" <<<"$findings" || true)"
    if [[ -n "$bad" ]]; then
      log "kube-score FAIL: $(basename "$f")"; echo "$bad" >&2; failed=1
    else
      log "kube-score ok: $(basename "$f") ($(grep -c '^\[OK\]' "$f.kube-score" || true) checks passed, $kept kept findings)"
    fi
  done
  [[ $failed == 0 ]] || die "kube-score found problems (above): fix them, or keep them with a reason in docs/security.md and KUBE_SCORE_KEPT"
}

run_promtool_rules() {  # $1 = work dir
  local out="$1" rules="$1/rules"
  mkdir -p "$rules"
  "$PY" - "$rules" charts/warmfleet/files/dashboard.json "$out"/chart-*.yaml <<'EOF' || die "could not collect PromQL expressions"
import json, re, sys, yaml
out, dashboard, manifests = sys.argv[1], sys.argv[2], sys.argv[3:]

# Grafana's variables, substituted with what they stand for at query time.
GRAFANA = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h", "$__interval_ms": "60000",
           "$__range_s": "3600", "$__range_ms": "3600000"}
def grafana(expr):
    for k in sorted(GRAFANA, key=len, reverse=True):
        expr = expr.replace(k, GRAFANA[k]).replace("${" + k[1:] + "}", GRAFANA[k])
    return re.sub(r"\$\{?[A-Za-z_][A-Za-z0-9_]*(?::[a-z]+)?\}?", "var", expr)  # dashboard variables

exprs = []
def walk(o, where):
    if isinstance(o, dict):
        title = o.get("title", where)
        if isinstance(o.get("expr"), str) and o["expr"].strip():
            exprs.append((f"{title} [{o.get('refId', '?')}]", grafana(o["expr"])))
        for v in o.values():
            walk(v, title)
    elif isinstance(o, list):
        for v in o:
            walk(v, where)
walk(json.load(open(dashboard)), "dashboard")
if not exprs:
    sys.exit(f"{dashboard}: no PromQL expression found")
rules = [{"record": f"dashboard:panel_{i}:expr", "expr": e, "labels": {"panel": t[:120]}} for i, (t, e) in enumerate(exprs)]
yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}, open(f"{out}/dashboard.rules.yaml", "w"), sort_keys=False)
print(f"{len(exprs)} dashboard expressions", file=sys.stderr)

n = 0
seen = set()
for path in manifests:
    for doc in yaml.safe_load_all(open(path)):
        if doc and doc.get("kind") == "PrometheusRule":
            key = doc["metadata"]["name"]
            if key in seen:
                continue
            seen.add(key)
            n += 1
            yaml.safe_dump({"groups": doc["spec"]["groups"]}, open(f"{out}/prometheusrule-{key}.rules.yaml", "w"), sort_keys=False)
print(f"{n} PrometheusRule objects", file=sys.stderr)
EOF
  log "promtool check rules: $(cd "$rules" && ls)"
  "$PROMTOOL" check rules "$rules"/*.rules.yaml >&2 || die "promtool check rules failed (above)"
  # the alerts' unit tests (tests/alerts): each alert fires on its series at the chart's default thresholds
  local alerts="$rules/prometheusrule-wf-warmfleet.rules.yaml"
  [[ -f "$alerts" ]] || die "the chart rendered no PrometheusRule with metrics.prometheusRule.enabled=true"
  cp "$alerts" "$rules/warmfleet.rules.yaml" && cp tests/alerts/*.test.yaml "$rules/"
  log "promtool test rules: $(cd tests/alerts && ls)"
  (cd "$rules" && "$PROMTOOL" test rules ./*.test.yaml) >&2 || die "promtool test rules failed (above)"
}

check_all() {
  local t0; t0=$(date +%s)
  ensure_tools
  if [[ -n "${WARMFLEET_STATIC_KEEP:-}" ]]; then
    WORK="$WARMFLEET_STATIC_KEEP"; rm -rf "$WORK"; mkdir -p "$WORK"
  else
    WORK="$(mktemp -d)"; trap 'rm -rf "$WORK"' EXIT
  fi
  local work="$WORK"
  local t1; t1=$(date +%s)
  log "== render"; render_all "$work"
  log "== kubeconform"; run_kubeconform "$work"
  log "== kube-score"; run_kube_score "$work"
  log "== promtool"; run_promtool_rules "$work"
  log "all static checks passed in $(( $(date +%s) - t0 ))s (tools $(( t1 - t0 ))s)"
}

case "${1:-check}" in
  check) check_all ;;
  metrics) shift; check_metrics "$@" ;;
  tools) ensure_tools; echo "$(dirname "$KUBECONFORM") $(dirname "$KUBE_SCORE") $(dirname "$PROMTOOL")" ;;
  -h|--help|help) sed -n '2,30p' "$0" ;;
  *) die "unknown mode '$1' (check | metrics URL... | tools)" ;;
esac
