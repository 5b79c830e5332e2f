"""A CPU-only pool against a real control plane (issue 39): on a node without GPUs, spec.engine.kind auto picks
warmfleet's engine (CPU attention) and its replicas are scheduled there with no GPU request and no GPU toleration,
packed by the node's allocatable CPU; examples/inferenceservice-cpu.yaml on a fake kwok node."""

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


def cpu_node(name: str, pool_label: str) -> dict[str, Any]:
    """A fake 16-CPU, 64 GiB node kwok manages, without GPUs and without `nvidia.com/gpu.present`, so no other
    test's selector (e2e/cluster.sh labels its GPU nodes with it) takes it into a pool."""
    alloc = {"cpu": "16", "memory": "64Gi", "ephemeral-storage": "1Ti", "pods": "110"}
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
                     "labels": {"kubernetes.io/arch": "amd64", "kubernetes.io/os": "linux", "kubernetes.io/hostname": name,
                                "type": "kwok", pool_label: "true"}},
        "status": {"addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": name}],
                   "capacity": dict(alloc), "allocatable": dict(alloc)},
    }


@pytest.fixture
def cpu_pool(e2e_cluster: Cluster) -> Iterator[tuple[str, str]]:
    """(node name, its selecting label): made for this test, deleted after it."""
    c, tag = e2e_cluster, uuid.uuid4().hex[:6]
    node, label = f"cpu-only-{tag}", f"e2e.warmfleet.io/cpu-{tag}"
    c.apply([cpu_node(node, label)])
    wait_for(lambda: is_ready(c.kubectl_json("get", "node", node)), 60, f"node {node} Ready")
    try:
        yield node, label
    finally:
        c.kubectl("delete", "node", node, "--ignore-not-found", check=False)


def test_auto_on_a_cpu_only_node_runs_warmfleet_replicas_without_gpus(
        e2e_cluster: Cluster, local_operator: LocalOperator, namespace: str, cpu_pool: tuple[str, str]) -> None:
    c, (node, label) = e2e_cluster, cpu_pool
    obj = yaml.safe_load((REPO / "examples" / "inferenceservice-cpu.yaml").read_text())
    obj["metadata"]["namespace"] = namespace
    obj["spec"]["model"].pop("pvc", None)  # the model baked in: no claim to create
    obj["spec"]["nodeSelector"] = {label: "true"}
    name = obj["metadata"]["name"]
    c.apply(obj)
    wait_for(lambda: is_ready(c.kubectl_json("-n", namespace, "get", "wfis", name)), 120, f"{name} Ready")
    status = c.kubectl_json("-n", namespace, "get", "wfis", name)["status"]
    assert (status["engine"]["kind"], status["engine"]["chosenBy"]) == ("warmfleet", "auto"), status["engine"]
    (pool,) = status["pools"]
    assert pool["nodes"] == [node] and pool["fits"] and pool["shape"]["cpuMillis"] == 16000
    assert pool["sizes"]["replicasPerNode"] == 4 and pool["readyReplicas"] == 2  # 16 CPUs / server.cpus 4

    servers = [p for p in c.kubectl_json("-n", namespace, "get", "pods", "-l",
                                         f"{SERVICE_LABEL}={name},{COMPONENT_LABEL}=server")["items"]
               if not p["metadata"].get("deletionTimestamp")]
    assert len(servers) == 2
    for p in servers:
        assert p["spec"]["nodeName"] == node  # scheduled: the node has no GPU to give and none was asked for
        (server,) = [x for x in p["spec"]["containers"] if x["name"] == "server"]
        assert not any("gpu" in k for k in server["resources"]["limits"]), server["resources"]
        assert server["resources"]["limits"]["cpu"] == "4"
        assert not any("gpu" in (t.get("key") or "") for t in p["spec"].get("tolerations") or [])
