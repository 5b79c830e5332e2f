"""spec.server.pod and spec.router.pod against a real control plane (issue 39): a GPU node tainted
`dedicated=inference:NoSchedule` joins no pool (TaintsTolerated names the taint, no replica waits Pending) until
spec.server.pod tolerates the taint, then gets server pods; a pull secret and a priorityClass from the overlays reach
the live pods (the API server's Priority admission resolves the class into spec.priority)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from conftest import LocalOperator, is_ready
from e2e_support import Cluster, wait_for

REPO = Path(__file__).resolve().parent.parent
SERVICE_LABEL = "serving.warmfleet.io/service"
COMPONENT_LABEL = "app.kubernetes.io/component"
TAINT = {"key": "dedicated", "value": "inference", "effect": "NoSchedule"}
TOLERATION = {"key": "dedicated", "operator": "Equal", "value": "inference", "effect": "NoSchedule"}
PRIORITY = 100000


def tainted_node(name: str, pool_label: str) -> dict[str, Any]:
    """A fake 8xH200 node kwok manages, tainted; no `nvidia.com/gpu.present` label, so no other test's selector
    (e2e/cluster.sh labels its GPU nodes with it) takes it into a pool."""
    alloc = {"cpu": "192", "memory": "2Ti", "ephemeral-storage": "7Ti", "pods": "110", "nvidia.com/gpu": "8"}
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
                     "labels": {"kubernetes.io/arch": "amd64", "kubernetes.io/os": "linux", "kubernetes.io/hostname": name,
                                "type": "kwok", "nvidia.com/gpu.product": "NVIDIA-H200", "nvidia.com/gpu.memory": "143771",
                                "nvidia.com/gpu.count": "8", pool_label: "true"}},
        "spec": {"taints": [TAINT]},
        "status": {"addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": name}],
                   "capacity": dict(alloc), "allocatable": dict(alloc)},
    }


@pytest.fixture
def tainted_pool(e2e_cluster: Cluster, namespace: str) -> Iterator[tuple[str, str, str]]:
    """(node name, its selecting label, a PriorityClass name): made for this test, deleted after it."""
    c, tag = e2e_cluster, uuid.uuid4().hex[:6]
    node, label, pclass = f"gpu-tainted-{tag}", f"e2e.warmfleet.io/tainted-{tag}", f"e2e-gpu-serving-{tag}"
    c.apply([tainted_node(node, label),
             {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": pclass},
              "value": PRIORITY, "description": "e2e: spec.server.pod.priorityClassName"}])
    wait_for(lambda: is_ready(c.kubectl_json("get", "node", node)), 60, f"node {node} Ready")
    try:
        yield node, label, pclass
    finally:
        c.kubectl("delete", "node", node, "--ignore-not-found", check=False)
        c.kubectl("delete", "priorityclass", pclass, "--ignore-not-found", check=False)


def service(namespace: str, label: str) -> dict[str, Any]:
    """examples/inferenceservice-vllm.yaml on the tainted node only: one replica, the model baked in, no Secret."""
    obj = yaml.safe_load((REPO / "examples" / "inferenceservice-vllm.yaml").read_text())
    obj["metadata"]["namespace"] = namespace
    spec = obj["spec"]
    spec["model"].pop("pvc", None)
    spec["router"].pop("apiKeySecret", None)
    spec.update(replicas=1, nodeSelector={label: "true"})
    return obj


def pods(c: Cluster, ns: str, name: str, component: str) -> list[dict[str, Any]]:
    return c.kubectl_json("-n", ns, "get", "pods", "-l", f"{SERVICE_LABEL}={name},{COMPONENT_LABEL}={component}")["items"]


def test_tainted_pool_schedules_only_with_the_overlay_toleration_and_pull_secret_priority_class_reach_pods(
        e2e_cluster: Cluster, local_operator: LocalOperator, namespace: str,
        tainted_pool: tuple[str, str, str]) -> None:
    c, (node, label, pclass) = e2e_cluster, tainted_pool
    obj = service(namespace, label)
    name = obj["metadata"]["name"]
    c.kubectl("-n", namespace, "create", "secret", "docker-registry", "regcred", "--docker-server=registry.example.com",
              "--docker-username=e2e", "--docker-password=e2e")

    # without the toleration: the operator leaves the node out of the pools and names the taint to tolerate
    c.apply(obj)

    def conditions() -> dict[str, dict[str, Any]]:
        st = c.kubectl_json("-n", namespace, "get", "wfis", name).get("status") or {}
        return {x["type"]: x for x in st.get("conditions") or []}

    taints = wait_for(lambda: conditions().get("TaintsTolerated", {}).get("status") == "False"
                      and conditions()["TaintsTolerated"], 60, "TaintsTolerated False")
    assert taints["reason"] == "UntoleratedTaints" and f"({node}) tainted dedicated=inference:NoSchedule" in taints["message"]
    assert conditions()["Ready"]["reason"] == "NoMatchingNodes", conditions()["Ready"]
    assert not (c.kubectl_json("-n", namespace, "get", "wfis", name)["status"].get("pools"))
    assert not pods(c, namespace, name, "server")  # no server pod waits Pending for a node it may not land on

    # the overlays: the taint tolerated, a pull secret and a priorityClass for servers and routers
    overlay = {"tolerations": [TOLERATION], "imagePullSecrets": [{"name": "regcred"}], "priorityClassName": pclass}
    obj["spec"]["server"]["pod"] = overlay
    obj["spec"]["router"]["pod"] = {k: overlay[k] for k in ("imagePullSecrets", "priorityClassName")}
    c.apply(obj)
    wait_for(lambda: is_ready(c.kubectl_json("-n", namespace, "get", "wfis", name)), 120, f"{name} Ready with the toleration")

    def live(component: str) -> list[dict[str, Any]]:
        return [p for p in pods(c, namespace, name, component) if not p["metadata"].get("deletionTimestamp")]

    wait_for(lambda: live("server") and all(p["spec"].get("priorityClassName") == pclass for p in live("server")), 90,
             "the rolled server pod")
    for p in live("server"):
        assert p["spec"]["nodeName"] == node
        assert TOLERATION in p["spec"]["tolerations"]
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in p["spec"]["tolerations"]
        assert p["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
        assert p["spec"]["priority"] == PRIORITY  # the class exists and was resolved at admission
    wait_for(lambda: live("router") and all(p["spec"].get("priorityClassName") == pclass for p in live("router")), 90,
             "the rolled router pods")
    for p in live("router"):
        assert p["spec"]["imagePullSecrets"] == [{"name": "regcred"}] and p["spec"]["priority"] == PRIORITY
        assert p["spec"]["nodeName"] != node  # routers do not tolerate the taint: they stay off the GPU node
