"""Nodes → node pools: shape extraction and grouping for one InferenceService; pure, no kopf, no I/O."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Mapping

from warmfleet.operator.spec.inference_service import InferenceServiceSpec
from warmfleet.operator.spec.pod_overlay import server_node_selector

GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"  # MiB, as GPU feature discovery writes it
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
    gpu_memory_mib: int  # per GPU; 0 when the label is missing
    gpus: int  # allocatable nvidia.com/gpu
    memory_bytes: int  # allocatable host memory
    schedulable: bool  # Ready and not cordoned


def node_info(body: Mapping[str, Any]) -> NodeInfo:
    """Extract a NodeInfo from a Node object (dict); tolerant of missing fields."""
    meta = body.get("metadata") or {}
    labels = dict(meta.get("labels") or {})
    status = body.get("status") or {}
    alloc = status.get("allocatable") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    cordoned = bool((body.get("spec") or {}).get("unschedulable"))
    try:
        gpu_mem = int(labels.get(GPU_MEMORY_LABEL, "0"))
    except ValueError:
        gpu_mem = 0
    try:
        gpus = int(parse_quantity(alloc.get(GPU_RESOURCE, "0")))
        memory = int(parse_quantity(alloc.get("memory", "0")))
    except ValueError:
        gpus, memory = 0, 0
    return NodeInfo(
        name=meta.get("name", ""),
        labels=labels,
        gpu_product=labels.get(GPU_PRODUCT_LABEL, "unknown"),
        gpu_memory_mib=gpu_mem,
        gpus=gpus,
        memory_bytes=memory,
        schedulable=ready and not cordoned,
    )


@dataclass(frozen=True)
class Pool:
    """Nodes of one shape (within one named pool, if any) that may host a service's replicas."""

    name: str  # DNS-label suffix, stable for a shape
    named: str | None  # spec.pools[].name, or None
    gpu_product: str
    gpu_memory_mib: int
    gpus_per_node: int
    host_memory_bytes: int  # the smallest allocatable memory among the nodes
    nodes: tuple[str, ...]
    selector: tuple[tuple[str, str], ...]  # node labels the pool's pods require (named-pool selector)


def _matches(labels: Mapping[str, str], selector: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _slug(text: str, limit: int) -> str:
    s = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    s = s[len("nvidia-"):] if s.startswith("nvidia-") else s
    return (s[:limit].strip("-")) or "gpu"


def pool_name(named: str | None, product: str, gpus: int, gpu_memory_mib: int) -> str:
    """Stable name of a GPU shape, e.g. `h200-8g-1a2b3`; prefixed by the named pool."""
    key = f"{named}|{product}|{gpu_memory_mib}|{gpus}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:5]
    base = f"{_slug(product, 16)}-{gpus}g-{digest}"
    return f"{named}-{base}" if named else base


def derive_pools(spec: InferenceServiceSpec, nodes: list[NodeInfo]) -> list[Pool]:
    """Group Ready, schedulable nodes matching the selector by shape; sorted by name.

    Host memory joins a shape rounded to the nearest HOST_MEMORY_BUCKET (kubelet reservations
    differ by MiB to a few GiB between otherwise identical nodes); the pool is sized for its
    smallest node, so a replica fits on every member. The name leaves host memory out, so a
    change of allocatable memory re-sizes (rolls) the pool in place instead of renaming it;
    only when one GPU shape comes in several memory sizes do the smaller groups (by node
    count) get a `-<GiB>gi` suffix.
    """
    named = [(p.name, p.node_selector) for p in spec.pools] or [(None, {})]
    groups: dict[tuple, list[NodeInfo]] = {}
    for node in sorted(nodes, key=lambda n: n.name):
        if not node.schedulable or not _matches(node.labels, server_node_selector(spec.node_selector, spec.server.pod)):
            continue
        for pname, selector in named:
            if _matches(node.labels, selector):
                key = (pname, node.gpu_product, node.gpu_memory_mib, node.gpus, round(node.memory_bytes / HOST_MEMORY_BUCKET))
                groups.setdefault(key, []).append(node)
                break
    selectors = dict(named)
    by_name: dict[str, list[tuple[int, list[NodeInfo]]]] = {}
    for (pname, product, mem_mib, gpus, bucket), members in groups.items():
        by_name.setdefault(pool_name(pname, product, gpus, mem_mib), []).append((bucket, members))
    pools = []
    for base, variants in by_name.items():
        variants.sort(key=lambda v: (-len(v[1]), v[0]))  # the largest group keeps the plain name
        for i, (bucket, members) in enumerate(variants):
            first = members[0]
            pname = next(k[0] for k, v in groups.items() if v is members)
            pools.append(Pool(
                name=base if i == 0 else f"{base}-{bucket * HOST_MEMORY_BUCKET // GiB}gi",
                named=pname,
                gpu_product=first.gpu_product,
                gpu_memory_mib=first.gpu_memory_mib,
                gpus_per_node=first.gpus,
                host_memory_bytes=min(n.memory_bytes for n in members),
                nodes=tuple(n.name for n in members),
                selector=tuple(sorted(selectors[pname].items())),
            ))
    return sorted(pools, key=lambda p: p.name)
