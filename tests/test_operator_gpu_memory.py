"""GPU count and memory without GPU feature discovery: allocatable nvidia.com/gpu, amd.com/gpu or server.gpuResource;
memory from GFD's label, else the product table, else the cloud's instance type, else server.gpuMemoryGib, else a
GPUMemoryUnknown Warning naming the pool; never a silent 0. status.pools[].inputs.sources.gpuMemory names the source."""

from __future__ import annotations

import re

import pytest
import yaml

from operator_fixtures.shapes import TiB, node, service
from warmfleet.operator.passes.reconcile import plan_for
from warmfleet.operator.planning import gpu_products, objects
from warmfleet.operator.planning.nodes import derive_pools, gpu_memory, node_info
from warmfleet.operator.planning.service_status import healthy_status, warnings
from warmfleet.operator.spec.inference_service import parse_spec

MiB = 1 << 20
IMAGES = objects.Images(engine="registry.example/warmfleet:1.0", router="registry.example/warmfleet-slim:1.0")
TYPE = "node.kubernetes.io/instance-type"


def gpu_node(name="n", *, labels=None, gpus=8, resource="nvidia.com/gpu"):
    body = node(name, memory=2 * TiB, labels=labels)
    body["status"]["allocatable"][resource] = str(gpus)
    return body


def planned(nodes, **spec):
    body = service(spec={"engine": {"kind": "vllm"}, **spec})
    _, _, plan = plan_for(body, [node_info(n) for n in nodes], IMAGES)
    status = healthy_status(plan=plan, generation=1, model="qwen", endpoint="", selector="", ready_by_pool={},
                            router_ready=0, previous={}, now="2026-01-01T00:00:00Z")
    return plan, status


def condition(status, type_):
    return next(c for c in status["conditions"] if c["type"] == type_)


def pod(plan):
    dep = next(c for c in plan.children if c["kind"] == "Deployment" and c["metadata"]["name"] != "qwen-router")
    return dep["spec"]["template"]["spec"]


def affinity(plan):
    terms = pod(plan)["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    return {e["key"]: e for e in terms[0]["matchExpressions"]}


# ---- each source, in order ----

ALL = {"nvidia.com/gpu.memory": "40000", "nvidia.com/gpu.product": "NVIDIA-L4", TYPE: "p5.48xlarge"}


@pytest.mark.parametrize("labels,mib,source", [
    (ALL, 40000, "label"),  # GFD's memory label beats everything
    ({k: v for k, v in ALL.items() if k != "nvidia.com/gpu.memory"}, 23034, "product"),  # then the product table
    ({TYPE: "p5.48xlarge"}, 80 * 1024, "instance-type"),  # then the instance type (P5: H100 80 GB)
    ({TYPE: "a2-ultragpu-8g"}, 81920, "instance-type"),  # GCP A2 Ultra: A100 80GB
    ({TYPE: "Standard_ND96isr_H100_v5"}, 80 * 1024, "instance-type"),  # Azure ND H100 v5
    ({"nvidia.com/gpu.memory": "not-a-number", "nvidia.com/gpu.product": "NVIDIA-H200"}, 143771, "product"),
    ({"nvidia.com/gpu.product": "NVIDIA-Future-GPU"}, 0, None),
    ({TYPE: "m7i.48xlarge"}, 0, None),  # not a GPU type
    ({}, 0, None),
])
def test_memory_sources_in_order(labels, mib, source):
    assert gpu_memory(labels) == (mib, source)


def test_mig_and_time_shared_gpus_are_never_looked_up():
    for product in ("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb", "NVIDIA-A100-SXM4-40GB-SHARED"):
        assert gpu_memory({"nvidia.com/gpu.product": product, TYPE: "p4d.24xlarge"}) == (0, None)


def test_similar_instance_families_are_not_confused():
    assert gpu_products.instance_type_product("g6.12xlarge") == "NVIDIA-L4"
    assert gpu_products.instance_type_product("g6e.12xlarge") == "NVIDIA-L40S"
    assert gpu_products.instance_type_product("p5e.48xlarge") == "NVIDIA-H200"
    assert gpu_products.instance_type_product("p4d.24xlarge") == "NVIDIA-A100-SXM4-40GB"
    assert gpu_products.instance_type_product("p4de.24xlarge") == "NVIDIA-A100-SXM4-80GB"
    assert gpu_products.instance_type_product("xp5.48xlarge") is None  # whole-value matches only


def test_every_table_entry_has_a_known_product_and_a_source():
    for rx, product, source in gpu_products.INSTANCE_TYPES:
        assert product in gpu_products.PRODUCT_MEMORY_MIB, rx
        assert re.search(r"(aws\.amazon|cloud\.google|learn\.microsoft)\.com/", source), rx
    assert all(8 * 1024 <= mib <= 256 * 1024 for mib in gpu_products.PRODUCT_MEMORY_MIB.values())


def test_the_spec_is_the_last_source():
    spec = parse_spec({"model": {"path": "/m"}, "server": {"gpuMemoryGib": 40}})
    (unknown,) = derive_pools(spec, [node_info(gpu_node())])
    assert (unknown.gpu_memory_mib, unknown.gpu_memory_source) == (40 * 1024, "spec")
    (labelled,) = derive_pools(spec, [node_info(gpu_node(labels={"nvidia.com/gpu.product": "NVIDIA-L4"}))])
    assert (labelled.gpu_memory_mib, labelled.gpu_memory_source) == (23034, "product")  # a node's own figure wins
    cpu = node("cpu")
    (pool,) = derive_pools(spec, [node_info(cpu)])
    assert (pool.gpu_memory_mib, pool.gpu_memory_source) == (0, None)  # no GPUs: nothing to size from


# ---- in status, sizing, affinity ----

def test_status_names_the_source_and_sizing_uses_the_figure():
    _, status = planned([gpu_node(labels={TYPE: "p5.48xlarge"})], engine={"kind": "warmfleet"})
    (pool,) = status["pools"]
    assert pool["inputs"]["sources"]["gpuMemory"] == "instance-type"
    assert pool["shape"]["gpuMemoryMib"] == 80 * 1024 and pool["inputs"]["gpuBytesPerReplica"] == 80 * 1024 * MiB
    assert pool["inputs"]["sources"]["encoderCache"] == "auto"  # sized from the figure, not the floor
    assert condition(status, "GPUMemoryKnown")["status"] == "True"


def test_unknown_memory_is_a_warning_naming_the_pool_never_a_silent_zero(tmp_path, capsys):
    plan, status = planned([gpu_node(labels={TYPE: "x9.huge"})], engine={"kind": "warmfleet"})
    (pool,) = status["pools"]
    cond = condition(status, "GPUMemoryKnown")
    assert (cond["status"], cond["reason"]) == ("False", "GPUMemoryUnknown")
    assert pool["name"] in cond["message"] and "spec.server.gpuMemoryGib" in cond["message"]
    assert pool["inputs"]["sources"]["gpuMemory"] == "unknown"
    assert pool["inputs"]["sources"]["encoderCache"] == "floor (GPU memory unknown)"
    assert ("GPUMemoryUnknown", cond["message"]) in warnings({}, status)
    # `warmfleet operator render` says the same on stderr
    from warmfleet.cli import main

    nodes, f = tmp_path / "nodes.yaml", tmp_path / "svc.yaml"
    nodes.write_text(yaml.safe_dump(gpu_node(labels={TYPE: "x9.huge"})))
    f.write_text(yaml.safe_dump(service(spec={"engine": {"kind": "vllm"}})))
    assert main(["operator", "render", "-f", str(f), "--nodes", str(nodes), "--strict"]) == 1
    assert f"GPU memory per GPU unknown for pools {pool['name']}" in capsys.readouterr().err
    # told by the spec, it is known
    _, status = planned([gpu_node(labels={TYPE: "x9.huge"})], engine={"kind": "warmfleet"}, server={"gpuMemoryGib": 48})
    assert condition(status, "GPUMemoryKnown")["status"] == "True"
    assert status["pools"][0]["inputs"]["sources"]["gpuMemory"] == "spec"


def test_cpu_only_pools_need_no_gpu_memory():
    _, status = planned([node("cpu")], engine={"kind": "warmfleet"})
    assert condition(status, "GPUMemoryKnown")["status"] == "True"


def test_affinity_pins_only_labels_the_nodes_carry():
    plan, _ = planned([gpu_node(labels={"nvidia.com/gpu.product": "NVIDIA-L4"})])
    exprs = affinity(plan)
    assert exprs["nvidia.com/gpu.product"]["values"] == ["NVIDIA-L4"] and "nvidia.com/gpu.memory" not in exprs
    plan, _ = planned([gpu_node("a", labels={TYPE: "g6e.12xlarge"}), gpu_node("b", labels={TYPE: "g6e.12xlarge"})])
    exprs = affinity(plan)
    assert exprs[TYPE] == {"key": TYPE, "operator": "In", "values": ["g6e.12xlarge"]}
    assert exprs["nvidia.com/gpu.product"]["operator"] == "DoesNotExist"
    plan, _ = planned([gpu_node(labels={"nvidia.com/gpu.product": "NVIDIA-L4", "nvidia.com/gpu.memory": "23034"})])
    assert affinity(plan)["nvidia.com/gpu.memory"]["values"] == ["23034"]


def test_unlabelled_shapes_get_names_from_their_instance_type():
    spec = parse_spec({"model": {"path": "/m"}})
    pools = derive_pools(spec, [node_info(gpu_node("a", labels={TYPE: "p5.48xlarge"})),
                                node_info(gpu_node("b", labels={TYPE: "p4d.24xlarge"}))])
    assert len({p.name for p in pools}) == 2
    assert sorted(p.name.rsplit("-", 2)[0] for p in pools) == ["a100-sxm4-40gb", "h100-80gb-hbm3"]


# ---- GPU count from allocatable ----

def test_amd_gpus_are_counted_requested_and_tolerated():
    amd = gpu_node(labels={TYPE: "Standard_ND96isr_MI300X_v5"}, resource="amd.com/gpu")
    info = node_info(amd)
    assert (info.gpu_resource, info.gpus, info.gpu_memory_mib) == ("amd.com/gpu", 8, 192 * 1024)
    plan, status = planned([amd])
    assert status["pools"][0]["shape"]["gpuResource"] == "amd.com/gpu" and plan.placed == 1
    spec = pod(plan)
    res = spec["containers"][0]["resources"]
    assert res["limits"]["amd.com/gpu"] == "1" and "nvidia.com/gpu" not in res["limits"]
    assert {t["key"] for t in spec["tolerations"]} >= {"amd.com/gpu", "nvidia.com/gpu"}


def test_server_gpu_resource_counts_another_device():
    intel = gpu_node(resource="gpu.intel.com/i915", gpus=4)
    plan, status = planned([intel], server={"gpuResource": "gpu.intel.com/i915", "gpuMemoryGib": 16})
    (pool,) = status["pools"]
    assert (pool["shape"]["gpusPerNode"], pool["shape"]["gpuResource"], pool["fits"]) == (4, "gpu.intel.com/i915", True)
    assert pod(plan)["containers"][0]["resources"]["requests"]["gpu.intel.com/i915"] == "1"
    # without it the same node has no GPU the operator knows of
    _, status = planned([intel])
    assert status["pools"][0]["shape"]["gpusPerNode"] == 0 and not status["pools"][0]["fits"]
