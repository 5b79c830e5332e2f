"""The server pods' NetworkPolicy (spec.server.networkPolicy, on by default): who may open which of their ports; pure.

    port            admitted from
    kv-events,      this service's routers (proxy mode) or endpoint pickers (gateway mode) only: the events carry
    kv-replay, ...  prompt token ids, and the replay port hands out past ones
    http            the same, the operator's namespace (adapter loads; AdminPolicy.operator_namespace, else every
                    namespace), the admin's namespaces (AdminPolicy.server_http_from: Prometheus scrapes /metrics
                    there), and in gateway mode any pod (the Gateway's proxies send requests straight to the pods;
                    the API key guards them)
    metrics         anyone (Prometheus; counters only)

Ingress only: the servers' own egress (model hubs, the node tier) is left to the cluster's policies. The kubelet's
probes come from the node and pass whatever the policy says.
"""

from __future__ import annotations

from typing import Any

from warmfleet.operator.planning.admin_policy import AdminPolicy
from warmfleet.operator.planning.engine_descriptions import engine_of
from warmfleet.operator.planning.objects import Owner, meta, names, server_selector
from warmfleet.operator.spec.constants import COMPONENT_LABEL, SERVICE_LABEL
from warmfleet.operator.spec.inference_service import InferenceServiceSpec

OPEN_PORTS = ("metrics",)  # ports any pod may reach
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set on every namespace by the API server (1.22+)


def front_door_peers(owner: Owner) -> list[dict[str, Any]]:
    """`from` entries selecting this service's routers and endpoint pickers (same namespace)."""
    return [{"podSelector": {"matchExpressions": [
        {"key": SERVICE_LABEL, "operator": "In", "values": [owner.name[:63]]},
        {"key": COMPONENT_LABEL, "operator": "In", "values": ["router", "epp"]},
    ]}}]


def server_network_policy(owner: Owner, spec: InferenceServiceSpec, policy: AdminPolicy) -> dict[str, Any] | None:
    """The NetworkPolicy over this service's server pods, or None when spec.server.networkPolicy is false."""
    if not spec.server.network_policy:
        return None
    ports = engine_of(spec).ports
    peers = front_door_peers(owner)
    rules: list[dict[str, Any]] = []
    events = [p for p in ports if p.name != "http" and p.name not in OPEN_PORTS]
    if events:
        rules.append({"from": peers, "ports": [{"protocol": "TCP", "port": p.name} for p in events]})
    http = [{"protocol": "TCP", "port": "http"}]
    if spec.router.mode == "gateway" or "*" in policy.server_http_from or not policy.operator_namespace:
        rules.append({"ports": http})  # the Gateway's proxies wherever they run; or the admin opened it; or unknown
    else:
        namespaces = sorted({policy.operator_namespace, *policy.server_http_from})
        rules.append({"from": peers + [{"namespaceSelector": {"matchExpressions": [
            {"key": NAMESPACE_NAME_LABEL, "operator": "In", "values": namespaces}]}}], "ports": http})
    opened = [p for p in ports if p.name in OPEN_PORTS]
    if opened:
        rules.append({"ports": [{"protocol": "TCP", "port": p.name} for p in opened]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta(owner, names(owner)["server_policy"], "server"),
        "spec": {"podSelector": {"matchLabels": server_selector(owner)}, "policyTypes": ["Ingress"], "ingress": rules},
    }
