"""InferenceService status: conditions that keep their transition times, pool reports; pure, no kopf."""

from __future__ import annotations

import dataclasses
from typing import Any

from warmfleet.operator.planning.diagnose import Diagnosis, STARTING
from warmfleet.operator.planning.gateway import GatewayState
from warmfleet.operator.planning.gateway import CONDITION_TYPES as GATEWAY_CONDITIONS
from warmfleet.operator.planning.node_tier_objects import tier_pools
from warmfleet.operator.planning.plan import Plan, pool_status
from warmfleet.operator.spec.inference_service import Condition
from warmfleet.operator.spec.schema import to_dict

# ModelConfigUnavailable: passes/model_config.py; NodeTierReady: only while a pool has a node tier; the last three
# (gateway mode only): gateway.py
CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "InvalidSpec", "ModelConfigUnavailable", "EngineFit", "GPUMemoryKnown",
                   "TaintsTolerated", "NodeTierReady", *GATEWAY_CONDITIONS)
# Conditions whose False is a warning about the pools (the service may still be Ready): a Warning Event when they turn
# False with a new reason. EngineFit: the engine has no GPU attention backend on GPU pools, or a GPU engine meets
# pools without GPUs (NoCPUBuild); GPUMemoryKnown: no
# source gave a GPU pool's memory (nodes.py), so its encoder cache stays at the floor; TaintsTolerated: nodes left out of
# the pools for taints the server pods do not tolerate (nodes.untolerated_nodes).
POOL_WARNING_CONDITIONS = ("EngineFit", "GPUMemoryKnown", "TaintsTolerated")
# Ready=False reasons that are progress, not a problem: every other Ready=False reason (a pod problem,
# NoMatchingNodes, InsufficientCapacity) is worth a Warning Event when it appears.
PROGRESS_READY_REASONS = frozenset({STARTING, "NotReady"})
AUTOSCALER_KEYS = ("warmup", "autoscaling")  # status keys the autoscaler's timer owns; a reconcile keeps them


def warnings(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, str]]:
    """(reason, message) of each Warning to post for the transition from `old` to `new` status.

    A Warning is due when the Ready condition turns to a problem reason, or the Degraded condition
    turns True with a new reason; a message that changes under the same reason (counts moving) is
    not news. One Event per reason, Ready's first.
    """
    def cond(status: dict[str, Any], type_: str) -> dict[str, Any]:
        return next((c for c in (status or {}).get("conditions", []) if c.get("type") == type_), {})

    out: list[tuple[str, str]] = []
    ready, was = cond(new, "Ready"), cond(old, "Ready")
    if ready.get("status") == "False" and ready.get("reason") not in PROGRESS_READY_REASONS \
            and (was.get("status"), was.get("reason")) != ("False", ready.get("reason")):
        out.append((ready["reason"], ready.get("message", "")))
    degraded, was = cond(new, "Degraded"), cond(old, "Degraded")
    if degraded.get("status") == "True" and (was.get("status"), was.get("reason")) != ("True", degraded.get("reason")) \
            and degraded.get("reason") not in {r for r, _ in out}:
        out.append((degraded["reason"], degraded.get("message", "")))
    for type_ in POOL_WARNING_CONDITIONS:
        now, was = cond(new, type_), cond(old, type_)
        if now.get("status") == "False" and (was.get("status"), was.get("reason")) != ("False", now.get("reason")):
            out.append((now["reason"], now.get("message", "")))
    return out


def merge_conditions(previous: list[dict[str, Any]], new: list[Condition], now: str, generation: int | None) -> list[dict[str, Any]]:
    """New conditions as dicts; a condition whose status did not change keeps its lastTransitionTime.

    Types absent from `new` are carried over unchanged, so a partial update (an invalid
    spec) does not erase what is known about the running children.
    """
    old = {c.get("type"): c for c in previous or []}
    out: dict[str, dict[str, Any]] = {t: dict(c) for t, c in old.items()}
    for c in new:
        prior = old.get(c.type)
        c.last_transition_time = prior.get("lastTransitionTime") if prior and prior.get("status") == c.status else now
        c.observed_generation = generation
        out[c.type] = to_dict(c)
    return [out[t] for t in CONDITION_TYPES if t in out]


def _cond(type_: str, ok: bool, reason: str, message: str = "") -> Condition:
    return Condition(type=type_, status="True" if ok else "False", reason=reason, message=message)  # type: ignore[arg-type]


def healthy_status(
    *, plan: Plan, generation: int | None, model: str, endpoint: str, selector: str,
    ready_by_pool: dict[str, int], router_ready: int, previous: dict[str, Any], now: str,
    pods: Diagnosis | None = None, gateway: GatewayState | None = None,
    node_tiers: dict[str, tuple[int, int]] | None = None,
) -> dict[str, Any]:
    """Status after a successful reconcile: sizes, replica counts and the four conditions.

    `pods` (from diagnose.diagnose over the service's pods) says why replicas are not Ready; it
    becomes the Ready condition's reason and message, most severe first:
    a pod problem (MissingPVC, MissingSecret, ImagePullBackOff, CrashLoopBackOff, Unschedulable, ...),
    else NoMatchingNodes, else InsufficientCapacity (every placed replica Ready, too few placed),
    else Starting, else NotReady (no pod seen yet).

    `gateway` (gateway mode) adds InferencePoolReady, EndpointPickerReady and HTTPRouteReady; a CRD the cluster
    lacks is Ready's reason before any other (GatewayAPIInferenceExtensionMissing, GatewayAPIMissing), and the
    endpoint pickers stand in for the routers. Without it (proxy mode) those three conditions are removed.

    `node_tiers` (pool -> (ready, desired) pods of its node-tier DaemonSet, as read back) fills
    status.pools[].nodeTier's readyPods/desiredPods and NodeTierReady; without a pool that has a tier, that
    condition is removed.
    """
    pools = [with_tier_pods(pool_status(p, ready_by_pool.get(p.pool.name, 0), plan.engine), node_tiers)
             for p in plan.pools]
    ready = min(sum(p.ready_replicas for p in pools), plan.placed)
    conds = [_cond("InvalidSpec", False, "SpecValid"), *_capacity_conditions(plan, ready), *pool_conditions(plan)]
    routers, missing = "routers", None
    if gateway is not None:
        conds += gateway_conditions(gateway)
        router_ready, routers, missing = gateway.epp_ready, "endpoint pickers", gateway.missing
    conds.append(_ready_condition(plan, ready, f"{router_ready} {routers}", router_ready > 0, missing, pods or Diagnosis()))
    tiers = sorted(tier_pools(plan.pools))
    if tiers and node_tiers is not None:
        conds.append(node_tier_condition(tiers, node_tiers))
    # gateway conditions that no longer apply (proxy mode; no spec.router.gateway) are removed, not carried over,
    # and NodeTierReady once no pool has a tier
    stale = (set(GATEWAY_CONDITIONS) | ({"NodeTierReady"} if not tiers else set())) - {c.type for c in conds}
    kept = [c for c in previous.get("conditions", []) if c.get("type") not in stale]
    conditions = merge_conditions(kept, conds, now, generation)
    return {
        # absent, not null, for an object without metadata.generation (`warmfleet operator render` of a file):
        # the CRD's status schema says integer
        **({"observedGeneration": generation} if generation is not None else {}),
        "conditions": conditions,
        "replicas": plan.placed,
        "desiredReplicas": plan.desired,
        "readyReplicas": ready,
        "ready": next(c["status"] for c in conditions if c["type"] == "Ready"),
        "selector": selector,
        "endpoint": endpoint,
        "model": model,
        **({"engine": to_dict(plan.engine_choice.status())} if plan.engine_choice is not None else {}),
        "pools": [to_dict(p) for p in pools],
        # written by the autoscaler's timer (autoscale_pass.py), carried over as they were
        **{k: previous[k] for k in AUTOSCALER_KEYS if previous.get(k) is not None},
    }


def _capacity_conditions(plan: Plan, ready: int) -> list[Condition]:
    """Degraded (no matching node, too little capacity) and Progressing (replicas still starting)."""
    unfit = [p for p in plan.pools if not p.sizing.fits]
    if not plan.pools:
        degraded = _cond("Degraded", True, "NoMatchingNodes", no_matching_nodes_message(plan))
    elif plan.capacity < plan.desired:
        detail = "; ".join(f"{p.pool.name}: {p.sizing.message}" for p in unfit)
        msg = f"{plan.desired} replicas wanted, the pools can host {plan.capacity}" + (f" ({detail})" if detail else "")
        degraded = _cond("Degraded", True, "InsufficientCapacity", msg)
    else:
        degraded = _cond("Degraded", False, "AsExpected")
    if ready < plan.placed:
        return [degraded, _cond("Progressing", True, "ReplicasStarting", f"{ready}/{plan.placed} server replicas ready")]
    return [degraded, _cond("Progressing", False, "Stable")]


def pool_conditions(plan: Plan) -> list[Condition]:
    """EngineFit (the engine chosen and why; False: no GPU attention backend on GPU pools) and GPUMemoryKnown
    (False names the GPU pools whose memory no source gave: nodes.py's order)."""
    out = []
    choice = plan.engine_choice
    if choice is not None and choice.lacks_gpu_backend:
        out.append(_cond("EngineFit", False, "NoGPUAttentionBackend", choice.no_gpu_backend_message()))
    elif choice is not None and choice.gpu_engine_on_cpu_pools:
        out.append(_cond("EngineFit", False, "NoCPUBuild", choice.cpu_pools_message()))
    elif choice is not None and choice.chosen_by == "spec":
        out.append(_cond("EngineFit", True, "EngineFromSpec", choice.reason))
    elif choice is not None and choice.gpu_pools and not choice.cpu_replicas:
        out.append(_cond("EngineFit", True, "AutoGPUPools", choice.reason))
    elif choice is not None:
        out.append(_cond("EngineFit", True, "AutoCPUOnly", choice.reason))
    unknown = [p.pool.name for p in plan.pools if p.pool.has_gpus and p.pool.gpu_memory_source is None]
    if unknown:
        out.append(_cond("GPUMemoryKnown", False, "GPUMemoryUnknown", unknown_gpu_memory_message(unknown)))
    else:
        out.append(_cond("GPUMemoryKnown", True, "GPUMemoryFound", "every GPU pool's memory per GPU is known "
                                                                   "(status.pools[].inputs.sources.gpuMemory)"))
    if plan.untolerated:
        out.append(_cond("TaintsTolerated", False, "UntoleratedTaints", untolerated_message(plan)))
    else:
        out.append(_cond("TaintsTolerated", True, "AllTaintsTolerated", "the server pods tolerate the taints of every "
                                                                        "Ready node that matches the selectors"))
    return out


def untolerated_message(plan: Plan, shown: int = 5) -> str:
    """Which nodes each pool lost to taints the server pods do not tolerate (at most `shown` names a pool), whether
    that was every node of the pool, and the fix (condition, Event and `warmfleet operator render`)."""
    by_pool: dict[str, list[Any]] = {}
    for u in plan.untolerated:
        by_pool.setdefault(u.pool, []).append(u)
    planned = {p.pool.name for p in plan.pools}
    parts = []
    for pool, items in sorted(by_pool.items()):
        names = [u.node for u in items]
        listed = ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")
        taints = ", ".join(sorted({str(t) for u in items for t in u.taints}))
        whole = "" if pool in planned else "; no node of the pool is left, it hosts no replica"
        parts.append(f"pool {pool}: {len(names)} {'node' if len(names) == 1 else 'nodes'} ({listed}) tainted {taints}{whole}")
    return ("the server pods do not tolerate these nodes' taints, so no replica is placed there: " + "; ".join(parts)
            + ". Tolerate the taint in spec.server.pod.tolerations (docs/pod-overlays.md), or keep the service off "
              "those nodes with spec.nodeSelector")


def no_matching_nodes_message(plan: Plan) -> str:
    """Why no pool formed: no node matches, or those that do carry taints the server pods do not tolerate."""
    if plan.untolerated:
        return ("no Ready, schedulable node matches the node selector whose taints the server pods tolerate "
                "(TaintsTolerated names the others)")
    return "no Ready, schedulable node matches the node selector"


def with_tier_pods(pool: Any, node_tiers: dict[str, tuple[int, int]] | None) -> Any:
    """`pool` (a PoolStatus) with its tier DaemonSet's ready and desired pods, when it has a tier and they were read."""
    counts = (node_tiers or {}).get(pool.name)
    if pool.node_tier is None or counts is None:
        return pool
    tier = dataclasses.replace(pool.node_tier, ready_pods=counts[0], desired_pods=counts[1])
    return dataclasses.replace(pool, node_tier=tier)


def node_tier_condition(tiers: list[str], node_tiers: dict[str, tuple[int, int]]) -> Condition:
    """NodeTierReady: True when every tier pool's DaemonSet has all its desired pods ready (and at least one);
    False (NodeTierNotReady) names the pools short of it. Replicas keep serving without their node's tier (they
    recompute), so the service's Ready does not depend on it."""
    short = []
    for name in tiers:
        ready, desired = node_tiers.get(name, (0, 0))
        if desired == 0 or ready < desired:
            short.append(f"pool {name}: {ready}/{desired} node-tier pods ready"
                         + (" (none scheduled yet)" if desired == 0 else ""))
    if short:
        return _cond("NodeTierReady", False, "NodeTierNotReady", "; ".join(short) + (
            "; replicas on nodes without a ready tier recompute what it would serve (kubectl describe daemonset "
            "-l app.kubernetes.io/component=node-tier)"))
    total = sum(node_tiers[n][0] for n in tiers)
    return _cond("NodeTierReady", True, "NodeTierPodsReady", f"{total} node-tier pods ready (pools {', '.join(tiers)})")


def unknown_gpu_memory_message(pools: list[str]) -> str:
    """Why a GPU pool's memory is unknown and how to tell the operator (condition, Event, render warning)."""
    return (f"GPU memory per GPU unknown for pools {', '.join(pools)}: no nvidia.com/gpu.memory label (GPU feature "
            "discovery), a product and an instance type the operator's table does not know; their encoder cache "
            "stays at its floor. Set spec.server.gpuMemoryGib, or install GPU feature discovery")


def _ready_condition(plan: Plan, ready: int, routers: str, routing: bool, missing: tuple[str, str] | None,
                     diag: Diagnosis) -> Condition:
    """Ready, and when not, the most severe reason: a missing CRD, a pod problem, no matching node, too little
    capacity, Starting, else NotReady. `routers` counts the ready front doors ("2 routers"); `routing`: any ready."""
    if plan.desired == 0 and missing is None:
        return _cond("Ready", True, "ScaledToZero")
    if plan.placed and ready >= plan.desired and routing and missing is None:
        return _cond("Ready", True, "AllReplicasReady", f"{ready} server replicas and {routers} ready")
    counted = f"{ready}/{plan.desired} server replicas, {routers} ready"
    if missing is not None:
        reason, message = missing[0], f"{missing[1]}; {counted}"
    elif diag.problem:
        reason, message = str(diag.reason), f"{diag.message}; {counted}"
    elif not plan.pools:
        reason, message = "NoMatchingNodes", f"{no_matching_nodes_message(plan)}; {counted}"
    elif plan.capacity < plan.desired and ready >= plan.placed:
        reason, message = "InsufficientCapacity", f"{plan.desired} replicas wanted, the pools can host {plan.capacity}; {counted}"
    elif diag.reason == STARTING:
        reason, message = STARTING, f"{diag.message}; {counted}"
    else:
        reason, message = "NotReady", counted
    return _cond("Ready", False, reason, message)


def gateway_conditions(g: GatewayState) -> list[Condition]:
    """InferencePoolReady (created, or its CRD missing), EndpointPickerReady (a ready EPP pod) and, with
    spec.router.gateway, HTTPRouteReady (created; the Gateway's Accepted verdict when it gave one)."""
    out = []
    if g.pool_served:
        out.append(_cond("InferencePoolReady", True, "InferencePoolCreated",
                         f"InferencePool {g.pool}: endpoint picker Service {g.epp}, failureMode {g.failure_mode}"))
    else:
        out.append(_cond("InferencePoolReady", False, *g.pool_missing))  # type: ignore[misc]
    if g.epp_ready > 0:
        out.append(_cond("EndpointPickerReady", True, "EndpointPickerAvailable", f"{g.epp_ready} endpoint pickers ready"))
    else:
        out.append(_cond("EndpointPickerReady", False, "EndpointPickerUnavailable", f"no ready pod of Deployment {g.epp} yet"))
    if g.route_wanted:
        if not g.route_served:
            out.append(_cond("HTTPRouteReady", False, *g.route_missing))  # type: ignore[misc]
        elif not g.pool_served:
            out.append(_cond("HTTPRouteReady", False, "InferencePoolMissing", "the HTTPRoute waits for its InferencePool"))
        elif g.route_accepted is False:
            out.append(_cond("HTTPRouteReady", False, "NotAccepted", f"Gateway {g.gateway}: {g.route_message}"))
        elif g.route_accepted:
            out.append(_cond("HTTPRouteReady", True, "Accepted", f"Gateway {g.gateway} accepted the route"))
        else:
            out.append(_cond("HTTPRouteReady", True, "HTTPRouteCreated",
                             f"attached to Gateway {g.gateway}; its controller has not reported on the route yet"))
    return out


def invalid_status(*, message: str, generation: int | None, previous: dict[str, Any], now: str) -> dict[str, Any]:
    """Status for a spec that cannot be reconciled: InvalidSpec with the reason; the rest is kept as it was."""
    out = {k: v for k, v in (previous or {}).items()}
    if generation is not None:
        out["observedGeneration"] = generation
    out["conditions"] = merge_conditions(previous.get("conditions", []), [_cond("InvalidSpec", True, "InvalidSpec", message)], now, generation)
    out.setdefault("ready", "False")
    return out


def status_patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any] | None:
    """A JSON merge patch turning `old` status into `new`, or None when nothing changed."""
    if old == new:
        return None
    return _merge_patch(old, new)


def _merge_patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    # Nested objects (status.modelConfig) are patched key by key: a key they lost must be sent as null,
    # or the API server keeps it. Lists (conditions, pools) are replaced whole, as merge patch does.
    patch: dict[str, Any] = {}
    for k, v in new.items():
        was = old.get(k)
        if was != v:
            patch[k] = _merge_patch(was, v) if isinstance(was, dict) and isinstance(v, dict) else v
    patch.update({k: None for k in old if k not in new})
    return patch
