"""Nodes → node pools: shape extraction and grouping for one InferenceService; pure, no kopf, no I/O."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Iterator, Mapping

from warmfleet.operator.planning import gpu_products
from warmfleet.operator.planning.engine_descriptions import ENGINES
from warmfleet.operator.planning.taints import Taint, is_system, taints_of, untolerated
from warmfleet.operator.spec.inference_service import InferenceServiceSpec, MemorySource
from warmfleet.operator.spec.pod_overlay import server_node_selector
from warmfleet.operator.spec.schema import to_dict

GPU_RESOURCE = "nvidia.com/gpu"
AMD_GPU_RESOURCE = "amd.com/gpu"
GPU_RESOURCES = (GPU_RESOURCE, AMD_GPU_RESOURCE)  # counted without spec.server.gpuResource, first one present wins
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"  # MiB, as GPU feature discovery writes it
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
NAME_FIELD = "metadata.name"  # the one Node field a NodeSelectorTerm's matchFields may name
GiB = 1 << 30
MiB = 1 << 20
HOST_MEMORY_BUCKET = 16 * GiB  # host memory granularity of a node shape

_SUFFIXES = {
    "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60,
    "n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000), "": 1,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
}
_QUANTITY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$")


def parse_quantity(text: Any) -> Fraction:
    """A Kubernetes quantity ("1Ti", "500m", "8") as an exact Fraction; raises ValueError."""
    m = _QUANTITY.match(str(text).strip())
    if not m:
        raise ValueError(f"not a Kubernetes quantity: {text!r}")
    return Fraction(m.group(1)) * _SUFFIXES[m.group(2) or ""]


def format_bytes(n: int) -> str:
    """Bytes as the canonical binary quantity the API server stores back (largest exact suffix)."""
    for suffix, unit in (("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)):
        if n and n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)


@dataclass(frozen=True)
class NodeInfo:
    """What pool derivation needs from one Node."""

    name: str
    labels: Mapping[str, str] = field(hash=False, compare=True)
    gpu_product: str  # label value, "unknown" without GPU feature discovery
    gpu_memory_mib: int  # per GPU, from the first source that knows (gpu_memory_source); 0 when none does
    gpus: int  # allocatable nvidia.com/gpu, else amd.com/gpu (gpu_resource says which)
    memory_bytes: int  # allocatable host memory
    schedulable: bool  # Ready and not cordoned
    gpu_resource: str = GPU_RESOURCE  # the resource `gpus` counts
    gpu_memory_source: MemorySource | None = None  # label, product or instance-type; None: unknown
    instance_type: str = ""  # node.kubernetes.io/instance-type
    device_counts: Mapping[str, int] = field(default_factory=dict, hash=False)  # allocatable extended resources (x/y)
    cpu_millis: int = 0  # allocatable CPU, millicores
    taints: tuple[Taint, ...] = ()  # spec.taints

    def gpus_of(self, resource: str | None) -> tuple[str, int]:
        """(resource, allocatable count): spec.server.gpuResource when set, else this node's own GPU resource."""
        return (resource, self.device_counts.get(resource, 0)) if resource else (self.gpu_resource, self.gpus)


def gpu_memory(labels: Mapping[str, str]) -> tuple[int, MemorySource | None]:
    """MiB per GPU and its source: GFD's memory label, else the product table (GFD's product label), else the
    cloud's instance type; (0, None) when none knows. A MIG slice or a time-shared GPU is never looked up."""
    try:
        mib = int(labels.get(GPU_MEMORY_LABEL, "0"))
    except ValueError:
        mib = 0
    if mib > 0:
        return mib, "label"
    product = labels.get(GPU_PRODUCT_LABEL)
    if product is not None and not gpu_products.whole_gpu(product):
        return 0, None
    if product is not None and (known := gpu_products.product_memory_mib(product)):
        return known, "product"
    by_type = gpu_products.instance_type_product(labels.get(INSTANCE_TYPE_LABEL, ""))
    if by_type is not None and (known := gpu_products.product_memory_mib(by_type)):
        return known, "instance-type"
    return 0, None


def node_info(body: Mapping[str, Any]) -> NodeInfo:
    """Extract a NodeInfo from a Node object (dict); tolerant of missing fields."""
    meta = body.get("metadata") or {}
    labels = dict(meta.get("labels") or {})
    status = body.get("status") or {}
    alloc = status.get("allocatable") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    cordoned = bool((body.get("spec") or {}).get("unschedulable"))
    gpu_mem, source = gpu_memory(labels)
    devices = {k: _count(v) for k, v in alloc.items() if "/" in k}
    resource = next((r for r in GPU_RESOURCES if devices.get(r)), GPU_RESOURCE)
    try:
        memory = int(parse_quantity(alloc.get("memory", "0")))
    except ValueError:
        memory = 0
    try:
        cpu_millis = int(parse_quantity(alloc.get("cpu", "0")) * 1000)
    except ValueError:
        cpu_millis = 0
    return NodeInfo(
        name=meta.get("name", ""),
        labels=labels,
        gpu_product=labels.get(GPU_PRODUCT_LABEL, "unknown"),
        gpu_memory_mib=gpu_mem,
        gpus=devices.get(resource, 0),
        memory_bytes=memory,
        schedulable=ready and not cordoned,
        gpu_resource=resource,
        gpu_memory_source=source,
        instance_type=labels.get(INSTANCE_TYPE_LABEL, ""),
        device_counts=devices,
        cpu_millis=cpu_millis,
        taints=taints_of(body),
    )


def _count(text: Any) -> int:
    try:
        return int(parse_quantity(text))
    except ValueError:
        return 0


@dataclass(frozen=True)
class NodeFence:
    """One more requirement of a pool's node affinity (pool_fence.py): `key` is a node label (matchExpressions), or
    the field metadata.name (matchFields)."""

    key: str
    operator: str  # In or NotIn
    values: tuple[str, ...]

    def requirement(self) -> tuple[str, dict[str, Any]]:
        """(the NodeSelectorTerm list it joins, the requirement)."""
        where = "matchFields" if self.key == NAME_FIELD else "matchExpressions"
        return where, {"key": self.key, "operator": self.operator, "values": list(self.values)}


@dataclass(frozen=True)
class Pool:
    """Nodes of one shape (within one named pool, if any) that may host a service's replicas."""

    name: str  # DNS-label suffix, stable for a shape
    named: str | None  # spec.pools[].name, or None
    gpu_product: str
    gpu_memory_mib: int  # 0: unknown (gpu_memory_source None)
    gpus_per_node: int
    host_memory_bytes: int  # the smallest allocatable memory among the nodes
    nodes: tuple[str, ...]
    selector: tuple[tuple[str, str], ...]  # node labels the pool's pods require (named-pool selector)
    gpu_resource: str = GPU_RESOURCE  # the extended resource replicas request
    gpu_memory_source: MemorySource | None = None  # label, product, instance-type or spec; None: unknown
    instance_types: tuple[str, ...] = ()  # the members' instance types, when the memory came from them
    cpu_millis: int = 0  # the smallest allocatable CPU among the nodes, millicores (sizes CPU-only replicas)
    fence: NodeFence | None = None  # keeps a CPU pool's pods off GPU nodes its labels do not tell apart (pool_fence.py)

    @property
    def has_gpus(self) -> bool:
        """Whether the pool's nodes have allocatable GPUs (of its resource)."""
        return self.gpus_per_node > 0


def _matches(labels: Mapping[str, str], selector: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _slug(text: str, limit: int) -> str:
    s = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    s = s[len("nvidia-"):] if s.startswith("nvidia-") else s
    return (s[:limit].strip("-")) or "gpu"


def pool_name(named: str | None, product: str, gpus: int, gpu_memory_mib: int, resource: str = GPU_RESOURCE,
              source: MemorySource | None = "label", shown: str | None = None) -> str:
    """Stable name of a GPU shape, e.g. `h200-8g-1a2b3` (`cpu-1a2b3` for nodes without GPUs); prefixed by the named pool. `shown` (the product an
    instance type carries) names a pool GFD did not label; shapes with labels keep the names they always had."""
    key = f"{named}|{product}|{gpu_memory_mib}|{gpus}" + ("" if resource == GPU_RESOURCE else f"|{resource}")
    key += "" if source in (None, "label") else f"|{source}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:5]
    cpu = gpus == 0 and (shown or product) == "unknown"  # a CPU-only shape (it hosts CPU-only replicas)
    base = f"cpu-{digest}" if cpu else f"{_slug(shown or product, 16)}-{gpus}g-{digest}"
    return f"{named}-{base}" if named else base


def derive_pools(spec: InferenceServiceSpec, nodes: list[NodeInfo], tolerated_only: bool = True) -> list[Pool]:
    """Group Ready, schedulable nodes matching the selector by shape; sorted by name. A node with a NoSchedule or
    NoExecute taint the server pods do not tolerate hosts none of them and joins no pool (untolerated_nodes reports
    it), unless `tolerated_only` is False (engine.kind auto: a GPU pool the pods do not tolerate yet still asks for vLLM).

    A shape is the GPU product, memory per GPU (and where that figure came from), the GPU resource and its
    count, and host memory. Host memory joins a shape rounded to the nearest HOST_MEMORY_BUCKET (kubelet
    reservations differ by MiB to a few GiB between otherwise identical nodes); the pool is sized for its
    smallest node, so a replica fits on every member. The name leaves host memory out, so a change of
    allocatable memory re-sizes (rolls) the pool in place instead of renaming it; only when one GPU shape
    comes in several memory sizes do the smaller groups (by node count) get a `-<GiB>gi` suffix.
    """
    groups: dict[tuple, list[NodeInfo]] = {}
    for node, pname, blocked in _candidates(spec, nodes):
        if not (blocked and tolerated_only):
            groups.setdefault(_shape(spec, node, pname), []).append(node)
    selectors = {p.name: p.node_selector for p in spec.pools}
    by_name: dict[str, list[tuple[tuple, list[NodeInfo]]]] = {}
    for key, members in groups.items():
        by_name.setdefault(_shape_name(key, members[0]), []).append((key, members))
    pools = []
    for base, variants in by_name.items():
        variants.sort(key=lambda v: (-len(v[1]), v[0][-1]))  # the largest group keeps the plain name
        for i, ((pname, product, mib, source, resource, gpus, bucket), members) in enumerate(variants):
            pools.append(Pool(
                name=base if i == 0 else f"{base}-{bucket * HOST_MEMORY_BUCKET // GiB}gi",
                named=pname, gpu_product=product, gpu_memory_mib=mib, gpus_per_node=gpus,
                host_memory_bytes=min(n.memory_bytes for n in members),
                cpu_millis=min(n.cpu_millis for n in members),
                nodes=tuple(n.name for n in members),
                selector=tuple(sorted(selectors.get(pname, {}).items())),
                gpu_resource=resource, gpu_memory_source=source,
                instance_types=tuple(sorted({n.instance_type for n in members})) if source == "instance-type" else (),
            ))
    return sorted(pools, key=lambda p: p.name)


@dataclass(frozen=True)
class Untolerated:
    """A Ready, uncordoned node matching the service's selectors that its server pods may not land on."""

    node: str
    pool: str  # the pool (its shape's name) it would join
    taints: tuple[Taint, ...]  # its NoSchedule / NoExecute taints the server pods do not tolerate


def untolerated_nodes(spec: InferenceServiceSpec, nodes: list[NodeInfo]) -> list[Untolerated]:
    """The nodes derive_pools leaves out for taints the server pods do not tolerate, by name; a node that a system
    taint also holds (taints.is_system: a condition, the control plane, a node being removed) is left out silently,
    as a Not-Ready one is: no toleration should bring replicas there."""
    out = []
    for node, pname, blocked in _candidates(spec, nodes):
        if blocked and not any(is_system(t) for t in blocked):
            out.append(Untolerated(node.name, _shape_name(_shape(spec, node, pname), node), blocked))
    return out


def gpu_tolerations(spec: InferenceServiceSpec, gpu_resource: str, has_gpus: bool) -> list[dict[str, str]]:
    """The operator's own tolerations on a pool's server pods: its GPU resources' NoSchedule taints; none for CPU-only
    replicas (sizing.cpu_only: an engine without GPU attention, on a node without GPUs or with
    spec.server.gpusPerReplica 0). engine.kind auto counts as GPU attention exactly where the node has GPUs."""
    engine = ENGINES.get(spec.engine.kind)
    attention = engine.gpu_attention if engine is not None else has_gpus
    if not attention and (spec.server.gpus_per_replica == 0 or not has_gpus):
        return []
    return [{"key": key, "operator": "Exists", "effect": "NoSchedule"} for key in dict.fromkeys((GPU_RESOURCE, gpu_resource))]


def server_tolerations(spec: InferenceServiceSpec, gpu_resource: str, has_gpus: bool) -> list[dict[str, Any]]:
    """Every toleration of a pool's server pods: the operator's (gpu_tolerations), then spec.server.pod's."""
    user = (spec.server.pod.tolerations if spec.server.pod else None) or []
    return gpu_tolerations(spec, gpu_resource, has_gpus) + [to_dict(t) for t in user]


_NO_POOL = "\0"  # a node that matches no spec.pools selector


def _candidates(spec: InferenceServiceSpec, nodes: list[NodeInfo]) -> Iterator[tuple[NodeInfo, str | None, tuple[Taint, ...]]]:
    """Each Ready, uncordoned node matching the service's selector and a named pool's, by name: (node, its named
    pool, the taints its server pods would not tolerate). A node with GPUs of another resource than the one the
    service requests (spec.server.gpuResource) is none: it hosts no replica, CPU-only ones included."""
    named = [(p.name, p.node_selector) for p in spec.pools] or [(None, {})]
    wanted = server_node_selector(spec.node_selector, spec.server.pod)
    for node in sorted(nodes, key=lambda n: n.name):
        pname = next((name for name, selector in named if _matches(node.labels, selector)), _NO_POOL)
        if not node.schedulable or pname == _NO_POOL or not _matches(node.labels, wanted):
            continue
        resource, gpus = node.gpus_of(spec.server.gpu_resource)
        if node.gpus and not gpus:
            continue
        yield node, pname, untolerated(node.taints, server_tolerations(spec, resource, gpus > 0))


def _shape(spec: InferenceServiceSpec, node: NodeInfo, pname: str | None) -> tuple:
    """A node's shape key: (named pool, product, MiB per GPU, its source, GPU resource, GPUs, host-memory bucket)."""
    resource, gpus = node.gpus_of(spec.server.gpu_resource)
    mib, source = _memory(spec, node, gpus)
    return (pname, node.gpu_product, mib, source, resource, gpus, round(node.memory_bytes / HOST_MEMORY_BUCKET))


def _shape_name(key: tuple, node: NodeInfo) -> str:
    """The pool name of a shape key (`node`, one of its members, names a shape GFD did not label)."""
    pname, product, mib, source, resource, gpus, _ = key
    shown = product if product != "unknown" else _inferred_product(node)
    return pool_name(pname, product, gpus, mib, resource, source, shown)


def _memory(spec: InferenceServiceSpec, node: NodeInfo, gpus: int) -> tuple[int, MemorySource | None]:
    """The node's GPU memory figure, else spec.server.gpuMemoryGib for a node with GPUs, else (0, None)."""
    if node.gpu_memory_source is not None:
        return node.gpu_memory_mib, node.gpu_memory_source
    if gpus and spec.server.gpu_memory_gib is not None:
        return int(spec.server.gpu_memory_gib * 1024), "spec"
    return 0, None


def _inferred_product(node: NodeInfo) -> str:
    """For a pool's name only: the product its instance type carries, when GFD did not label one."""
    return gpu_products.instance_type_product(node.instance_type) or "unknown"
