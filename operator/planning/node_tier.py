"""The node tier's size per pool (spec.cache.nodeTier), and the pool's replicas sized without their own swap tier; pure (no kopf, no HTTP, no kubernetes client).

One node of a pool, memory in bytes (A: its allocatable memory, the pool's smallest):

    A ─┬─ reserved       A x cache.hostReserveFraction (kubelet, daemons, page cache)
       ├─ R x replica     each replica's own request, sized with --swap-space 0 (the node tier replaces it)
       └─ spare           what the tier's pod may take: its capacity and the process around it
    the tier's pod:  memory = capacity x (1 + NODE_TIER_HEADROOM) + NODE_TIER_BASE_BYTES  (request = limit)
    largest capacity:  (spare - NODE_TIER_BASE_BYTES) / (1 + NODE_TIER_HEADROOM)
    Auto:   capacity = cache.swapFraction x the largest, floored to 0.25 GiB, clamped to min/max, never above it
    Manual: capacity = size, never above the largest
so R replicas and the tier fit A - reserved, and neither is OOM-killed.

Only warmfleet's engine has a node-tier client; another engine's pools keep their own CPU tier (status says why).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math

from warmfleet.operator.planning import sizing
from warmfleet.operator.planning.engine_descriptions import engine_of
from warmfleet.operator.planning.nodes import GiB, MiB, Pool
from warmfleet.operator.spec.inference_service import CacheSpec, GiBSize, InferenceServiceSpec
from warmfleet.operator.spec.node_tier import NodeTierSpec, NodeTierStatus

NODE_TIER_BASE_BYTES = 512 * MiB  # the interpreter, asyncio, msgpack frames in flight (1 MiB pieces), the ZMQ queue
NODE_TIER_HEADROOM = 0.10  # Python's own bookkeeping of the entries beyond --capacity-bytes (docs/node-tier.md: ~10 %)
NODE_TIER_SOURCE = "nodeTier"  # inputs.sources.swapSpace of a pool whose replicas use the node tier
# The CPU tier each replica of another engine keeps instead (rendered by engine_descriptions.py, sized like the swap tier)
OWN_CPU_TIER = {"vllm": "vLLM's native offloading: --kv-offloading-backend native, --kv-offloading-size",
                "fastdeploy": "FastDeploy's hierarchical cache: --swap-space"}


def size_pool(spec: InferenceServiceSpec, pool: Pool) -> sizing.PoolSizing:
    """sizing.size_pool, plus the node tier: with it, the replicas' swap tier is 0 and `node_tier` says its size."""
    base = sizing.size_pool(spec, pool)
    tier_spec = spec.cache.node_tier
    if not tier_spec.enabled or not base.fits:
        return base
    kind = engine_of(spec).kind
    if kind != "warmfleet":
        return dataclasses.replace(base, node_tier=_absent(pool, spec.cache, base, other_engine_message(kind)))
    without_swap = sizing.size_pool(_no_swap(spec), pool)
    if not without_swap.fits or without_swap.sizes is None or without_swap.inputs is None:
        return base
    tier = size_node_tier(tier_spec, spec.cache, pool, without_swap.replicas_per_node, without_swap.sizes.memory_bytes)
    if tier.capacity_bytes == 0:  # nothing to spare: the replicas keep their own swap tier
        return dataclasses.replace(base, node_tier=tier)
    inputs = dataclasses.replace(without_swap.inputs,
                                 sources={**without_swap.inputs.sources, "swapSpace": NODE_TIER_SOURCE})
    return dataclasses.replace(without_swap, inputs=inputs, node_tier=tier)


def other_engine_message(kind: str) -> str:
    """Why a pool of engine `kind` (not warmfleet's) gets no node tier, and what its replicas keep instead."""
    own = OWN_CPU_TIER.get(kind, "the engine's own")
    out = (f"engine {kind} has no node-tier client (only warmfleet's engine): its replicas keep their own CPU tier "
           f"({own}, sized like the swap tier)")
    if kind == "vllm":  # LMCache's server runs on CPU (tests/vllm/test_vllm_lmcache.py), not yet rendered
        out += "; a node-shared tier through LMCache's server is not rendered yet (docs/node-tier-vllm.md)"
    return out


def size_node_tier(tier: NodeTierSpec, cache: CacheSpec, pool: Pool, replicas_per_node: int,
                   replica_memory_bytes: int) -> NodeTierStatus:
    """The tier's capacity on each node of `pool` (the arithmetic at the top); capacity 0 with a message if none fits."""
    alloc = pool.host_memory_bytes
    reserved = int(alloc * cache.host_reserve_fraction)
    spare = alloc - reserved - replicas_per_node * replica_memory_bytes
    cap_gib = _floor_step((spare - NODE_TIER_BASE_BYTES) / (1 + NODE_TIER_HEADROOM) / GiB) if spare > 0 else 0.0
    numbers = dict(allocatable_bytes=alloc, reserved_bytes=reserved, replicas_per_node=replicas_per_node,
                   replica_memory_bytes=replica_memory_bytes, spare_bytes=max(spare, 0))
    if cap_gib <= 0:
        return NodeTierStatus(size_gib=0.0, capacity_bytes=0, memory_bytes=0, source="spare", **numbers, message=(
            f"a node has {alloc / GiB:.2f} GiB allocatable: after the reserve ({reserved / GiB:.2f}), {replicas_per_node} "
            f"replicas of {replica_memory_bytes / GiB:.2f} GiB, {max(spare, 0) / GiB:.2f} GiB is left: too little for a "
            f"node tier (its process alone takes {NODE_TIER_BASE_BYTES / GiB:.2f} GiB)"))
    if tier.mode == "Manual":
        gib, source = float(tier.size or 0.0), "manual"
    else:
        gib, source = _clamp(_floor_step(cache.swap_fraction * cap_gib), tier)
    if gib > cap_gib:
        gib, source = cap_gib, "spare"
    capacity = int(gib * GiB)
    memory = tier_memory_bytes(capacity)
    return NodeTierStatus(size_gib=gib, capacity_bytes=capacity, memory_bytes=memory, source=source, **numbers,
                          hash=node_tier_hash(capacity, memory))


def tier_memory_bytes(capacity_bytes: int) -> int:
    """The tier pod's memory request = limit for `capacity_bytes`, rounded up to MiB."""
    need = capacity_bytes + math.ceil(capacity_bytes * NODE_TIER_HEADROOM) + NODE_TIER_BASE_BYTES
    return -(-need // MiB) * MiB


def node_tier_hash(capacity_bytes: int, memory_bytes: int) -> str:
    """Digest of what the tier's size puts into its pod template; a new value rolls the DaemonSet once."""
    return hashlib.sha256(f"node-tier|{capacity_bytes}|{memory_bytes}".encode()).hexdigest()[:12]


def _absent(pool: Pool, cache: CacheSpec, base: sizing.PoolSizing, message: str) -> NodeTierStatus:
    alloc = pool.host_memory_bytes
    return NodeTierStatus(size_gib=0.0, capacity_bytes=0, memory_bytes=0, allocatable_bytes=alloc,
                          reserved_bytes=int(alloc * cache.host_reserve_fraction), replicas_per_node=base.replicas_per_node,
                          replica_memory_bytes=base.sizes.memory_bytes if base.sizes else 0, spare_bytes=0,
                          source="none", message=message)


def _no_swap(spec: InferenceServiceSpec) -> InferenceServiceSpec:
    """The spec with its replicas' swap tier at 0 (the node tier takes its place)."""
    return dataclasses.replace(spec, cache=dataclasses.replace(spec.cache, swap_space=GiBSize(mode="Fixed", size=0.0)))


def _floor_step(gib: float) -> float:
    return max(0.0, math.floor(gib / sizing.GIB_STEP + 1e-9) * sizing.GIB_STEP)


def _clamp(gib: float, tier: NodeTierSpec) -> tuple[float, str]:
    if tier.min is not None and gib < tier.min:
        return float(tier.min), "min"
    if tier.max is not None and gib > tier.max:
        return float(tier.max), "max"
    return gib, "auto"
