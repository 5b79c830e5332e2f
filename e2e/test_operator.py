"""The chart and the operator against a real control plane (issue 6, steps 1-6).

The session fixtures (conftest.py) `helm install` charts/warmfleet, scale the chart's own operator
Deployment to 0 and run `warmfleet operator run` locally with nothing but the chart's
ServiceAccount token, then `kubectl apply -f examples/inferenceservice.yaml`. Tests marked
`destructive` (delete, uninstall) run after every other e2e test.
"""

from __future__ import annotations

import copy
import hashlib
import re
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from conftest import (CHART, CRD_NAME, EXAMPLE, SERVING_LABEL, Example, LocalOperator, Release, is_ready, model_store)
from e2e_support import Cluster, wait_for
from warmfleet.kube import is_subset

REPO = Path(__file__).resolve().parent.parent
SERVICE_LABEL = "serving.warmfleet.io/service"
COMPONENT_LABEL = "app.kubernetes.io/component"
SIZING_HASH = "serving.warmfleet.io/sizing-hash"
CHILD_KINDS = ["configmap", "serviceaccount", "role.rbac.authorization.k8s.io",
               "rolebinding.rbac.authorization.k8s.io", "service", "deployment.apps",
               "poddisruptionbudget.policy"]
UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9}


def quantity(q: str) -> int:
    m = re.fullmatch(r"(\d+)([A-Za-z]*)", q)
    assert m, q
    return int(m.group(1)) * UNITS.get(m.group(2), 1)


def docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def wfis(c: Cluster, ex: Example) -> dict[str, Any]:
    return c.kubectl_json("-n", ex.namespace, "get", "wfis", ex.name)


def deployments(c: Cluster, ex: Example) -> dict[str, dict[str, Any]]:
    items = c.kubectl_json("-n", ex.namespace, "get", "deployments", "-l", f"{SERVICE_LABEL}={ex.name}")["items"]
    return {d["metadata"]["name"]: d for d in items}


def replica_sets(c: Cluster, ex: Example) -> dict[str, set[str]]:
    """Deployment name -> names of the ReplicaSets it owns (one per pod template ever rolled out)."""
    out: dict[str, set[str]] = {}
    for rs in c.kubectl_json("-n", ex.namespace, "get", "replicasets", "-l", f"{SERVICE_LABEL}={ex.name}")["items"]:
        owner = next(r["name"] for r in rs["metadata"]["ownerReferences"] if r["kind"] == "Deployment")
        out.setdefault(owner, set()).add(rs["metadata"]["name"])
    return out


def settled(c: Cluster, ex: Example) -> dict[str, Any] | None:
    """The service when it is Ready for its current generation and every Deployment finished rolling out."""
    svc = wfis(c, ex)
    st = svc.get("status") or {}
    if not is_ready(svc) or st.get("observedGeneration") != svc["metadata"]["generation"]:
        return None
    # the operator has caught up with the Deployments' readiness (it writes status asynchronously)
    if st.get("readyReplicas") != st.get("replicas") or any(p["readyReplicas"] != p["replicas"] for p in st["pools"]):
        return None
    for d in deployments(c, ex).values():
        ds, want = d.get("status") or {}, d["spec"]["replicas"]
        if ds.get("observedGeneration") != d["metadata"]["generation"]:
            return None
        if not (ds.get("replicas", 0) == ds.get("updatedReplicas", 0) == ds.get("readyReplicas", 0) == want):
            return None
    return svc


def wait_settled(c: Cluster, ex: Example, what: str = "the service to settle") -> dict[str, Any]:
    return wait_for(lambda: settled(c, ex), 180, what)


def rollout_state(c: Cluster, ex: Example) -> dict[str, tuple[str, str, frozenset[str]]]:
    """Per Deployment: sizing hash, the template's args digest and its ReplicaSets."""
    rs = replica_sets(c, ex)
    out = {}
    for name, d in deployments(c, ex).items():
        tpl = d["spec"]["template"]
        out[name] = ((tpl["metadata"].get("annotations") or {}).get(SIZING_HASH, ""),
                     repr(tpl["spec"]["containers"][0]["args"]), frozenset(rs.get(name, ())))
    return out


def kwok_node(name: str, labels: dict[str, str], *, gpus: int, memory: str, cpu: str) -> dict[str, Any]:
    """A fake node kwok manages (same shape as e2e/cluster.sh's nodes)."""
    alloc = {"cpu": cpu, "memory": memory, "ephemeral-storage": "7Ti", "pods": "110", "nvidia.com/gpu": str(gpus)}
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
                     "labels": {"kubernetes.io/arch": "amd64", "kubernetes.io/os": "linux", "kubernetes.io/hostname": name,
                                "type": "kwok", "topology.kubernetes.io/zone": "e2e-zone-a", "nvidia.com/gpu.present": "true",
                                **labels}},
        "status": {"addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": name}],
                   "capacity": dict(alloc), "allocatable": dict(alloc)},
    }


# ---- 1. helm install, CRD Established, lint/template agree with what got installed ----

def test_helm_install_establishes_crd_and_matches_template(e2e_cluster: Cluster, release: Release,
                                                           tmp_path: Path) -> None:
    c = e2e_cluster
    lint = c.helm("lint", "--strict", str(CHART))
    assert "0 chart(s) failed" in lint.stdout, lint.stdout
    assert "kind: InferenceService" in release.install_output  # NOTES.txt: an inline example, no clone assumed
    assert "warmfleet operator render" in release.install_output
    crd = c.kubectl_json("get", "crd", CRD_NAME)
    conds = {x["type"]: x["status"] for x in crd["status"]["conditions"]}
    assert conds.get("Established") == "True" and conds.get("NamesAccepted") == "True", conds
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert crd["status"]["acceptedNames"]["shortNames"] == ["wfis"]

    rendered = docs(c.helm("template", release.name, str(CHART), "--namespace", release.namespace).stdout)
    installed = docs(c.helm("get", "manifest", release.name, "--namespace", release.namespace).stdout)
    assert rendered == installed, "helm template and the installed release manifest differ"
    kinds = sorted(f"{d['kind']}/{d['metadata']['name']}" for d in rendered)
    assert kinds == sorted([
        f"ClusterRole/{release.name}-app", f"ClusterRole/{release.name}-kopf",
        f"ClusterRoleBinding/{release.name}-app", f"ClusterRoleBinding/{release.name}-kopf",
        f"CustomResourceDefinition/{CRD_NAME}", f"Deployment/{release.name}-operator",
        f"NetworkPolicy/{release.name}-operator", f"ServiceAccount/{release.name}",
        # leader election (operator.replicas 2 by default): the Lease's Role and its binding, a PodDisruptionBudget
        # keeping one operator through drains; the operator's own /metrics Service (its ServiceMonitor is opt-in)
        f"Role/{release.name}-operator-lease", f"RoleBinding/{release.name}-operator-lease",
        f"PodDisruptionBudget/{release.name}-operator", f"Service/{release.name}-operator-metrics"]), kinds
    namespaced = ("Deployment", "ServiceAccount", "NetworkPolicy", "Role", "RoleBinding", "PodDisruptionBudget", "Service")
    for want in rendered:  # every rendered field is live (the API server may only add defaults)
        assert want["metadata"].get("namespace") == (release.namespace if want["kind"] in namespaced else None), want["kind"]
        ns = ["-n", release.namespace] if want["kind"] in namespaced else []
        live = c.kubectl_json(*ns, "get", f"{want['kind']}.{want['apiVersion'].split('/')[0]}"
                              if "/" in want["apiVersion"] else want["kind"], want["metadata"]["name"])
        if want["kind"] == "Deployment":  # scaled to 0 by the fixture so only the local operator acts
            assert want["spec"]["replicas"] == 2  # a leader and a standby
            want = copy.deepcopy(want)
            want["spec"].pop("replicas")
            for ctr in want["spec"]["template"]["spec"]["containers"]:  # the API omits an empty env value (omitempty):
                for e in ctr.get("env", []):                             # the variable is set, to ""
                    if e.get("value") == "":
                        del e["value"]
        assert is_subset(want, live), f"{want['kind']}/{want['metadata']['name']} differs from helm template"

    # The chart's CRD template is the committed crds/ file (both generated from operator/spec/).
    committed = yaml.safe_load((REPO / "crds" / f"{CRD_NAME}.yaml").read_text())
    chart_crd = next(d for d in rendered if d["kind"] == "CustomResourceDefinition")
    assert chart_crd["spec"] == committed["spec"]
    assert is_subset(committed["spec"], crd["spec"])


# ---- 2. the operator runs under the chart's ServiceAccount ----

def test_operator_runs_under_the_charts_service_account(e2e_cluster: Cluster, release: Release,
                                                         local_operator: LocalOperator, example: Example) -> None:
    c = e2e_cluster
    sa = c.as_kubeconfig(local_operator.kubeconfig)
    who = sa.kubectl_json("auth", "whoami")["status"]["userInfo"]["username"]
    assert who == f"system:serviceaccount:{release.namespace}:{release.service_account}"
    assert "client-certificate" not in local_operator.kubeconfig.read_text()
    dep = c.kubectl_json("-n", release.namespace, "get", "deployment", f"{release.name}-operator")
    assert dep["spec"]["replicas"] == 0 and not (dep.get("status") or {}).get("replicas")

    def can(verb: str, resource: str, ns: str | None = None) -> bool:
        args = ["auth", "can-i", verb, resource] + (["-n", ns] if ns else ["--all-namespaces"])
        return sa.kubectl(*args, check=False).stdout.strip() == "yes"

    for verb, res in [("watch", "nodes"), ("patch", "inferenceservices.serving.warmfleet.io/status"),
                      ("create", "deployments.apps"), ("delete", "deployments.apps"), ("create", "events"),
                      ("create", "poddisruptionbudgets.policy"), ("create", "roles.rbac.authorization.k8s.io"),
                      ("watch", "endpointslices.discovery.k8s.io"), ("list", "pods"), ("watch", "pods"),
                      ("get", "pods"), ("patch", "pods"),  # the autoscaler's pod-deletion cost (operator.podDeletionCost)
                      ("get", "persistentvolumeclaims"), ("get", "secrets")]:
        assert can(verb, res), f"the chart's RBAC lacks {verb} {res}"
    # why-not-Ready reads pods through a watch and GETs claims by name; Secrets are named by the kubelet,
    # and only GET by name (spec.model.credentialsSecret, to read a private model's config.json)
    for verb, res in [("list", "secrets"), ("watch", "secrets"), ("delete", "configmaps"),
                      ("delete", "inferenceservices.serving.warmfleet.io"), ("create", "clusterroles.rbac.authorization.k8s.io"),
                      ("create", "pods"), ("delete", "pods"),
                      ("list", "persistentvolumeclaims"), ("patch", "nodes")]:
        assert not can(verb, res), f"the chart's RBAC grants more than needed: {verb} {res}"
    # patching pods (the deletion-cost annotation) is not patching their status ("pods/status" alone would name a pod)
    assert sa.kubectl("auth", "can-i", "patch", "pods", "--subresource=status", "--all-namespaces",
                      check=False).stdout.strip() == "no"
    denied = local_operator.denials()  # a refusal of the chart's RBAC
    assert not denied, "\n".join(denied)


# ---- 3. kubectl apply -f examples/...: children, Ready, printer columns, pools, memory ----

def test_example_children_status_columns_and_pools(e2e_cluster: Cluster, example: Example) -> None:
    c = e2e_cluster
    svc = wait_settled(c, example)
    uid, st, spec = svc["metadata"]["uid"], svc["status"], svc["spec"]
    # defaults from the CRD schema were applied by the API server
    assert spec["cache"]["blockSize"] == 64 and spec["router"]["loadBound"] == 1.25

    children = c.kubectl_json("-n", example.namespace, "get", ",".join(CHILD_KINDS), "-l",
                              f"{SERVICE_LABEL}={example.name}")["items"]
    names = sorted(f"{o['kind']}/{o['metadata']['name']}" for o in children)
    server_deps = sorted(o["metadata"]["name"] for o in children
                         if o["kind"] == "Deployment" and o["metadata"]["labels"][COMPONENT_LABEL] == "server")
    n = example.name
    assert names == sorted([f"ConfigMap/{n}-config", f"ServiceAccount/{n}-router", f"Role/{n}-router",
                            f"RoleBinding/{n}-router", f"Service/{n}-replicas", f"Service/{n}", f"Service/{n}-router-peers",
                            f"PodDisruptionBudget/{n}-server", f"PodDisruptionBudget/{n}-router", f"Deployment/{n}-router",
                            *(f"Deployment/{d}" for d in server_deps)]), names
    assert len(server_deps) == 2
    for o in children:
        refs = o["metadata"].get("ownerReferences") or []
        assert [(r["kind"], r["name"], r["uid"], r.get("controller")) for r in refs] == \
            [("InferenceService", n, uid, True)], (o["kind"], o["metadata"]["name"], refs)
    headless = next(o for o in children if o["kind"] == "Service" and o["metadata"]["name"] == f"{n}-replicas")
    assert headless["spec"]["clusterIP"] == "None"

    # Ready once kwok marked the pods ready; observedGeneration and counts
    assert st["ready"] == "True" and st["observedGeneration"] == svc["metadata"]["generation"]
    assert st["readyReplicas"] == st["desiredReplicas"] == spec["replicas"] == 12
    conds = {x["type"]: (x["status"], x["reason"]) for x in st["conditions"]}
    # the fixture pins warmfleet's engine on these (fake) GPU nodes: Ready, with the EngineFit warning
    assert conds == {"Ready": ("True", "AllReplicasReady"), "Progressing": ("False", "Stable"),
                     "Degraded": ("False", "AsExpected"), "InvalidSpec": ("False", "SpecValid"),
                     "EngineFit": ("False", "NoGPUAttentionBackend"), "GPUMemoryKnown": ("True", "GPUMemoryFound"),
                     "TaintsTolerated": ("True", "AllTaintsTolerated")}, conds
    assert st["engine"]["kind"] == "warmfleet" and st["engine"]["chosenBy"] == "spec"

    # printer columns
    table = c.kubectl("-n", example.namespace, "get", "wfis", n).stdout.splitlines()
    assert table[0].split() == ["NAME", "READY", "REASON", "REPLICAS", "DESIRED", "MODEL", "ENGINE", "ENDPOINT", "AGE"], table
    assert table[1].split()[:8] == [n, "True", "AllReplicasReady", "12", "12", "qwen2-vl-7b", "warmfleet",
                                    f"http://{n}.{example.namespace}.svc:8000/v1"]
    assert n in c.kubectl("-n", example.namespace, "get", "warmfleet", "-o", "name").stdout  # category

    # both pools, sized differently, on the nodes of their shape
    nodes = {x["metadata"]["name"]: x for x in c.kubectl_json("get", "nodes", "-l", f"{SERVING_LABEL}=true")["items"]}
    pools = {p["shape"]["gpuProduct"]: p for p in st["pools"]}
    assert sorted(pools) == ["NVIDIA-H200", "NVIDIA-L4"], sorted(pools)
    for product, p in pools.items():
        want_nodes = sorted(k for k, v in nodes.items() if v["metadata"]["labels"]["nvidia.com/gpu.product"] == product)
        assert sorted(p["nodes"]) == want_nodes and p["fits"] and p["replicas"] == 6 == p["readyReplicas"]
    h, l4 = pools["NVIDIA-H200"]["sizes"], pools["NVIDIA-L4"]["sizes"]
    for key in ("swapSpaceGib", "encoderCacheTokens", "memoryBytes"):
        assert h[key] > l4[key], (key, h[key], l4[key])
    assert h["swapSpaceGib"] <= spec["cache"]["swapSpace"]["max"]

    # pod memory requests = the pool's size, and they fit the nodes they were scheduled on
    pods = c.kubectl_json("-n", example.namespace, "get", "pods", "-l",
                          f"{SERVICE_LABEL}={n},{COMPONENT_LABEL}=server")["items"]
    assert len(pods) == 12
    per_node: dict[str, int] = {}
    for pod in pods:
        node = nodes[pod["spec"]["nodeName"]]
        product = node["metadata"]["labels"]["nvidia.com/gpu.product"]
        res = pod["spec"]["containers"][0]["resources"]
        mem = quantity(res["requests"]["memory"])
        assert mem == quantity(res["limits"]["memory"]) == pools[product]["sizes"]["memoryBytes"]
        args = pod["spec"]["containers"][0]["args"]
        assert float(args[args.index("--swap-space") + 1]) == pools[product]["sizes"]["swapSpaceGib"]
        assert int(args[args.index("--max-encoder-cache") + 1]) == pools[product]["sizes"]["encoderCacheTokens"]
        per_node[node["metadata"]["name"]] = per_node.get(node["metadata"]["name"], 0) + mem
    all_pods = c.kubectl_json("get", "pods", "--all-namespaces")["items"]
    for node_name in per_node:
        used = sum(quantity(ct["resources"].get("requests", {}).get("memory", "0"))
                   for p in all_pods if p["spec"].get("nodeName") == node_name for ct in p["spec"]["containers"])
        assert used <= quantity(nodes[node_name]["status"]["allocatable"]["memory"]), (node_name, used)


# ---- 4. bad objects are refused with a readable message ----

BASE = {"apiVersion": "serving.warmfleet.io/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": "bad"}, "spec": {"model": {"path": "/models/m"}}}


def _with(**spec: Any) -> dict[str, Any]:
    obj = copy.deepcopy(BASE)
    obj["spec"].update(spec)
    return obj


# (id, object, expected message fragments); CEL rules are named by their message
CREATE_CASES = [
    ("cel-fixed-needs-size-gib", _with(cache={"swapSpace": {"mode": "Fixed"}}),
     ["spec.cache.swapSpace", "size is required when mode is Fixed"]),
    ("cel-fixed-needs-size-tokens", _with(cache={"encoderCache": {"mode": "Fixed"}}),
     ["spec.cache.encoderCache", "size is required when mode is Fixed"]),
    ("cel-node-tier-manual-needs-size", _with(cache={"nodeTier": {"mode": "Manual"}}),
     ["spec.cache.nodeTier", "size is required when mode is Manual"]),
    ("cel-min-le-max-node-tier", _with(cache={"nodeTier": {"mode": "Auto", "min": 8, "max": 2}}),
     ["spec.cache.nodeTier", "min must be <= max"]),
    ("cel-min-le-max-gib", _with(cache={"processorCache": {"min": 8, "max": 2}}),
     ["spec.cache.processorCache", "min must be <= max"]),
    ("cel-min-le-max-tokens", _with(cache={"encoderCache": {"min": 9000, "max": 10}}),
     ["spec.cache.encoderCache", "min must be <= max"]),
    ("cel-autoscaling-bounds", _with(autoscaling={"minReplicas": 5, "maxReplicas": 2}),
     ["spec.autoscaling", "minReplicas must be <= maxReplicas"]),
    ("cel-autoscaling-unique-pools", _with(autoscaling={"maxReplicas": 4, "pools": [{"name": "a"}, {"name": "a"}]}),
     ["spec.autoscaling", "autoscaling pool names must be unique"]),
    ("cel-autoscaling-pool-bounds", _with(autoscaling={"maxReplicas": 4, "pools": [{"name": "a", "minReplicas": 3, "maxReplicas": 1}]}),
     ["spec.autoscaling.pools[0]", "minReplicas must be <= maxReplicas"]),
    ("cel-unique-pool-names", _with(pools=[{"name": "a"}, {"name": "a"}]),
     ["spec.pools[1]: Duplicate value", "pool names must be unique"]),
    ("cel-adapters-need-lora", _with(adapters=[{"name": "sql", "source": "/adapters/sql"}]),
     ["spec", "adapters need spec.lora (the limits every replica starts with)"]),
    ("cel-unique-adapter-names", _with(lora={"maxLoras": 1}, adapters=[{"name": "a", "source": "/a"}, {"name": "a", "source": "/b"}]),
     ["spec", "adapter names must be unique"]),
    ("cel-lora-cpu-loras", _with(lora={"maxLoras": 4, "maxCpuLoras": 2}),
     ["spec.lora", "maxCpuLoras must be >= maxLoras"]),
    ("cel-adapter-source", _with(lora={"maxLoras": 1}, adapters=[{"name": "a", "source": "ftp://x"}]),
     ["spec.adapters[0]", "source must be"]),
    ("schema-enum", _with(cache={"blockSize": 48}),
     ["spec.cache.blockSize: Unsupported value: 48", '"16", "32", "64", "128", "256"']),
    ("schema-minimum", _with(server={"gpusPerReplica": -1}),  # 0 is allowed: CPU-only replicas (engine warmfleet)
     ["spec.server.gpusPerReplica", "greater than or equal to 0"]),
    ("schema-maximum", _with(cache={"encoderFraction": 0.9}),
     ["spec.cache.encoderFraction", "less than or equal to 0.5"]),
    ("schema-pattern", {**BASE, "spec": {"model": {"path": "/m", "pvc": "Not_A_Name"}}},
     ["spec.model.pvc", "should match"]),
    ("schema-required", {**BASE, "spec": {"replicas": 1}}, ["spec.model: Required value"]),
    ("cel-source-xor-path", _with(model={"source": "hf://Qwen/Qwen2-VL-2B-Instruct", "path": "/m"}),
     ["spec.model", "exactly one of source and path is required (source is preferred)"]),
    ("cel-source-form", _with(model={"source": "hf://just-a-name"}),
     ["spec.model", "source must be hf://ORG/NAME[@REVISION], s3://BUCKET[/PREFIX], pvc://CLAIM[/PATH] or an absolute path, "
                    "without '..' segments"]),
    ("cel-source-dotdot", _with(model={"source": "pvc://store/../other"}), ["without '..' segments"]),
    ("cel-pvc-goes-with-path", _with(model={"source": "pvc://store/m", "pvc": "store"}),
     ["pvc goes with path; with source, write pvc://CLAIM/PATH"]),
    ("cel-download-settings", _with(model={"path": "/m", "credentialsSecret": "hf"}),
     ["cache and credentialsSecret apply to hf:// and s3:// sources only"]),
    ("cel-hub-for-hf", _with(model={"source": "s3://models/qwen", "hub": {"endpoint": "https://hub.example"}}),
     ["hub applies to hf:// sources only"]),
    ("cel-s3-for-s3", _with(model={"source": "hf://Qwen/Qwen2-VL-2B-Instruct", "s3": {"region": "eu-west-1"}}),
     ["s3 applies to s3:// sources only"]),
    ("cel-cache-one-kind", _with(model={"source": "hf://Qwen/Qwen2-VL-2B-Instruct", "cache": {"hostPath": "/c", "pvc": "c"}}),
     ["spec.model.cache", "hostPath and pvc are mutually exclusive"]),
    ("cel-gateway-needs-mode-gateway", _with(router={"gateway": {"name": "gw"}}),
     ["spec.router", "gateway applies to mode gateway only"]),
    ("schema-type", _with(replicas="three"),
     ["spec.replicas", "must be of type integer"]),
    ("schema-unknown-field", _with(cache={"swapSpaceGib": 4}),
     ['unknown field "spec.cache.swapSpaceGib"']),
]


@pytest.mark.parametrize("case", CREATE_CASES, ids=[x[0] for x in CREATE_CASES])
def test_bad_objects_are_refused_with_a_readable_message(e2e_cluster: Cluster, release: Release,
                                                         namespace: str, case) -> None:
    _, obj, fragments = case
    obj = copy.deepcopy(obj)
    obj["metadata"]["namespace"] = namespace
    r = e2e_cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump(obj), check=False)
    assert r.returncode != 0, f"the API server accepted {obj['spec']}"
    for frag in fragments:
        assert frag in r.stderr, f"{frag!r} not in: {r.stderr}"
    assert e2e_cluster.kubectl("-n", namespace, "get", "wfis", "bad", check=False).returncode != 0


def test_served_name_is_immutable(e2e_cluster: Cluster, example: Example) -> None:
    c = e2e_cluster
    for patch in (['--type', 'merge', '-p', '{"spec":{"model":{"servedName":"renamed"}}}'],
                  ['--type', 'json', '-p', '[{"op":"remove","path":"/spec/model/servedName"}]']):
        r = c.kubectl("-n", example.namespace, "patch", "wfis", example.name, *patch, check=False)
        assert r.returncode != 0 and "spec.model: Invalid value" in r.stderr \
            and "model.servedName is immutable" in r.stderr, r.stderr
    assert wfis(c, example)["spec"]["model"]["servedName"] == "qwen2-vl-7b"


def test_every_cel_rule_has_a_refusal_case(e2e_cluster: Cluster, release: Release) -> None:
    """A new x-kubernetes-validations rule must come with a case above."""
    schema = e2e_cluster.kubectl_json("get", "crd", CRD_NAME)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    messages: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for rule in node.get("x-kubernetes-validations", []):
                messages.add(rule["message"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(schema)
    covered = {frag for _, _, frags in CREATE_CASES for frag in frags} | {"model.servedName is immutable"}
    assert messages and messages <= covered, sorted(messages - covered)


# ---- 5. node changes, spec change, operator restart ----

@pytest.fixture
def extra_nodes(e2e_cluster: Cluster, example: Example) -> Iterator[list[str]]:
    made: list[str] = []
    yield made
    if made:
        e2e_cluster.kubectl("delete", "node", *made, "--ignore-not-found")
        wait_for(lambda: len(wfis(e2e_cluster, example)["status"]["pools"]) == 2, 60,
                 "the pools to shrink back to H200 + L4")
        wait_settled(e2e_cluster, example, "the service to settle after removing the extra nodes")


def test_node_changes_new_shape_makes_a_pool_relabel_into_existing_shape_restarts_nothing(
        e2e_cluster: Cluster, example: Example, extra_nodes: list[str]) -> None:
    c = e2e_cluster
    wait_settled(c, example)
    before = rollout_state(c, example)

    # A node with a new shape (8xA100-80GB, 1 TiB) joins: a third pool and Deployment appear;
    # the existing pools keep their pod templates (replica counts may move between pools).
    a100 = kwok_node("gpu-a100-e2e", {SERVING_LABEL: "true", "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB",
                                      "nvidia.com/gpu.memory": "81920", "nvidia.com/gpu.count": "8"},
                     gpus=8, memory="1Ti", cpu="128")
    extra_nodes.append("gpu-a100-e2e")
    c.apply(a100)
    wait_for(lambda: len(wfis(c, example)["status"]["pools"]) == 3, 60, "a third pool for the A100 node")
    svc = wait_settled(c, example, "the service to settle with three pools")
    pools = {p["shape"]["gpuProduct"]: p for p in svc["status"]["pools"]}
    assert pools["NVIDIA-A100-SXM4-80GB"]["nodes"] == ["gpu-a100-e2e"] and pools["NVIDIA-A100-SXM4-80GB"]["replicas"] > 0
    after_add = rollout_state(c, example)
    assert set(after_add) - set(before) == {next(n for n in after_add if "a100" in n)}
    for name, state in before.items():
        assert after_add[name] == state, f"{name} rolled although its pool did not change"

    # An unselected H200-shaped node is relabelled into the selector: it joins the existing
    # H200 pool; no Deployment appears or goes, no pod template changes, nothing rolls.
    spare = kwok_node("gpu-h200-spare", {"nvidia.com/gpu.product": "NVIDIA-H200", "nvidia.com/gpu.memory": "143771",
                                         "nvidia.com/gpu.count": "8"}, gpus=8, memory="2Ti", cpu="192")
    extra_nodes.append("gpu-h200-spare")
    c.apply(spare)
    wait_for(lambda: is_ready(c.kubectl_json("get", "node", "gpu-h200-spare")), 60, "the spare node Ready")
    members = lambda pools: {p["name"]: (p["nodes"], p["sizes"]) for p in pools}  # noqa: E731
    assert members(wfis(c, example)["status"]["pools"]) == members(svc["status"]["pools"])  # not selected
    c.kubectl("label", "node", "gpu-h200-spare", f"{SERVING_LABEL}=true")
    wait_for(lambda: "gpu-h200-spare" in next(p for p in wfis(c, example)["status"]["pools"]
                                              if p["shape"]["gpuProduct"] == "NVIDIA-H200")["nodes"],
             60, "the relabelled node in the H200 pool")
    svc2 = wait_settled(c, example, "the service to settle after the relabel")
    assert len(svc2["status"]["pools"]) == 3
    for old, new in zip(svc["status"]["pools"], svc2["status"]["pools"]):
        assert (old["name"], old["sizes"]) == (new["name"], new["sizes"])
    assert rollout_state(c, example) == after_add, "a relabel into an existing shape rolled something"


def test_spec_change_rolls_each_deployment_exactly_once(e2e_cluster: Cluster, example: Example) -> None:
    c = e2e_cluster
    svc = wait_settled(c, example)
    deps_before = deployments(c, example)
    rs_before = replica_sets(c, example)
    block = 32 if svc["spec"]["cache"]["blockSize"] != 32 else 128
    c.kubectl("-n", example.namespace, "patch", "wfis", example.name, "--type", "merge",
              "-p", f'{{"spec":{{"cache":{{"blockSize":{block}}}}}}}')
    gen = svc["metadata"]["generation"] + 1
    wait_for(lambda: wfis(c, example)["status"]["observedGeneration"] == gen, 60, "the operator to see the change")
    wait_for(lambda: settled(c, example) and all(
        f"{block}" in d["spec"]["template"]["spec"]["containers"][0]["args"] for d in deployments(c, example).values()),
        # a rolling update steps one pod at a time (maxUnavailable 1, no surge); kwok honours each old
        # pod's termination grace, so this takes from seconds to about a minute
        240, "every Deployment rolled out with the new block size")
    deps_after, rs_after = deployments(c, example), replica_sets(c, example)
    assert set(deps_after) == set(deps_before)
    for name, before in deps_before.items():
        after = deps_after[name]
        assert after["metadata"]["generation"] == before["metadata"]["generation"] + 1, \
            f"{name}: generation {before['metadata']['generation']} -> {after['metadata']['generation']}"
        new_rs = rs_after[name] - rs_before[name]
        assert len(new_rs) == 1 and rs_before[name] <= rs_after[name], (name, rs_before[name], rs_after[name])
        (rs_name,) = new_rs
        hash_ = c.kubectl_json("-n", example.namespace, "get", "rs", rs_name)["metadata"]["labels"]["pod-template-hash"]
        sel = ",".join(f"{k}={v}" for k, v in after["spec"]["selector"]["matchLabels"].items())
        pods = c.kubectl_json("-n", example.namespace, "get", "pods", "-l", sel)["items"]
        live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        assert live and {p["metadata"]["labels"]["pod-template-hash"] for p in live} == {hash_}
        args = after["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--block-size") + 1] == str(block)
    assert wfis(c, example)["status"]["observedGeneration"] == gen


def test_operator_restart_changes_nothing(e2e_cluster: Cluster, example: Example,
                                          local_operator: LocalOperator) -> None:
    c = e2e_cluster
    wait_settled(c, example)

    def snapshot() -> dict[str, Any]:
        objs = c.kubectl_json("-n", example.namespace, "get", ",".join(CHILD_KINDS), "-l",
                              f"{SERVICE_LABEL}={example.name}")["items"]
        out: dict[str, Any] = {}
        for o in objs:
            key = f"{o['kind']}/{o['metadata']['name']}"
            # status-bearing kinds change resourceVersion on status updates: compare what the operator writes
            if o["kind"] in ("Deployment", "PodDisruptionBudget"):
                out[key] = (o["metadata"]["uid"], o["metadata"]["generation"], repr(o["spec"]))
            else:
                out[key] = (o["metadata"]["uid"], o["metadata"]["resourceVersion"])
        svc = wfis(c, example)
        out["status"] = svc["status"]
        out["replicasets"] = replica_sets(c, example)
        return out

    # settled and quiet: the same snapshot twice, 3 s apart (pod events from kwok may still move a condition)
    def quiet() -> dict[str, Any] | None:
        first = snapshot()
        time.sleep(3)
        return first if snapshot() == first else None

    before = wait_for(quiet, 60, "the service's objects and status to stay the same for 3 s")
    local_operator.stop()
    local_operator.start()
    marker = "Handler 'make_registry.<locals>.reconcile_service' succeeded"
    wait_for(lambda: local_operator.count(marker) >= 1, 60, "the restarted operator's resume pass")
    assert snapshot() == before
    assert "reconciled:" not in local_operator.log(), local_operator.log()  # no child written, no status written


# ---- 5b. vLLM and FastDeploy engines reconcile like warmfleet ----

PEER_EXAMPLES = {"vllm": REPO / "examples" / "inferenceservice-vllm.yaml",
                 "fastdeploy": REPO / "examples" / "inferenceservice-fastdeploy.yaml"}
PEER_COMMANDS = {"vllm": ["python3", "-m", "vllm.entrypoints.openai.api_server"],
                 "fastdeploy": ["python3", "-m", "fastdeploy.entrypoints.openai.api_server"]}
PEER_PORTS = {"vllm": ["http", "kv-events", "kv-replay"], "fastdeploy": ["http", "metrics"]}
GPU_NODES = {"nvidia.com/gpu.present": "true"}  # every fake GPU node, labelled by e2e/cluster.sh


def peer_service(kind: str, namespace: str) -> dict[str, Any]:
    """The engine's example, in a namespace of its own: 2 replicas on the fake GPU nodes, no PVC or Secret."""
    obj = yaml.safe_load(PEER_EXAMPLES[kind].read_text())
    obj["metadata"]["namespace"] = namespace
    spec = obj["spec"]
    spec["model"].pop("pvc", None)  # the checkpoint path stands for one baked into the image
    spec["router"].pop("apiKeySecret", None)
    spec.update(replicas=2, nodeSelector=GPU_NODES)
    return obj


@pytest.mark.parametrize("kind", ["vllm", "fastdeploy"])
def test_peer_engines_reconcile_to_ready_with_their_rendered_flags(e2e_cluster: Cluster, local_operator: LocalOperator,
                                                                   namespace: str, kind: str) -> None:
    from warmfleet.operator.passes.reconcile import render
    from warmfleet.operator.planning import engine_descriptions
    from warmfleet.operator.planning.nodes import node_info
    from warmfleet.operator.planning.objects import Images

    c = e2e_cluster
    obj = peer_service(kind, namespace)
    ex = Example(obj["metadata"]["name"], namespace, "")
    c.apply(obj)
    svc = wait_settled(c, ex, f"the {kind} service to settle")
    st, gpr = svc["status"], obj["spec"]["server"]["gpusPerReplica"]

    # Ready exactly as for warmfleet, and every pool says which engine it runs
    assert st["ready"] == "True" and st["readyReplicas"] == st["desiredReplicas"] == 2
    conds = {x["type"]: (x["status"], x["reason"]) for x in st["conditions"]}
    assert conds == {"Ready": ("True", "AllReplicasReady"), "Progressing": ("False", "Stable"),
                     "Degraded": ("False", "AsExpected"), "InvalidSpec": ("False", "SpecValid"),
                     "EngineFit": ("True", "EngineFromSpec"), "GPUMemoryKnown": ("True", "GPUMemoryFound"),
                     "TaintsTolerated": ("True", "AllTaintsTolerated")}, conds
    assert st["pools"] and {p["engine"] for p in st["pools"]} == {kind}
    assert all(("encoderCacheTokens" in p["sizes"]) == (kind == "fastdeploy") for p in st["pools"])

    # the live Deployments carry exactly what `warmfleet operator render` prints for these nodes
    nodes = [node_info(n) for n in c.kubectl_json("get", "nodes")["items"]]
    live_svc = {k: svc[k] for k in ("apiVersion", "kind", "metadata", "spec")}
    want = {o["metadata"]["name"]: o for o in render(live_svc, nodes, Images("unused", "unused")) if o["kind"] == "Deployment"}
    live = deployments(c, ex)
    assert set(live) == set(want), (sorted(live), sorted(want))
    for name, dep in live.items():
        ctr, wctr = dep["spec"]["template"]["spec"]["containers"][0], want[name]["spec"]["template"]["spec"]["containers"][0]
        if dep["metadata"]["labels"][COMPONENT_LABEL] == "router":
            assert ctr["args"] == wctr["args"] and ctr["args"][ctr["args"].index("--engine") + 1] == kind
            continue
        # the example names no image: the engine's pinned official one (engine_descriptions.VLLM_IMAGE, ...)
        image = obj["spec"]["engine"].get("image") or engine_descriptions.ENGINES[kind].default_image
        assert ctr["image"] == image and ctr["command"] == PEER_COMMANDS[kind]
        assert ctr["args"] == wctr["args"], name
        args = ctr["args"]
        assert args[args.index("--tensor-parallel-size") + 1] == str(gpr)
        assert set(engine_descriptions.render_flags(args)) - set(obj["spec"]["engine"].get("extraArgs", [])) <= set(engine_descriptions.ENGINES[kind].flags)
        assert quantity(ctr["resources"]["limits"]["nvidia.com/gpu"]) == gpr
        pool = next(p for p in st["pools"] if name.endswith(p["name"]))
        swap_flag = "--kv-offloading-size" if kind == "vllm" else "--swap-space"
        assert float(args[args.index(swap_flag) + 1]) == pool["sizes"]["swapSpaceGib"]
        assert quantity(ctr["resources"]["limits"]["memory"]) == pool["sizes"]["memoryBytes"]
        assert [p["name"] for p in ctr["ports"]] == PEER_PORTS[kind]
    headless = c.kubectl_json("-n", namespace, "get", "service", f"{ex.name}-replicas")
    assert [p["name"] for p in headless["spec"]["ports"]] == PEER_PORTS[kind]


# ---- 5c. why it is not Ready: the example without its PVC ----

def test_a_missing_pvc_is_the_ready_reason_a_warning_event_and_the_reason_column(
        e2e_cluster: Cluster, local_operator: LocalOperator, namespace: str) -> None:
    """`kubectl apply` of the example as a new user would, its model-store PVC missing: the real
    kube-scheduler refuses every pod (Unschedulable, `persistentvolumeclaim "model-store" not found`);
    the operator names it in the Ready condition, posts one Warning Event and shows it in REASON.
    Creating the claim recovers (kwok then marks the pods Ready)."""
    c = e2e_cluster
    obj = yaml.safe_load(EXAMPLE.read_text())
    obj["metadata"]["namespace"] = namespace
    obj["spec"]["nodeSelector"] = GPU_NODES  # every fake GPU node (the shared example's label is its fixture's)
    ex = Example(obj["metadata"]["name"], namespace, "")
    c.kubectl("-n", namespace, "create", "secret", "generic", obj["spec"]["router"]["apiKeySecret"]["name"],
              "--from-literal=api-key=sk-e2e-reason")
    c.apply(obj)

    def ready_condition() -> dict[str, Any]:
        return next((x for x in (wfis(c, ex).get("status") or {}).get("conditions", []) if x["type"] == "Ready"), {})

    # what the scheduler wrote on the pods (kwok's cluster runs the real kube-scheduler)
    def scheduler_said() -> str | None:
        pods = c.kubectl_json("-n", namespace, "get", "pods", "-l", f"{SERVICE_LABEL}={ex.name}")["items"]
        msgs = [x.get("message", "") for p in pods for x in (p.get("status") or {}).get("conditions", [])
                if x["type"] == "PodScheduled" and x["status"] == "False" and x.get("reason") == "Unschedulable"]
        return msgs[0] if len(msgs) == 14 and all('persistentvolumeclaim "model-store" not found' in m for m in msgs) else None

    sched = wait_for(scheduler_said, 90, "every server and router pod Unschedulable for the missing claim")

    def missing_pvc() -> dict[str, Any] | None:
        x = ready_condition()
        msg = x.get("message", "")
        return x if x.get("reason") == "MissingPVC" and "12/12 server pods" in msg and "2/2 router pods" in msg else None

    # Pods the scheduler has not seen yet are named by the operator's own check of the claim
    # ('persistentvolumeclaim "model-store" not found'); once it has, in the scheduler's words.
    cond = wait_for(missing_pvc, 90, "the Ready reason MissingPVC, counting all 14 pods")
    assert cond["status"] == "False" and 'persistentvolumeclaim "model-store" not found' in cond["message"], cond

    def in_the_schedulers_words() -> dict[str, Any] | None:
        x = missing_pvc()
        return x if x and sched in x["message"] else None

    cond = wait_for(in_the_schedulers_words, 60, "the scheduler's message in the Ready condition")
    # '12/12 server pods, 2/2 router pods MissingPVC: 0/4 nodes are available: persistentvolumeclaim
    # "model-store" not found. not found; 0/12 server replicas, 0 routers ready'
    assert cond["message"].startswith("12/12 server pods") and cond["message"].endswith("; 0/12 server replicas, 0 routers ready"), cond

    def warnings_posted(reason: str) -> list[dict[str, Any]]:
        items = c.kubectl_json("-n", namespace, "get", "events", "--field-selector",
                               f"involvedObject.kind=InferenceService,involvedObject.name={ex.name}")["items"]
        return [e for e in items if e["type"] == "Warning" and e["reason"] == reason]

    (event,) = wait_for(lambda: warnings_posted("MissingPVC"), 60, "a Warning Event MissingPVC on the InferenceService")
    assert 'persistentvolumeclaim "model-store" not found' in event["message"], event
    assert event["involvedObject"]["uid"] == wfis(c, ex)["metadata"]["uid"]

    table = c.kubectl("-n", namespace, "get", "wfis", ex.name).stdout.splitlines()
    assert table[0].split()[:3] == ["NAME", "READY", "REASON"], table
    assert table[1].split()[:5] == [ex.name, "False", "MissingPVC", "0", "12"], table

    # the claim arrives: pods schedule, kwok makes them Ready; the reason clears, the Event stays single
    c.apply(model_store(namespace))
    try:
        wait_for(lambda: ready_condition().get("reason") == "AllReplicasReady", 180, "Ready once the claim exists")
        assert len(warnings_posted("MissingPVC")) == 1, warnings_posted("MissingPVC")
        assert c.kubectl("-n", namespace, "get", "wfis", ex.name).stdout.splitlines()[1].split()[1:3] == ["True", "AllReplicasReady"]
    finally:
        c.kubectl("delete", "pv", f"e2e-model-store-{namespace}", "--ignore-not-found", "--wait=false", check=False)


# ---- 5d. model sources: an hf:// model is fetched by an init container; config.json sizes it ----

def _fake_hub_module() -> Any:
    """tests/fakehub.py (the unit tests' loopback hub), loaded by path: e2e runs without tests/ on sys.path."""
    import importlib.util
    import sys

    if "fakehub" not in sys.modules:
        spec = importlib.util.spec_from_file_location("fakehub", REPO / "tests" / "fakehub.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["fakehub"] = mod  # dataclasses resolve annotations through sys.modules
        spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return sys.modules["fakehub"]


def test_hf_source_reconciles_with_the_fetch_init_container_and_learns_config_json(
        e2e_cluster: Cluster, local_operator: LocalOperator, namespace: str) -> None:
    """An InferenceService with `source: hf://...`, no hiddenSize: the operator reads the private repo's
    config.json from a hub on loopback with the token of the Secret the spec names (a GET the chart's RBAC
    allows), sizes the encoder cache from it and renders the `warmfleet fetch-model` init container; the real
    API server admits the pods (hostPath cache, subPath mount, Secret env) and kwok makes them Ready."""
    import base64
    import json as json_

    from warmfleet.operator.passes.reconcile import render
    from warmfleet.operator.planning.nodes import node_info
    from warmfleet.operator.planning.objects import Images

    c = e2e_cluster
    config = {"architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl", "hidden_size": 3584,
              "torch_dtype": "bfloat16", "vision_config": {"embed_dim": 1280}}
    with _fake_hub_module().FakeHub() as hub:
        hub.add("acme/qwen2-vl-e2e", {"config.json": json_.dumps(config).encode(), "model.safetensors": b"w" * 4096},
                token="hf_e2e_token")
        c.apply([{"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf-creds", "namespace": namespace},
                  "data": {"HF_TOKEN": base64.b64encode(b"hf_e2e_token").decode()}}])
        source = "hf://acme/qwen2-vl-e2e@main"
        obj = {"apiVersion": "serving.warmfleet.io/v1alpha1", "kind": "InferenceService",
               "metadata": {"name": "hf-model", "namespace": namespace},
               "spec": {"model": {"source": source, "credentialsSecret": "hf-creds", "hub": {"endpoint": hub.url}},
                        "replicas": 2, "nodeSelector": GPU_NODES}}
        c.apply(obj)
        ex = Example("hf-model", namespace, "")
        svc = wait_settled(c, ex, "the hf:// service to settle")
        assert any(q.authorization == "Bearer hf_e2e_token" and q.path.endswith("/config.json") for q in hub.requests)

    st = svc["status"]
    assert st["ready"] == "True" and st["readyReplicas"] == 2
    conds = {x["type"]: (x["status"], x["reason"]) for x in st["conditions"]}
    assert conds["ModelConfigUnavailable"] == ("False", "ConfigRead") and conds["InvalidSpec"] == ("False", "SpecValid"), conds
    mcs = st["modelConfig"]
    assert mcs["learned"] == {"hiddenSize": {"value": 3584, "from": "config.json"}, "dtype": {"value": "bfloat16", "from": "config.json"}}
    assert mcs["configJson"]["architecture"] == "Qwen2VLForConditionalGeneration" and mcs["configJson"]["vision"] is True
    assert all(p["inputs"]["bytesPerEncoderToken"] == 3584 * 2 for p in st["pools"])

    model_dir = "/models/hf/acme/qwen2-vl-e2e/main"
    hub_port = hub.url.rstrip("/").rsplit(":", 1)[1]
    hub_digest = hashlib.sha256(f"http://127.0.0.1:{hub_port}/".encode()).hexdigest()[:12]
    # the node cache's directory: per namespace (the chart's operator.shareModelCache is off), per endpoint
    cache_dir = f"ns/{namespace}/hf/127.0.0.1_{hub_port}-{hub_digest}/acme/qwen2-vl-e2e/main"
    live = deployments(c, ex)
    nodes = [node_info(n) for n in c.kubectl_json("get", "nodes")["items"]]
    live_svc = {k: svc[k] for k in ("apiVersion", "kind", "metadata", "spec", "status")}
    server_pod = next(d for d in live.values() if d["metadata"]["labels"][COMPONENT_LABEL] == "server")["spec"]["template"]["spec"]
    # the operator's two default images: the engine's, and the slim one of the fetch-model step (and the router)
    defaults = Images(engine=server_pod["containers"][0]["image"], router=server_pod["initContainers"][0]["image"])
    assert defaults.engine != defaults.router, defaults
    # what `warmfleet operator render` prints, config.json's values taken from the live status
    want = {o["metadata"]["name"]: o for o in render(live_svc, nodes, defaults) if o["kind"] == "Deployment"}
    assert set(live) == set(want)
    for name, dep in live.items():
        pod = dep["spec"]["template"]["spec"]
        (init,) = pod["initContainers"]
        router = dep["metadata"]["labels"][COMPONENT_LABEL] == "router"
        assert init["name"] == "fetch-model" and init["command"] == ["warmfleet"]
        # a server fetches into the node cache's directory of this namespace, endpoint (host and a digest of its URL)
        # and source; the router into its own emptyDir at the model's directory
        dest = model_dir if router else f"/models/{cache_dir}"
        assert init["args"] == ["fetch-model", source, "--dest", dest, "--termination-log", "/dev/termination-log",
                                *(["--tokenizer-only"] if router else [])]
        env = {e["name"]: e for e in init["env"]}
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-creds", "key": "HF_TOKEN"}
        assert env["HF_ENDPOINT"]["value"].startswith("http://127.0.0.1:")
        assert init["securityContext"]["readOnlyRootFilesystem"] is True and pod["securityContext"]["runAsNonRoot"] is True
        assert is_subset(want[name]["spec"]["template"]["spec"]["initContainers"][0], init)
        vols = {v["name"]: v for v in pod["volumes"]}
        ctr = pod["containers"][0]
        assert ctr["args"][ctr["args"].index("--model") + 1] == model_dir
        if router:
            assert vols["model"]["emptyDir"] == {"sizeLimit": "1Gi"}
            continue
        assert vols["model-cache"]["hostPath"] == {"path": "/var/cache/warmfleet/models", "type": "DirectoryOrCreate"}
        assert {"name": "model-cache", "mountPath": model_dir, "subPath": cache_dir, "readOnly": True} in ctr["volumeMounts"]
    # the API server admitted pods carrying the init container (kwok runs nothing; it marks them Ready)
    pods = c.kubectl_json("-n", namespace, "get", "pods", "-l", f"{SERVICE_LABEL}={ex.name},{COMPONENT_LABEL}=server")["items"]
    assert len(pods) == 2 and all(p["spec"]["initContainers"][0]["name"] == "fetch-model" for p in pods)
    # gone before the next test: with the hub stopped, a later reconcile of it would report the hub unreachable
    c.kubectl("-n", namespace, "delete", "wfis", ex.name, "--wait=true", "--timeout=60s")


# ---- 6. deletion garbage-collects; helm uninstall keeps the CRD and user objects ----

@pytest.mark.destructive
def test_deleting_the_service_garbage_collects_every_child(e2e_cluster: Cluster, example: Example) -> None:
    c = e2e_cluster
    children = c.kubectl_json("-n", example.namespace, "get", ",".join(CHILD_KINDS + ["replicaset", "pod"]),
                              "-l", f"{SERVICE_LABEL}={example.name}")["items"]
    assert len(children) > 20
    c.kubectl("-n", example.namespace, "delete", "wfis", example.name, "--wait=true", "--timeout=60s")

    def gone() -> bool:
        left = c.kubectl_json("-n", example.namespace, "get", ",".join(CHILD_KINDS + ["replicaset", "pod"]),
                              "-l", f"{SERVICE_LABEL}={example.name}")["items"]
        return not left

    wait_for(gone, 120, "the garbage collector to delete every child")
    for o in children:
        r = c.kubectl("-n", example.namespace, "get", f"{o['kind']}/{o['metadata']['name']}", check=False)
        assert r.returncode != 0 and "NotFound" in r.stderr, (o["kind"], o["metadata"]["name"])


@pytest.mark.destructive
def test_helm_uninstall_keeps_the_crd_and_user_objects(e2e_cluster: Cluster, release: Release,
                                                       local_operator: LocalOperator, namespace: str) -> None:
    c = e2e_cluster
    keeper = {"apiVersion": "serving.warmfleet.io/v1alpha1", "kind": "InferenceService",
              "metadata": {"name": "keeper", "namespace": namespace},
              "spec": {"model": {"path": "/models/m"}, "replicas": 0}}
    c.apply(keeper)
    wait_for(lambda: (c.kubectl_json("-n", namespace, "get", "wfis", "keeper").get("status") or {}).get("ready") == "True",
             60, "the operator to reconcile the user's service")
    local_operator.stop()  # its token dies with the ServiceAccount
    out = c.helm("uninstall", release.name, "--namespace", release.namespace, "--wait").stdout
    release.installed = False
    assert "kept due to the resource policy" in out and CRD_NAME in out, out
    assert c.kubectl("get", "crd", CRD_NAME, check=False).returncode == 0
    kept = c.kubectl_json("-n", namespace, "get", "wfis", "keeper")
    assert kept["spec"]["model"]["path"] == "/models/m"
    for args in (["-n", release.namespace, "get", "deployment", f"{release.name}-operator"],
                 ["-n", release.namespace, "get", "serviceaccount", release.service_account],
                 ["get", "clusterrole", f"{release.name}-kopf"], ["get", "clusterrole", f"{release.name}-app"],
                 ["get", "clusterrolebinding", f"{release.name}-app"]):
        r = c.kubectl(*args, check=False)
        assert r.returncode != 0 and "NotFound" in r.stderr, args
    assert release.name not in c.helm("list", "--all-namespaces", "-q").stdout.split()
    # the values.yaml comment documents exactly this
    assert "helm uninstall` leaves users' InferenceServices alone" in (CHART / "values.yaml").read_text()
    assert EXAMPLE.is_file()
