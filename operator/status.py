"""InferenceService status: conditions that keep their transition times, pool reports; pure, no kopf."""

from __future__ import annotations

from typing import Any

from warmfleet.operator.plan import Plan, pool_status
from warmfleet.operator.schema import to_dict
from warmfleet.operator.spec import Condition

CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "InvalidSpec")


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
) -> dict[str, Any]:
    """Status after a successful reconcile: sizes, replica counts and the four conditions."""
    pools = [pool_status(p, ready_by_pool.get(p.pool.name, 0), plan.engine) for p in plan.pools]
    ready = min(sum(p.ready_replicas for p in pools), plan.placed)
    unfit = [p for p in plan.pools if not p.sizing.fits]
    conds = [_cond("InvalidSpec", False, "SpecValid")]
    if not plan.pools:
        conds.append(_cond("Degraded", True, "NoMatchingNodes", "no Ready, schedulable node matches the node selector"))
    elif plan.capacity < plan.desired:
        detail = "; ".join(f"{p.pool.name}: {p.sizing.message}" for p in unfit)
        msg = f"{plan.desired} replicas wanted, the pools can host {plan.capacity}" + (f" ({detail})" if detail else "")
        conds.append(_cond("Degraded", True, "InsufficientCapacity", msg))
    else:
        conds.append(_cond("Degraded", False, "AsExpected"))
    if ready < plan.placed:
        conds.append(_cond("Progressing", True, "ReplicasStarting", f"{ready}/{plan.placed} server replicas ready"))
    else:
        conds.append(_cond("Progressing", False, "Stable"))
    if plan.desired == 0:
        conds.append(_cond("Ready", True, "ScaledToZero"))
    elif plan.placed and ready >= plan.desired and router_ready > 0:
        conds.append(_cond("Ready", True, "AllReplicasReady", f"{ready} server replicas and {router_ready} routers ready"))
    else:
        conds.append(_cond("Ready", False, "NotReady", f"{ready}/{plan.desired} server replicas, {router_ready} routers ready"))
    conditions = merge_conditions(previous.get("conditions", []), conds, now, generation)
    return {
        "observedGeneration": generation,
        "conditions": conditions,
        "replicas": plan.placed,
        "desiredReplicas": plan.desired,
        "readyReplicas": ready,
        "ready": next(c["status"] for c in conditions if c["type"] == "Ready"),
        "selector": selector,
        "endpoint": endpoint,
        "model": model,
        "pools": [to_dict(p) for p in pools],
    }


def invalid_status(*, message: str, generation: int | None, previous: dict[str, Any], now: str) -> dict[str, Any]:
    """Status for a spec that cannot be reconciled: InvalidSpec with the reason; the rest is kept as it was."""
    out = {k: v for k, v in (previous or {}).items()}
    out["observedGeneration"] = generation
    out["conditions"] = merge_conditions(previous.get("conditions", []), [_cond("InvalidSpec", True, "InvalidSpec", message)], now, generation)
    out.setdefault("ready", "False")
    return out


def status_patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any] | None:
    """A JSON merge patch turning `old` status into `new`, or None when nothing changed."""
    if old == new:
        return None
    patch: dict[str, Any] = {k: v for k, v in new.items() if old.get(k) != v}
    patch.update({k: None for k in old if k not in new})
    return patch
