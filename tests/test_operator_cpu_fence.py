"""A CPU pool's server pods land only on its CPU nodes: never on a GPU node without GPU feature discovery's labels,
which `nvidia.com/gpu.product DoesNotExist` alone lets in; and the fence does not roll the pool as nodes come and go."""

from __future__ import annotations

import pytest

from operator_fixtures.shapes import GiB, node, service
from warmfleet.operator.passes.reconcile import plan_for
from warmfleet.operator.planning import objects
from warmfleet.operator.planning.nodes import derive_pools, node_info
from warmfleet.operator.planning.pod_overlay import merge_affinity
from warmfleet.operator.spec.inference_service import parse_spec
from warmfleet.operator.spec.pod_overlay import Affinity
from warmfleet.operator.spec.schema import from_dict

IMAGES = objects.Images(engine="engine:1", router="slim:1")
GKE_POOL = "cloud.google.com/gke-nodepool"
WARMFLEET = {"kind": "warmfleet"}  # CPU attention: CPU pools host its replicas beside GPU pools


def requirement_holds(req: dict, value: str | None) -> bool:
    """One NodeSelectorRequirement against a label's (or field's) value, None when the node has none."""
    op, values = req["operator"], req.get("values") or []
    return {"In": value in values, "NotIn": value not in values, "Exists": value is not None,
            "DoesNotExist": value is None}[op]


def affinity_admits(affinity: dict, body: dict) -> bool:
    """The scheduler's required node affinity: any term whose every expression (labels) and field holds."""
    terms = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    labels = body["metadata"].get("labels") or {}
    fields = {"metadata.name": body["metadata"]["name"]}
    return any(all(requirement_holds(r, labels.get(r["key"])) for r in t.get("matchExpressions", []))
               and all(requirement_holds(r, fields.get(r["key"])) for r in t.get("matchFields", []))
               for t in terms)


def cpu_deployment(nodes: list[dict], **spec) -> dict:
    """The CPU pool's Deployment for a warmfleet service on `nodes`."""
    body = service(spec={"replicas": 2, "engine": WARMFLEET, "server": {"cpus": 4}, **spec})
    _, _, plan = plan_for(body, [node_info(n) for n in nodes], IMAGES)
    (cpu,) = [p for p in plan.pools if p.pool.name.startswith("cpu-")]
    return next(c for c in plan.children if c["kind"] == "Deployment" and c["metadata"]["name"].endswith(cpu.pool.name))


def affinity(dep: dict) -> dict:
    return dep["spec"]["template"]["spec"]["affinity"]


def cpu(name: str, **kw) -> dict:
    return node(name, memory=256 * GiB, **kw)


@pytest.mark.parametrize("gpu_node", [
    node("gpu-x", gpus=8, memory=256 * GiB),  # NVIDIA's device plugin without GPU feature discovery
    node("gpu-x", gpus=8, memory=256 * GiB, resource="amd.com/gpu"),  # AMD's device plugin
], ids=["nvidia", "amd"])
def test_an_unlabelled_gpu_node_is_never_matched_by_the_cpu_pools_affinity(gpu_node):
    dep = cpu_deployment([cpu("cpu-a"), cpu("cpu-b"), gpu_node])
    assert affinity_admits(affinity(dep), cpu("cpu-a")) and affinity_admits(affinity(dep), cpu("cpu-b"))
    assert not affinity_admits(affinity(dep), gpu_node)
    assert dep["spec"]["template"]["spec"]["tolerations"] == []  # and it tolerates no GPU taint


def test_a_gpu_resource_of_the_spec_counts_too_and_such_a_node_joins_no_cpu_pool():
    intel = node("gpu-i", gpus=4, memory=256 * GiB, resource="gpu.intel.com/i915")
    dep = cpu_deployment([cpu("cpu-a"), intel], server={"cpus": 4, "gpuResource": "gpu.intel.com/i915"})
    assert not affinity_admits(affinity(dep), intel)
    # a node with NVIDIA GPUs while the service asks for another resource hosts none of its replicas, CPU-only included
    spec = parse_spec({"model": {"path": "/m"}, "engine": WARMFLEET, "server": {"gpuResource": "gpu.intel.com/i915"}})
    pools = derive_pools(spec, [node_info(cpu("cpu-a")), node_info(node("gpu-x", gpus=8, memory=256 * GiB))])
    assert [p.nodes for p in pools] == [("cpu-a",)]


def test_without_unlabelled_gpu_nodes_the_affinity_is_what_it_always_was():
    labelled = node("h1", product="NVIDIA-H200", gpu_mib=143771, gpus=8, memory=256 * GiB)
    exprs = affinity(cpu_deployment([cpu("cpu-a"), labelled]))["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert exprs == [{"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "DoesNotExist"}]}]


def test_a_node_group_label_fences_the_pool_and_nodes_coming_and_going_roll_nothing():
    nodes = [cpu("cpu-a", labels={GKE_POOL: "default-pool"}), node("gpu-x", gpus=8, labels={GKE_POOL: "gpu-pool"})]
    dep = cpu_deployment(nodes)
    term = affinity(dep)["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
    assert {"key": GKE_POOL, "operator": "In", "values": ["default-pool"]} in term["matchExpressions"]
    assert "matchFields" not in term
    assert not affinity_admits(affinity(dep), nodes[1])
    # the autoscaler adds a CPU node and two GPU nodes: the pod template stays byte for byte (no roll)
    grown = nodes + [cpu("cpu-b", labels={GKE_POOL: "default-pool"}),
                     node("gpu-y", gpus=8, labels={GKE_POOL: "gpu-pool"}), node("gpu-z", gpus=8, labels={GKE_POOL: "gpu-pool"})]
    assert cpu_deployment(grown)["spec"]["template"] == dep["spec"]["template"]


def test_a_group_label_a_gpu_node_shares_is_not_a_fence_the_names_of_the_gpu_nodes_are():
    shared = {"karpenter.sh/nodepool": "general"}  # one Karpenter NodePool with CPU and GPU instance types
    nodes = [cpu("cpu-a", labels=shared), node("gpu-x", gpus=8, labels=shared)]
    dep = cpu_deployment(nodes)
    term = affinity(dep)["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
    assert term["matchFields"] == [{"key": "metadata.name", "operator": "NotIn", "values": ["gpu-x"]}]
    assert affinity_admits(affinity(dep), nodes[0]) and not affinity_admits(affinity(dep), nodes[1])
    # a CPU node joining changes nothing; a cordoned or NotReady GPU node is fenced off too (it may be back tomorrow)
    assert cpu_deployment(nodes + [cpu("cpu-b", labels=shared)])["spec"]["template"] == dep["spec"]["template"]
    later = cpu_deployment(nodes + [node("gpu-y", gpus=8, ready=False), node("gpu-z", gpus=8, cordoned=True)])
    assert not any(affinity_admits(affinity(later), node(n, gpus=8)) for n in ("gpu-x", "gpu-y", "gpu-z"))


def test_a_gpu_node_outside_the_services_selector_needs_no_fence():
    nodes = [cpu("cpu-a", labels={"team": "a"}), node("gpu-x", gpus=8)]
    term = affinity(cpu_deployment(nodes, nodeSelector={"team": "a"}))["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
    assert "matchFields" not in term and len(term["matchExpressions"]) == 2


def test_the_fence_survives_the_users_own_required_node_terms():
    nodes = [cpu("cpu-a", labels={"zone": "a"}), node("gpu-x", gpus=8, labels={"zone": "a"})]
    own = affinity(cpu_deployment(nodes))
    user = from_dict(Affinity, {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
                              {"matchExpressions": [{"key": "zone", "operator": "Exists"}]}]}}}, "affinity")
    merged = merge_affinity(own, user)
    assert affinity_admits(merged, nodes[0]) and not affinity_admits(merged, nodes[1])
