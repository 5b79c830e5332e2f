"""spec.cache.nodeTier (one shared host-memory cache per node, `warmfleet node-tier`) and its status.pools[].nodeTier; no kopf."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, Optional

from warmfleet.operator.spec.schema import Rule, prop

NodeTierMode = Literal["Off", "Auto", "Manual"]

NODE_TIER_RULES: list[Rule] = [
    ("self.mode != 'Manual' || has(self.size)", "size is required when mode is Manual",
     lambda s: s.mode != "Manual" or s.size is not None),
    ("!has(self.min) || !has(self.max) || self.min <= self.max", "min must be <= max",
     lambda s: s.min is None or s.max is None or s.min <= s.max),
]


@dataclass(kw_only=True)
class NodeTierSpec:
    """One cache per node shared by the service's replicas there (KV blocks and encoder outputs), in place of each
    replica's swap tier; a DaemonSet per pool, sized from what the node's memory leaves after the replicas."""

    mode: NodeTierMode = prop("Off", doc=(
        "Off: no node tier (each replica keeps its own swap tier). Auto: per pool, a share (cache.swapFraction) of the "
        "node's allocatable memory left after the reserve and the replicas' own requests, within min/max (GiB). "
        "Manual: size (GiB) on every pool, lowered to what a node can spare."))
    size: Optional[float] = prop(None, doc="Size in GiB when mode is Manual.", minimum=0.25)
    min: Optional[float] = prop(None, doc="Lower bound in GiB for the Auto size (never above what a node can spare).",
                                minimum=0)
    max: Optional[float] = prop(None, doc="Upper bound in GiB for the Auto size.", minimum=0)

    RULES: ClassVar[list[Rule]] = NODE_TIER_RULES

    @property
    def enabled(self) -> bool:
        return self.mode != "Off"


@dataclass(kw_only=True)
class NodeTierStatus:
    """A pool's node tier: its size and the numbers it came from (planning/node_tier.py)."""

    size_gib: float = prop(doc="Capacity of the tier on each node of the pool, GiB (0: not placed, see message).")
    capacity_bytes: int = prop(doc="--capacity-bytes of `warmfleet node-tier`.", format="int64")
    memory_bytes: int = prop(doc="The tier pod's memory request = limit: capacity + 10 % + 512 MiB for the process, bytes.",
                             format="int64")
    allocatable_bytes: int = prop(doc="A node's allocatable memory, bytes.", format="int64")
    reserved_bytes: int = prop(doc="Kept free for kubelet, daemons and page cache (cache.hostReserveFraction), bytes.",
                               format="int64")
    replicas_per_node: int = prop(doc="Replicas a node of the pool hosts at most.")
    replica_memory_bytes: int = prop(doc="Each replica's own memory request (its swap tier 0), bytes.", format="int64")
    spare_bytes: int = prop(doc="allocatable - reserved - replicas x replica memory: the most the tier's pod may take.",
                            format="int64")
    source: str = prop(doc="auto, min, max (which bound set it), manual, or spare (lowered to what the node can spare).")
    message: str = prop("", doc="Why the pool has no node tier, if it has none.")
    hash: str = prop("", doc="Digest of the tier's size; a change rolls its DaemonSet once.")
    desired_pods: Optional[int] = prop(None, doc=(
        "Nodes that should run the pool's tier pod (its DaemonSet's status.desiredNumberScheduled); absent before "
        "the operator has read the DaemonSet back, or when the pool has no tier."))
    ready_pods: Optional[int] = prop(None, doc=(
        "Tier pods ready (the DaemonSet's status.numberReady). Fewer than desiredPods: condition NodeTierReady is "
        "False (NodeTierNotReady) and the replicas on those nodes recompute what the tier would have served."))
