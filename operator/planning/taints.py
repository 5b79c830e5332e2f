"""Node taints and pod tolerations, matched as the scheduler matches them (which nodes a pod may land on); pure, no
kopf, no I/O, nothing of the operator's own objects."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

# Effects that keep a pod off a node it does not tolerate; PreferNoSchedule only lowers the node's score.
BLOCKING_EFFECTS = ("NoSchedule", "NoExecute")
# Taints the cluster itself sets on nodes no workload should join: node conditions and cordons (node.kubernetes.io/
# not-ready, unschedulable, memory-pressure, ...), the control plane, a cloud node not yet initialised, a node the
# cluster autoscaler or Karpenter is removing. Nobody is asked to tolerate these.
SYSTEM_TAINT_PREFIXES = ("node.kubernetes.io/", "node.cloudprovider.kubernetes.io/", "karpenter.sh/")
SYSTEM_TAINT_KEYS = frozenset({"node-role.kubernetes.io/control-plane", "node-role.kubernetes.io/master",
                               "ToBeDeletedByClusterAutoscaler"})


@dataclass(frozen=True)
class Taint:
    """One entry of a Node's spec.taints."""

    key: str
    value: str  # "" when the taint has none
    effect: str  # NoSchedule, PreferNoSchedule or NoExecute

    def __str__(self) -> str:
        """As `kubectl taint` writes it: key=value:Effect (key:Effect without a value)."""
        return f"{self.key}{'=' + self.value if self.value else ''}:{self.effect}"


def is_system(taint: Taint) -> bool:
    """A taint the cluster sets on nodes that are not for workloads (SYSTEM_TAINT_PREFIXES, SYSTEM_TAINT_KEYS)."""
    return taint.key in SYSTEM_TAINT_KEYS or taint.key.startswith(SYSTEM_TAINT_PREFIXES)


def taints_of(body: Mapping[str, Any]) -> tuple[Taint, ...]:
    """A Node object's taints (tolerant of missing fields)."""
    return tuple(Taint(str(t.get("key") or ""), str(t.get("value") or ""), str(t.get("effect") or ""))
                 for t in (body.get("spec") or {}).get("taints") or [] if isinstance(t, Mapping))


def tolerates(toleration: Mapping[str, Any], taint: Taint) -> bool:
    """Kubernetes' Toleration.ToleratesTaint: an effect, when given, must be the taint's; a key, when given, must be
    the taint's (none, with operator Exists, matches every key); operator Exists matches any value, Equal (the
    default) the taint's exact value. Any other operator tolerates nothing."""
    if toleration.get("effect") and toleration["effect"] != taint.effect:
        return False
    if toleration.get("key") and toleration["key"] != taint.key:
        return False
    operator = toleration.get("operator") or "Equal"
    if operator == "Exists":
        return True
    return operator == "Equal" and (toleration.get("value") or "") == taint.value


def untolerated(taints: Iterable[Taint], tolerations: Iterable[Mapping[str, Any]]) -> tuple[Taint, ...]:
    """The taints among `taints` that keep a pod with `tolerations` off the node: NoSchedule and NoExecute ones no
    toleration matches."""
    tolerations = list(tolerations)
    return tuple(t for t in taints if t.effect in BLOCKING_EFFECTS and not any(tolerates(x, t) for x in tolerations))
