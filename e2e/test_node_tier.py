"""spec.cache.nodeTier against a real control plane (issue 41, operator): a node tier DaemonSet per pool, sized, running
on every node of its pool; its memory plus its pool's replicas' within every node's allocatable; status shows it;
`mode: Off` removes it and gives the replicas their own swap tier back.

The service runs on nodes of its own (an H200 and an L4 shape, made for the test): the tier is sized from what a
node spares after this service's replicas (docs/node-tier-operator.md), so the suite's example service, which holds
memory on the cluster's GPU nodes, would leave its pods Pending (NodeTierNotReady)."""

from __future__ import annotations

import json
import uuid
from typing import Any, Iterator

import pytest

from conftest import Example, LocalOperator, is_ready
from e2e_support import Cluster, wait_for
from test_operator import deployments, kwok_node, quantity, wfis

SERVICE_LABEL = "serving.warmfleet.io/service"
POOL_LABEL = "serving.warmfleet.io/pool"


def tiered_service(namespace: str, mode: str, node_selector: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "serving.warmfleet.io/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "tiered", "namespace": namespace},
            "spec": {"model": {"path": "/models/qwen", "hiddenSize": 896}, "engine": {"kind": "warmfleet"},
                     "replicas": 2, "nodeSelector": node_selector, "cache": {"nodeTier": {"mode": mode}}}}


@pytest.fixture
def tier_nodes(e2e_cluster: Cluster) -> Iterator[dict[str, str]]:
    """Two 8xH200 nodes and one 8xL4 node (e2e/cluster.sh's shapes) made for this test and deleted after it; the
    node selector that picks them. Without `nvidia.com/gpu.present`, no other test's selector takes them."""
    c, tag = e2e_cluster, uuid.uuid4().hex[:6]
    label = f"e2e.warmfleet.io/tier-{tag}"
    shapes = {f"tier-h200-{tag}-{i}": ("NVIDIA-H200", "143771", "2Ti", "192") for i in range(2)}
    shapes[f"tier-l4-{tag}-0"] = ("NVIDIA-L4", "23034", "384Gi", "96")
    made = []
    for name, (product, mib, memory, cpu) in shapes.items():
        node = kwok_node(name, {label: "true", "nvidia.com/gpu.product": product, "nvidia.com/gpu.memory": mib,
                                "nvidia.com/gpu.count": "8"}, gpus=8, memory=memory, cpu=cpu)
        del node["metadata"]["labels"]["nvidia.com/gpu.present"]
        made.append(node)
    c.apply(made)
    try:
        for name in shapes:  # Ready, and the node lifecycle controller's not-ready taint gone (pools leave tainted nodes out)
            wait_for(lambda n=name: ready_untainted(c.kubectl_json("get", "node", n)), 60, f"node {name} Ready, untainted")
        yield {label: "true"}
    finally:
        c.kubectl("delete", "node", *shapes, "--ignore-not-found", check=False)


def ready_untainted(node: dict[str, Any]) -> bool:
    return is_ready(node) and not (node.get("spec") or {}).get("taints")


def daemonsets(c: Cluster, ex: Example) -> dict[str, dict[str, Any]]:
    items = c.kubectl_json("-n", ex.namespace, "get", "daemonsets", "-l", f"{SERVICE_LABEL}={ex.name}")["items"]
    return {d["metadata"]["labels"][POOL_LABEL]: d for d in items}


def servers(c: Cluster, ex: Example) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["labels"][POOL_LABEL]: d for d in deployments(c, ex).values()
            if d["metadata"]["labels"]["app.kubernetes.io/component"] == "server"}


def container_memory(obj: dict[str, Any]) -> int:
    (c,) = [c for c in obj["spec"]["template"]["spec"]["containers"] if c["name"] in ("server", "node-tier")]
    assert c["resources"]["requests"]["memory"] == c["resources"]["limits"]["memory"]
    return quantity(c["resources"]["limits"]["memory"])


def tiers_running(c: Cluster, ex: Example, nodes: int = 3) -> dict[str, dict[str, Any]]:
    """Every pool's DaemonSet rolled out on each of the pool's nodes, the pools covering all `nodes` of the test, and
    status written for this generation; else raises with what is missing (wait_for reports the last one). (The
    operator plans from its own watch of the nodes, which may not yet have seen a new node's taint lifted.)"""
    svc = wfis(c, ex)
    st = svc.get("status") or {}
    if st.get("observedGeneration") != svc["metadata"]["generation"] or not st.get("pools"):
        raise AssertionError(f"status not written for generation {svc['metadata']['generation']}: {st.get('conditions')}")
    if sum(len(p["nodes"]) for p in st["pools"]) < nodes:
        raise AssertionError(f"pools {[(p['name'], p['nodes']) for p in st['pools']]} cover fewer than {nodes} nodes")
    sets = daemonsets(c, ex)
    for pool in st["pools"]:
        ds = sets.get(pool["name"])
        s = (ds or {}).get("status") or {}
        if ds is None or s.get("observedGeneration") != ds["metadata"]["generation"]:
            raise AssertionError(f"pool {pool['name']}: DaemonSet {'missing' if ds is None else 'not observed'}")
        counts = (s.get("desiredNumberScheduled"), s.get("numberReady"), s.get("updatedNumberScheduled"))
        if not counts[0] == counts[1] == counts[2] == len(pool["nodes"]):
            raise AssertionError(f"pool {pool['name']} on {pool['nodes']}: desired/ready/updated {counts}; "
                                 f"status.pools[].nodeTier {pool.get('nodeTier')}; conditions {st.get('conditions')}")
    return sets


def tier_nodes_of(nodes: dict[str, Any], selector: dict[str, str]) -> list[str]:
    return [n for n, o in nodes.items() if all(o["metadata"]["labels"].get(k) == v for k, v in selector.items())]


def test_a_node_tier_per_pool_sized_within_every_nodes_allocatable_and_shown_in_status(
        e2e_cluster: Cluster, local_operator: LocalOperator, namespace: str, tier_nodes: dict[str, str]) -> None:
    c = e2e_cluster
    ex = Example("tiered", namespace, "")
    c.apply(tiered_service(namespace, "Auto", tier_nodes))
    sets = wait_for(lambda: tiers_running(c, ex), 120, "a node tier running on every node of each pool")
    st = wfis(c, ex)["status"]
    deps = servers(c, ex)
    nodes = {n["metadata"]["name"]: n for n in c.kubectl_json("get", "nodes")["items"]}
    assert len(st["pools"]) >= 2 and set(sets) == {p["name"] for p in st["pools"]} == set(deps), (
        [p["name"] for p in st["pools"]], [(x["type"], x["status"], x["reason"], x["message"]) for x in st["conditions"]],
        {n: nodes[n]["spec"].get("taints") for n in tier_nodes_of(nodes, tier_nodes)})
    for pool in st["pools"]:
        tier, ds, dep = pool["nodeTier"], sets[pool["name"]], deps[pool["name"]]
        assert tier["capacityBytes"] > 0 and tier["sizeGib"] > 0 and tier["source"] == "auto", tier
        assert pool["inputs"]["sources"]["swapSpace"] == "nodeTier" and pool["sizes"]["swapSpaceGib"] == 0
        assert container_memory(ds) == tier["memoryBytes"]
        args = ds["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--capacity-bytes") + 1] == str(tier["capacityBytes"])
        server_args = next(x for x in dep["spec"]["template"]["spec"]["containers"] if x["name"] == "server")["args"]
        assert server_args[server_args.index("--node-tier") + 1] == "tiered-node-tier:7100"
        for name in pool["nodes"]:  # the worst case: the most replicas a node hosts, and its tier
            alloc = quantity(nodes[name]["status"]["allocatable"]["memory"])
            assert tier["replicasPerNode"] * container_memory(dep) + container_memory(ds) <= alloc, name
    # what really runs: per node, this service's pods' memory requests stay within its allocatable
    used: dict[str, int] = {}
    for pod in c.kubectl_json("-n", namespace, "get", "pods", "-l", f"{SERVICE_LABEL}=tiered")["items"]:
        node = pod["spec"].get("nodeName")
        if node:
            used[node] = used.get(node, 0) + sum(quantity(x["resources"]["requests"].get("memory", "0"))
                                                 for x in pod["spec"]["containers"])
    assert used and all(v <= quantity(nodes[n]["status"]["allocatable"]["memory"]) for n, v in used.items()), used
    tier_svc = c.kubectl_json("-n", namespace, "get", "service", "tiered-node-tier")
    assert tier_svc["spec"]["internalTrafficPolicy"] == "Local"

    # Off: the tiers go, the replicas get their own swap tier back
    c.kubectl("-n", namespace, "patch", "wfis", "tiered", "--type", "merge",
              "-p", json.dumps({"spec": {"cache": {"nodeTier": {"mode": "Off"}}}}))
    wait_for(lambda: not daemonsets(c, ex), 60, "the node tier DaemonSets to be pruned")

    def untiered() -> dict[str, Any] | None:
        svc = wfis(c, ex)
        st = svc.get("status") or {}
        done = st.get("observedGeneration") == svc["metadata"]["generation"] and st.get("pools")
        return st if done and all("nodeTier" not in p for p in st["pools"]) else None

    st = wait_for(untiered, 60, "status without nodeTier")
    assert all(p["sizes"]["swapSpaceGib"] > 0 for p in st["pools"])
    for dep in servers(c, ex).values():
        args = next(x for x in dep["spec"]["template"]["spec"]["containers"] if x["name"] == "server")["args"]
        assert "--node-tier" not in args
