"""The front doors' objects: what the router (`warmfleet route`) and the endpoint picker (`warmfleet epp`) share
(settings, Deployment, RBAC, PodDisruptionBudget, selector: front_door_*), and the router's own (router_*); pure."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from warmfleet.operator.planning.engine_descriptions import HTTP_PORT
from warmfleet.operator.planning.front_door_limits import front_door_limits
from warmfleet.operator.planning.model_volumes import init_containers, model_dir, router_model_volume
from warmfleet.operator.planning.objects import (
    Owner,
    admin_key_env,
    api_key_env,
    container_security,
    labels,
    meta,
    names,
    pod_ephemeral_storage,
    pod_security,
    service,
    spread_over_nodes,
    with_ephemeral,
)
from warmfleet.operator.planning.pod_overlay import overlay_router_pod
from warmfleet.operator.planning.tracing import front_door_env
from warmfleet.operator.spec.constants import COMPONENT_LABEL, SERVICE_LABEL
from warmfleet.operator.spec.inference_service import InferenceServiceSpec
from warmfleet.server.flagfields import flag_of, to_args
from warmfleet.server.router.core.settings import PolicyConfig, RouterSettings
from warmfleet.server.router.epp.settings import DRAIN_GRACE_S

# How the router is started: the RouterSettings fields the operator sets, rendered in this order (flag names come
# from server/router/core/settings.py, so a renamed flag breaks a unit test, not a cluster)
ROUTER_COMMAND = ["warmfleet", "route"]
ROUTER_FIELDS = ("discover_service", "host", "port", "model", "policy.epsilon", "engine", "peers", "block_size",
                 "max_choices_per_request", "limit_mm_per_prompt")  # the last two: only where the pools set theirs
ROUTER_RESOURCES = {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"cpu": "2", "memory": "2Gi"}}
# Stopping a routing pod: preStop sleeps while the Service's EndpointSlice (and a gateway's view of a picker) drop
# it, then SIGTERM: the process stops taking work and finishes what it has (the picker within --drain-grace-s),
# inside terminationGracePeriodSeconds
PRE_STOP_SLEEP_S = 5
FRONT_DOOR_GRACE_S = PRE_STOP_SLEEP_S + int(DRAIN_GRACE_S) + 5
KEYS_MOUNT, KEYS_FILE, KEYS_VOLUME = "/etc/warmfleet/keys", "keys.json", "client-keys"  # spec.router.keysSecret


def keys_file(spec: InferenceServiceSpec) -> tuple[list[str], list[dict[str, Any]], list[dict[str, Any]]]:
    """spec.router.keysSecret as the front doors take it: (`--api-keys-file PATH`, the Secret volume, its mount)."""
    ref = spec.router.keys_secret
    if ref is None:
        return [], [], []
    vol = {"name": KEYS_VOLUME, "secret": {"secretName": ref.name, "items": [{"key": ref.key, "path": KEYS_FILE}],
                                          "defaultMode": 0o440}}
    mount = {"name": KEYS_VOLUME, "mountPath": KEYS_MOUNT, "readOnly": True}
    return [flag_of(RouterSettings, "api_keys_file"), f"{KEYS_MOUNT}/{KEYS_FILE}"], [vol], [mount]


def front_door_values(owner: Owner, spec: InferenceServiceSpec) -> dict[str, Any]:
    """The settings both routing front doors (`warmfleet route`, `warmfleet epp`) get alike: discovery of the replica
    Service, bounded load from loadBound, the engine kind, the replicas' block size (contract 1: the same hashes) and
    their per-request limits where their extraArgs set any (front_door_limits)."""
    return {
        "discover_service": f"{owner.namespace}/{names(owner)['replicas']}",
        "host": "0.0.0.0",
        "model": model_dir(spec),
        "policy": PolicyConfig(epsilon=round(spec.router.load_bound - 1, 6)),  # epsilon = loadBound - 1
        "engine": spec.engine.kind,
        "block_size": spec.cache.block_size,
        # every pool runs with the same extra args (server_pool.server_args); none of the rendered ones sets a limit
        **front_door_limits([[*spec.server.extra_args, *spec.engine.extra_args]], spec.engine.kind),
    }


def router_settings(owner: Owner, spec: InferenceServiceSpec) -> RouterSettings:
    """What the router pod runs with: `front_door_values`, its HTTP port and the routers' headless Service as peers."""
    return RouterSettings(
        **front_door_values(owner, spec),
        port=HTTP_PORT,
        peers=f"http://{names(owner)['router_peers']}.{owner.namespace}.svc:{HTTP_PORT}",
    )


def router_args(owner: Owner, spec: InferenceServiceSpec) -> list[str]:
    """`warmfleet route` arguments: ROUTER_FIELDS of `router_settings`, rendered by the settings' own flags."""
    return [*ROUTER_COMMAND[1:], *to_args(router_settings(owner, spec), ROUTER_FIELDS)]


@dataclass(frozen=True)
class FrontDoorPod:
    """What tells a routing Deployment (router, endpoint picker) apart; the rest of the pod is shared."""

    name: str  # Deployment and ServiceAccount name
    component: str  # app.kubernetes.io/component of the Deployment and its pods
    command: list[str]  # `warmfleet <subcommand> <flags>`
    ports: list[dict[str, Any]]  # container ports
    probes: dict[str, Any]  # readinessProbe, livenessProbe


def front_door_selector(owner: Owner, component: str) -> dict[str, str]:
    """Selects the pods of one routing component (router, epp) of the service."""
    return {SERVICE_LABEL: owner.name[:63], COMPONENT_LABEL: component}


def front_door_deployment(owner: Owner, spec: InferenceServiceSpec, image: str, pod: FrontDoorPod) -> dict[str, Any]:
    """A Deployment of `spec.router.replicas` routing pods: the tokenizer-only model volume (and fetch-model init
    container), /tmp as HOME, the API key env, the router's resources and hardening; `pod` says the rest."""
    model_vols, model_mounts = router_model_volume(spec)
    keys_args, keys_vols, keys_mounts = keys_file(spec)
    volumes = [{"name": "tmp", "emptyDir": {"sizeLimit": "256Mi"}}, *model_vols, *keys_vols]
    ephemeral = pod_ephemeral_storage(volumes)
    match = front_door_selector(owner, pod.component)
    dep = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta(owner, pod.name, pod.component),
        "spec": {
            "replicas": spec.router.replicas,
            "selector": {"matchLabels": match},
            "template": {
                "metadata": {"labels": labels(owner, pod.component)},
                "spec": {
                    "serviceAccountName": pod.name,
                    "terminationGracePeriodSeconds": FRONT_DOOR_GRACE_S,
                    "securityContext": pod_security(),
                    "topologySpreadConstraints": spread_over_nodes(match),
                    **init_containers(spec, image, "model", tokenizer_only=True, ephemeral=ephemeral),
                    "containers": [{
                        "name": pod.component,
                        "image": image,
                        "imagePullPolicy": spec.server.image_pull_policy,
                        "command": [pod.command[0]],
                        "args": [*pod.command[1:], *keys_args],
                        # The router checks clients' keys (WARMFLEET_API_KEY, --api-keys-file) and, since it then
                        # does not forward theirs, authenticates to the replicas itself (WARMFLEET_REPLICA_API_KEY);
                        # its admin routes take the service's admin key (never a client's).
                        "env": [{"name": "HOME", "value": "/tmp"},
                                *api_key_env(spec, "WARMFLEET_API_KEY", "WARMFLEET_REPLICA_API_KEY"),
                                *admin_key_env(owner, spec),
                                *front_door_env(owner, spec, pod.component)],  # spec.tracing: OTEL_* env
                        "ports": pod.ports,
                        "resources": with_ephemeral(ROUTER_RESOURCES, ephemeral),
                        **pod.probes,
                        "lifecycle": {"preStop": {"sleep": {"seconds": PRE_STOP_SLEEP_S}}},
                        "securityContext": container_security(),
                        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, *model_mounts, *keys_mounts],
                    }],
                    "volumes": volumes,
                },
            },
        },
    }
    dep["spec"]["template"] = overlay_router_pod(dep["spec"]["template"], spec, pod.component)  # spec.router.pod
    return dep


def router_deployment(owner: Owner, spec: InferenceServiceSpec, image: str) -> dict[str, Any]:
    """The router Deployment: `warmfleet route` discovering replicas through EndpointSlices."""
    return front_door_deployment(owner, spec, image, FrontDoorPod(
        name=names(owner)["router"], component="router", command=[ROUTER_COMMAND[0], *router_args(owner, spec)],
        ports=[{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}],
        probes={"readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 5},
                "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10, "failureThreshold": 3}},
    ))


def router_service(owner: Owner, spec: InferenceServiceSpec) -> dict[str, Any]:
    """The OpenAI endpoint: a Service in front of the routers."""
    return service(owner, names(owner)["endpoint"], "router", front_door_selector(owner, "router"),
                    [{"name": "http", "port": spec.router.port, "targetPort": "http", "protocol": "TCP"}],
                    type=spec.router.service_type)


def router_peers_service(owner: Owner) -> dict[str, Any]:
    """Headless Service over the router pods: each router finds the others by its name (--peers) and shares load.
    Its port is `peers`, not `http`: the chart's ServiceMonitor scrapes `http`, which the endpoint Service `NAME`
    already gives it for these pods (one target per router, not two)."""
    return service(owner, names(owner)["router_peers"], "router", front_door_selector(owner, "router"),
                    [{"name": "peers", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"}], clusterIP="None")



def front_door_rbac(owner: Owner, name: str, component: str) -> list[dict[str, Any]]:
    """ServiceAccount, Role and RoleBinding letting a routing pod (router, epp) get/list/watch EndpointSlices: all it
    reads of the API (discovery of the replicas' headless Service)."""
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta(owner, name, component)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": meta(owner, name, component),
            "rules": [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": meta(owner, name, component),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}],
        },
    ]


def router_rbac(owner: Owner) -> list[dict[str, Any]]:
    """ServiceAccount, Role and RoleBinding letting the router list/watch EndpointSlices."""
    return front_door_rbac(owner, names(owner)["router"], "router")



def front_door_pdb(owner: Owner, name: str, component: str) -> dict[str, Any]:
    """PodDisruptionBudget over one routing component's pods: a node drain takes at most one at a time."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": meta(owner, name, component),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": front_door_selector(owner, component)}},
    }


def router_pdb(owner: Owner) -> dict[str, Any]:
    """PodDisruptionBudget over the router pods: a node drain takes at most one router at a time, so the endpoint
    keeps serving while spec.router.replicas > 1 (with one router it cannot help, and does not block the drain)."""
    return front_door_pdb(owner, names(owner)["router_pdb"], "router")

