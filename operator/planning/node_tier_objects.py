"""The node tier's children (a DaemonSet per pool, its node-local and events Services, its NetworkPolicy) and the flags that point server, router and picker pods at it; pure, no kopf, no I/O.

    server pod ──TCP 7100──▶ Service NAME-node-tier (internalTrafficPolicy: Local) ──▶ the tier pod on the same node
    router/picker ──ZMQ 5560──▶ headless Service NAME-node-tier-events ──▶ every tier pod (KV events, contract 2)

No hostPath, no hostPort, no privilege: the tier pods fit the `baseline` (and `restricted`) Pod Security level.
"""

from __future__ import annotations

import copy
from typing import Any

from warmfleet.operator.planning.network_policy import front_door_peers
from warmfleet.operator.planning.nodes import format_bytes
from warmfleet.operator.planning.objects import (
    Owner,
    container_security,
    k8s_name,
    labels,
    meta,
    pod_ephemeral_storage,
    pod_security,
    server_selector,
    service,
    with_ephemeral,
)
from warmfleet.operator.spec.constants import COMPONENT_LABEL, POOL_LABEL, SERVICE_LABEL, SIZING_HASH_ANNOTATION
from warmfleet.operator.spec.node_tier import NodeTierStatus

COMPONENT = "node-tier"
TIER_PORT = 7100  # `warmfleet node-tier --port`: replicas put and get entries
EVENTS_PORT = 5560  # `warmfleet node-tier --events-port`: its KV events (ZMQ PUB)
NODE_NAME_ENV = {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
TOKEN_ENV = "WARMFLEET_NODE_TIER_TOKEN"  # read by `warmfleet node-tier` and by the replicas' node-tier client
TOKEN_KEY = "token"  # the key in the Secret NAME-node-tier (passes/node_tier_secret.py creates it once)
TIER_CPU = {"requests": {"cpu": "250m"}, "limits": {"cpu": "1"}}
PLACEMENT = ("affinity", "nodeSelector", "tolerations")  # taken from the pool's server pods: the tier runs where they do


def tier_names(owner: Owner) -> dict[str, str]:
    return {"service": k8s_name(owner.name, "node-tier"), "events": k8s_name(owner.name, "node-tier-events"),
            "token": k8s_name(owner.name, "node-tier")}


def tier_daemonset_name(service: str, pool_name: str) -> str:
    """The DaemonSet that runs pool `pool_name`'s tier of InferenceService `service`."""
    return k8s_name(service, "node-tier", pool_name)


def token_env(owner: Owner) -> dict[str, Any]:
    """The tier's token from the generated Secret, for the tier's and the replicas' containers."""
    return {"name": TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": tier_names(owner)["token"], "key": TOKEN_KEY}}}


def tier_pools(planned: list[Any]) -> dict[str, NodeTierStatus]:
    """Pool name → its node tier, for the pools that host replicas and have a tier with a capacity."""
    return {p.pool.name: p.sizing.node_tier for p in planned
            if p.sizing.fits and p.sizing.node_tier is not None and p.sizing.node_tier.capacity_bytes > 0}


def tier_address(owner: Owner) -> str:
    return f"{tier_names(owner)['service']}:{TIER_PORT}"


def events_address(owner: Owner) -> str:
    return f"{tier_names(owner)['events']}:{EVENTS_PORT}"


def tier_selector(owner: Owner) -> dict[str, str]:
    return {SERVICE_LABEL: owner.name[:63], COMPONENT_LABEL: COMPONENT}


def daemonset(owner: Owner, pool_name: str, tier: NodeTierStatus, image: str, server_pod: dict[str, Any],
              pull_policy: str = "IfNotPresent") -> dict[str, Any]:
    """One pool's tier: `warmfleet node-tier` on every node the pool's server pods may run on, memory request = limit."""
    match = {**tier_selector(owner), POOL_LABEL: pool_name}
    volumes = [{"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}]
    ephemeral = pod_ephemeral_storage(volumes)
    memory = format_bytes(tier.memory_bytes)
    resources = with_ephemeral({"requests": {**TIER_CPU["requests"], "memory": memory},
                                "limits": {**TIER_CPU["limits"], "memory": memory}}, ephemeral)
    placement = {k: copy.deepcopy(server_pod[k]) for k in PLACEMENT if server_pod.get(k)}
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": meta(owner, tier_daemonset_name(owner.name, pool_name), COMPONENT, pool_name),
        "spec": {
            "selector": {"matchLabels": match},
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
            "template": {
                "metadata": {"labels": labels(owner, COMPONENT, pool_name),
                             "annotations": {SIZING_HASH_ANNOTATION: tier.hash}},
                "spec": {
                    **placement,
                    "securityContext": pod_security(),
                    "automountServiceAccountToken": False,  # it never calls the API server
                    "terminationGracePeriodSeconds": 10,
                    "containers": [{
                        "name": COMPONENT,
                        "image": image,
                        "imagePullPolicy": pull_policy,
                        "command": ["warmfleet"],
                        "args": ["node-tier", "--capacity-bytes", str(tier.capacity_bytes), "--port", str(TIER_PORT),
                                 "--events-port", str(EVENTS_PORT), "--node-name", "$(NODE_NAME)"],
                        "env": [{"name": "HOME", "value": "/tmp"}, NODE_NAME_ENV, token_env(owner)],
                        "ports": [{"name": "node-tier", "containerPort": TIER_PORT, "protocol": "TCP"},
                                  {"name": "kv-events", "containerPort": EVENTS_PORT, "protocol": "TCP"}],
                        "resources": resources,
                        "readinessProbe": {"tcpSocket": {"port": "node-tier"}, "periodSeconds": 5},
                        "livenessProbe": {"tcpSocket": {"port": "node-tier"}, "periodSeconds": 10, "failureThreshold": 3},
                        "securityContext": container_security(),
                        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
                    }],
                    "volumes": volumes,
                },
            },
        },
    }


def services(owner: Owner) -> list[dict[str, Any]]:
    """NAME-node-tier: each replica reaches the tier of its own node (internalTrafficPolicy: Local); NAME-node-tier-events:
    headless, so the routers subscribe to every tier pod's events."""
    n = tier_names(owner)
    return [
        service(owner, n["service"], COMPONENT, tier_selector(owner),
                [{"name": "node-tier", "port": TIER_PORT, "targetPort": "node-tier", "protocol": "TCP"}],
                internalTrafficPolicy="Local"),
        service(owner, n["events"], COMPONENT, tier_selector(owner),
                [{"name": "kv-events", "port": EVENTS_PORT, "targetPort": "kv-events", "protocol": "TCP"}],
                clusterIP="None"),
    ]


def network_policy(owner: Owner) -> dict[str, Any]:
    """Only this service's server pods reach the tier's port, and only its routers and pickers the events."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta(owner, k8s_name(owner.name, "node-tier"), COMPONENT),
        "spec": {
            "podSelector": {"matchLabels": tier_selector(owner)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": server_selector(owner)}}],
                 "ports": [{"port": TIER_PORT, "protocol": "TCP"}]},
                {"from": front_door_peers(owner), "ports": [{"port": EVENTS_PORT, "protocol": "TCP"}]},
            ],
        },
    }


def point_at_tier(objs: list[dict[str, Any]], owner: Owner, pools_with_tier: set[str]) -> list[dict[str, Any]]:
    """Copies of `objs` whose server containers (pools in `pools_with_tier`) get --node-tier, --node-name and NODE_NAME,
    and whose router and picker containers get --node-tier-events."""
    out = []
    for obj in objs:
        if obj.get("kind") != "Deployment":
            out.append(obj)
            continue
        obj = copy.deepcopy(obj)
        tpl_labels = obj["spec"]["template"]["metadata"].get("labels") or {}
        component = tpl_labels.get(COMPONENT_LABEL)
        containers = obj["spec"]["template"]["spec"]["containers"]
        if component == "server" and tpl_labels.get(POOL_LABEL) in pools_with_tier:
            c = next(c for c in containers if c["name"] == "server")
            c["args"] = [*c["args"], "--node-tier", tier_address(owner), "--node-name", "$(NODE_NAME)"]
            c["env"] = [NODE_NAME_ENV, *c.get("env", []), token_env(owner)]
        elif component in ("router", "epp") and pools_with_tier:
            c = next(c for c in containers if c["name"] == component)
            c["args"] = [*c["args"], "--node-tier-events", events_address(owner)]
        out.append(obj)
    return out


def node_tier_children(owner: Owner, planned: list[Any], image: str, pull_policy: str,
                       objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`objs` pointed at the node tier, with its DaemonSets (before the server Deployments that use them), Services and
    NetworkPolicy; `objs` unchanged when no pool has a tier. `planned`: server_pool.PlannedPool of the plan."""
    tiers = tier_pools(planned)
    if not tiers:
        return objs
    servers = {(o["spec"]["template"]["metadata"]["labels"] or {}).get(POOL_LABEL): o for o in objs
               if o.get("kind") == "Deployment"
               and (o["spec"]["template"]["metadata"].get("labels") or {}).get(COMPONENT_LABEL) == "server"}
    tier_objs = [network_policy(owner), *services(owner),
                 *(daemonset(owner, name, tier, image, servers[name]["spec"]["template"]["spec"], pull_policy)
                   for name, tier in sorted(tiers.items()) if name in servers)]
    pointed = point_at_tier(objs, owner, set(tiers))
    first_server = next((i for i, o in enumerate(pointed) if o.get("kind") == "Deployment"), len(pointed))
    return pointed[:first_server] + tier_objs + pointed[first_server:]
