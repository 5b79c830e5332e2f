"""The fence that keeps a CPU pool's server pods on CPU nodes: its node affinity says `nvidia.com/gpu.product
DoesNotExist`, which a GPU node without GPU feature discovery's labels also matches; pure, no kopf, no I/O.

Which fence, in this order (docs/gpu-cluster.md "CPU pools beside GPU nodes without GPU feature discovery"):

    no unlabelled GPU node matches the pool's labels    -> none (the affinity is what it always was)
    a node-group label (NODE_GROUP_LABELS) that every   -> `LABEL In [the pool's groups]`: stays put while nodes
      member carries and no such GPU node shares           come and go in those groups (autoscaling rolls nothing)
    else                                                -> matchFields `metadata.name NotIn [those GPU nodes]`:
                                                           changes only when such a GPU node comes or goes

A list of the pool's own nodes (`kubernetes.io/hostname In [...]`) would be exact too, but would change, and roll every
replica of the pool, each time a CPU node joins or leaves; and a node's hostname label need not be its name.
"""

from __future__ import annotations

import dataclasses

from warmfleet.operator.planning.nodes import GPU_PRODUCT_LABEL, GPU_RESOURCES, NAME_FIELD, NodeFence, NodeInfo, Pool
from warmfleet.operator.spec.inference_service import InferenceServiceSpec
from warmfleet.operator.spec.pod_overlay import server_node_selector

# Labels the clouds and Karpenter put on every node of a node group (one machine shape, GPUs or none, per group).
NODE_GROUP_LABELS = (
    "cloud.google.com/gke-nodepool",  # GKE
    "eks.amazonaws.com/nodegroup",  # EKS managed node groups
    "kubernetes.azure.com/agentpool",  # AKS
    "karpenter.sh/nodepool",  # Karpenter (a NodePool may mix shapes: used only where no GPU node shares it)
)


def has_gpus(spec: InferenceServiceSpec, node: NodeInfo) -> bool:
    """Whether the node has allocatable GPUs: nvidia.com/gpu, amd.com/gpu or spec.server.gpuResource."""
    return any(node.device_counts.get(r, 0) > 0 for r in (*GPU_RESOURCES, spec.server.gpu_resource) if r)


def fence_cpu_pools(spec: InferenceServiceSpec, pools: list[Pool], nodes: list[NodeInfo]) -> list[Pool]:
    """`pools`, each CPU pool with its fence (cpu_pool_fence) where it needs one."""
    return [dataclasses.replace(p, fence=fence) if (fence := cpu_pool_fence(spec, p, nodes)) else p for p in pools]


def cpu_pool_fence(spec: InferenceServiceSpec, pool: Pool, nodes: list[NodeInfo]) -> NodeFence | None:
    """The fence a CPU pool (no GPUs, no product label) needs against the GPU nodes its node affinity would otherwise
    match: nodes with allocatable GPUs and no `nvidia.com/gpu.product` label that carry the service's and the named
    pool's labels, whether Ready, cordoned or tainted (they may be schedulable tomorrow; a list that ignores their
    state does not flap with it). None where no such node exists, or for any other pool."""
    if pool.has_gpus or pool.gpu_product != "unknown":
        return None
    wanted = {**server_node_selector(spec.node_selector, spec.server.pod), **dict(pool.selector)}
    intruders = [n for n in nodes if has_gpus(spec, n) and GPU_PRODUCT_LABEL not in n.labels
                 and all(n.labels.get(k) == v for k, v in wanted.items())]
    if not intruders:
        return None
    members = [n for n in nodes if n.name in set(pool.nodes)]
    for key in NODE_GROUP_LABELS:
        groups = {m.labels.get(key) for m in members}
        if None not in groups and not any(n.labels.get(key) in groups for n in intruders):
            return NodeFence(key, "In", tuple(sorted(g for g in groups if g is not None)))
    return NodeFence(NAME_FIELD, "NotIn", tuple(sorted(n.name for n in intruders)))
