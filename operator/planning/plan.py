"""Spec + nodes → the desired state: pools, sizes, replica split and children; pure, no kopf."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from warmfleet.operator.planning import children, engine_choice, objects, server_pool
from warmfleet.operator.planning.admin_policy import AdminPolicy
from warmfleet.operator.planning.nodes import NodeInfo, Pool, Untolerated, derive_pools, untolerated_nodes
from warmfleet.operator.planning.pool_fence import fence_cpu_pools
from warmfleet.operator.planning.node_tier import size_pool
from warmfleet.operator.planning.sizing import PoolSizing, assign_replicas
from warmfleet.operator.spec.inference_service import (
    EngineKind,
    InferenceServiceSpec,
    PoolBounds,
    PoolShape,
    PoolStatus,
)


@dataclass(frozen=True)
class Plan:
    """What one InferenceService should look like given the nodes."""

    pools: list[server_pool.PlannedPool]
    desired: int  # replicas wanted
    capacity: int  # replicas the fitting pools can host
    children: list[dict[str, Any]]
    engine: EngineKind  # every pool runs the service's engine
    engine_choice: engine_choice.EngineChoice | None = None  # who chose it and why (None: a plan made before the choice)
    untolerated: tuple[Untolerated, ...] = ()  # nodes left out of the pools for taints the server pods do not tolerate

    @property
    def placed(self) -> int:
        """Replicas assigned to pools (desired, capped by capacity)."""
        return sum(p.replicas for p in self.pools)


def make_plan(owner: objects.Owner, spec: InferenceServiceSpec, nodes: list[NodeInfo], images: objects.Images,
              policy: AdminPolicy = AdminPolicy(), choice: engine_choice.EngineChoice | None = None) -> Plan:
    """Derive pools from nodes, size each, split the replicas and build every child object (within the admin's
    `policy`, which the caller has checked the spec against: admin_policy.check). engine.kind auto is resolved here
    unless the caller did (`choice`: engine_choice.resolve, whose spec it passes)."""
    if choice is None:
        spec, choice = engine_choice.resolve(spec, nodes)
    sized = [(pool, size_pool(spec, pool)) for pool in fence_cpu_pools(spec, derive_pools(spec, nodes), nodes)]
    caps, floors = pool_limits(spec, sized)
    desired = spec.desired_replicas()
    split = assign_replicas(desired, caps, floors)
    desired = max(desired, sum(split))  # per-pool minima raise the total
    planned = [server_pool.PlannedPool(pool, sizing, n) for (pool, sizing), n in zip(sized, split)]
    return Plan(planned, desired, sum(caps), children.build_children(owner, spec, images, planned, policy), choice.kind,
                choice, tuple(untolerated_nodes(spec, nodes)))


def pool_limits(spec: InferenceServiceSpec, sized: list[tuple[Pool, PoolSizing]]) -> tuple[list[int], list[int]]:
    """Per pool: most replicas (what its nodes host, lowered to its autoscaling maxReplicas) and fewest (its minReplicas)."""
    caps = [sizing.capacity_per_node * len(pool.nodes) for pool, sizing in sized]
    floors = [0] * len(caps)
    if spec.autoscaling is not None and spec.autoscaling.pools:
        bounds = [pool_bounds(spec, pool) for pool, _ in sized]
        floors = [b.min_replicas if b else 0 for b in bounds]
        caps = [min(c, b.max_replicas) if b and b.max_replicas is not None else c for c, b in zip(caps, bounds)]
    return caps, floors


def planned_limits(spec: InferenceServiceSpec, plan: Plan) -> tuple[dict[str, int], dict[str, int]]:
    """pool_limits of a plan's pools, by pool name."""
    caps, floors = pool_limits(spec, [(p.pool, p.sizing) for p in plan.pools])
    names = [p.pool.name for p in plan.pools]
    return dict(zip(names, caps)), dict(zip(names, floors))


def pool_bounds(spec: InferenceServiceSpec, pool: Pool) -> PoolBounds | None:
    """The autoscaling bounds of `pool`: by its own name, else by the spec.pools name it belongs to (per shape)."""
    bounds = {b.name: b for b in (spec.autoscaling.pools if spec.autoscaling else [])}
    return bounds.get(pool.name) or (bounds.get(pool.named) if pool.named else None)


def pool_status(p: server_pool.PlannedPool, ready: int, engine: EngineKind) -> PoolStatus:
    """Status entry of one pool: the engine it runs, nodes, shape, sizes and their inputs."""
    pool = p.pool
    return PoolStatus(
        name=pool.name,
        engine=engine,
        nodes=list(pool.nodes),
        shape=PoolShape(gpu_product=pool.gpu_product, gpu_memory_mib=pool.gpu_memory_mib,
                        gpus_per_node=pool.gpus_per_node, host_memory_bytes=pool.host_memory_bytes,
                        gpu_resource=pool.gpu_resource, cpu_millis=pool.cpu_millis),
        fits=p.sizing.fits,
        message=p.sizing.message,
        replicas=p.replicas,
        ready_replicas=ready,
        sizes=p.sizing.sizes,
        inputs=p.sizing.inputs,
        node_tier=p.sizing.node_tier,
    )
