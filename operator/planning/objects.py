"""What every child of an InferenceService shares: owner, images, names, labels, metadata, the Service shell, pod
and container hardening, ephemeral storage; pure (plain dicts), imports spec/ and the engine descriptions only."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from warmfleet.operator.planning.engine_descriptions import engine_of
from warmfleet.operator.spec.constants import COMPONENT_LABEL, MANAGED_BY, POOL_LABEL, SERVICE_LABEL
from warmfleet.operator.spec.inference_service import InferenceServiceSpec

# uid/gid of every container: the images' own user (Dockerfile: useradd --uid 10001), above 10000 so that no
# account of the node shares it (kube-score's container-security-context-user-group-id; docs/security.md)
RUN_AS = 10001
# ephemeral-storage each pod may use besides its emptyDirs: its containers' logs (the kubelet keeps 5 x 10 MiB
# per container by default; the rest is headroom for a chattier engine)
LOG_MIB = 256


@dataclass(frozen=True)
class Owner:
    """The InferenceService the children belong to."""

    name: str
    namespace: str


@dataclass(frozen=True)
class Images:
    """The engine image of the server pods, the slim `warmfleet` image (no Paddle) of the router pods, and the
    operator's own slim image that alone writes the node-wide model cache (the fetch steps of server pods)."""

    engine: str
    router: str
    fetch: str = ""  # '' = router (the operator's defaults, where both are the operator's)
    engines: tuple[tuple[str, str], ...] = ()  # (kind, image): the operator's overrides of vLLM's, FastDeploy's pinned image

    @property
    def fetch_image(self) -> str:
        """The image of the steps that write the node cache: never one a tenant chose."""
        return self.fetch or self.router


def images_for(spec: InferenceServiceSpec, defaults: Images) -> Images:
    """spec.server.image runs the router and, unless engine.image is set, the engine too (one image for both);
    without it the operator's two default images. engine.image wins; vLLM and FastDeploy without it run the operator's
    image for their kind (`defaults.engines`: --vllm-image, --fastdeploy-image), else their description's pinned default
    (the engine kind is resolved: engine_choice.resolve).
    The node cache is written by the operator's own image whatever the spec says (a tenant's image could plant or
    read another namespace's files there)."""
    engine = engine_of(spec)
    pinned = spec.engine.image or dict(defaults.engines).get(engine.kind) or engine.default_image
    if spec.server.image:
        return Images(engine=pinned or spec.server.image, router=spec.server.image, fetch=defaults.fetch_image)
    return Images(engine=pinned or defaults.engine, router=defaults.router, fetch=defaults.fetch_image)



def k8s_name(*parts: str, limit: int = 63) -> str:
    """Join parts with '-' as a DNS label; too long names keep a hash so they stay unique."""
    name = "-".join(p for p in parts if p)
    if len(name) <= limit:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[: limit - 9].rstrip('-')}-{digest}"


def names(owner: Owner) -> dict[str, str]:
    """Names of the fixed children."""
    return {
        "config": k8s_name(owner.name, "config"),
        "adapters": k8s_name(owner.name, "adapters"),
        "replicas": k8s_name(owner.name, "replicas"),
        "router": k8s_name(owner.name, "router"),
        "router_peers": k8s_name(owner.name, "router-peers"),
        "endpoint": k8s_name(owner.name),
        "pdb": k8s_name(owner.name, "server"),
        "router_pdb": k8s_name(owner.name, "router"),
        "admin": k8s_name(owner.name, "admin"),
        "server_policy": k8s_name(owner.name, "server"),
    }


def labels(owner: Owner, component: str, pool: str | None = None) -> dict[str, str]:
    """Labels of a child and its pods."""
    out = {
        "app.kubernetes.io/name": "warmfleet",
        "app.kubernetes.io/instance": owner.name[:63],
        COMPONENT_LABEL: component,
        SERVICE_LABEL: owner.name[:63],
        **MANAGED_BY,
    }
    if pool:
        out[POOL_LABEL] = pool
    return out


def server_selector(owner: Owner) -> dict[str, str]:
    """Selects every server pod of the service (all pools)."""
    return {SERVICE_LABEL: owner.name[:63], COMPONENT_LABEL: "server"}


def selector_string(owner: Owner) -> str:
    """The server pods' selector as a string (status.selector for the scale subresource)."""
    return ",".join(f"{k}={v}" for k, v in sorted(server_selector(owner).items()))


def endpoint_url(owner: Owner, spec: InferenceServiceSpec) -> str:
    """The router's in-cluster OpenAI base URL (proxy mode; gateway mode learns it from the Gateway: gateway.py)."""
    return f"http://{names(owner)['endpoint']}.{owner.namespace}.svc:{spec.router.port}/v1"


def meta(owner: Owner, name: str, component: str, pool: str | None = None) -> dict[str, Any]:
    return {"name": name, "namespace": owner.namespace, "labels": labels(owner, component, pool)}



def api_key_env(spec: InferenceServiceSpec, *names: str) -> list[dict]:
    ref = spec.router.api_key_secret
    if ref is None:
        return []
    return [{"name": n, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}
            for n in names or ("WARMFLEET_API_KEY",)]


ADMIN_KEY = "admin-key"  # the key of the generated admin Secret (passes/admin_secret.py creates it once)


def admin_key_ref(owner: Owner, spec: InferenceServiceSpec) -> tuple[str, str]:
    """(Secret, key) of the admin key the servers' and routers' admin routes take: spec.lora.adminKeySecret, else
    the Secret NAME-admin the operator generates once per service. Never the client API key."""
    ref = spec.lora.admin_key_secret if spec.lora is not None else None
    return (ref.name, ref.key) if ref is not None else (names(owner)["admin"], ADMIN_KEY)


def admin_key_env(owner: Owner, spec: InferenceServiceSpec, name: str = "WARMFLEET_ADMIN_KEY") -> list[dict[str, Any]]:
    """The env var carrying the admin key into a container."""
    secret, key = admin_key_ref(owner, spec)
    return [{"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}]


def pod_security() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
            "seccompProfile": {"type": "RuntimeDefault"}}


def container_security() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}


_MIB = {"Mi": 1, "Gi": 1024, "Ti": 1024 * 1024}


def pod_ephemeral_storage(volumes: list[dict[str, Any]]) -> dict[str, str]:
    """ephemeral-storage of each container of a pod (requests = limits): its disk-backed emptyDirs at their sizeLimit,
    plus LOG_MIB of logs. The kubelet evicts a pod whose emptyDirs and logs together pass its containers' limits (an
    init container counts alone, before the others start), and the request lets the scheduler pick a node with that
    much disk. Memory-backed emptyDirs (/dev/shm) count as memory; hostPath and claims not at all."""
    mib = LOG_MIB
    for vol in volumes:
        empty = vol.get("emptyDir")
        if empty is None or empty.get("medium") == "Memory":
            continue
        size = empty["sizeLimit"]
        mib += int(size[:-2]) * _MIB[size[-2:]]
    # the API server's canonical spelling, so the live object reads back what was applied
    return {"ephemeral-storage": f"{mib // 1024}Gi" if mib % 1024 == 0 else f"{mib}Mi"}


def with_ephemeral(resources: dict[str, dict[str, str]], ephemeral: dict[str, str] | None) -> dict[str, dict[str, str]]:
    if not ephemeral:
        return resources
    return {"requests": {**resources["requests"], **ephemeral}, "limits": {**resources["limits"], **ephemeral}}



def spread_over_nodes(match: dict[str, str]) -> list[dict[str, Any]]:
    """Pods matching `match` spread over nodes where they can be (never unschedulable for it)."""
    return [{
        "maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
        "whenUnsatisfiable": "ScheduleAnyway", "labelSelector": {"matchLabels": match},
    }]



def service(owner: Owner, name: str, component: str, selector: dict[str, str], ports: list[dict[str, Any]],
             **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta(owner, name, component),
            "spec": {**spec, "selector": selector, "ports": ports}}

