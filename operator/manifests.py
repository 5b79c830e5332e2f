"""Pure builders of an InferenceService's children (plain dicts); no kopf, no I/O, no f-string YAML."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from warmfleet.operator.engines import KV_EVENTS_PORT  # noqa: F401  (re-exported: callers read ports here)
from warmfleet.operator import lora
from warmfleet.operator.engines import HTTP_PORT, Engine, LoraLimits, RenderInput, engine_of
from warmfleet.operator.nodes import GPU_MEMORY_LABEL, GPU_PRODUCT_LABEL, GPU_RESOURCE, Pool, format_bytes
from warmfleet.operator.sizing import PoolSizing
from warmfleet.operator.spec import DEFAULT_DTYPE, DEFAULT_MODEL_CACHE, GROUP, InferenceServiceSpec, served_name
from warmfleet.server.flagfields import to_args
from warmfleet.server.router.core.settings import PolicyConfig, RouterSettings
from warmfleet.source import ModelSource, parse_source

MODEL_MOUNT = "/models"
SIZING_HASH_ANNOTATION = f"{GROUP}/sizing-hash"
SERVICE_LABEL = f"{GROUP}/service"
POOL_LABEL = f"{GROUP}/pool"
COMPONENT_LABEL = "app.kubernetes.io/component"
MANAGED_BY = {"app.kubernetes.io/managed-by": "warmfleet-operator"}
# uid/gid of every container: the images' own user (Dockerfile: useradd --uid 10001), above 10000 so that no
# account of the node shares it (kube-score's container-security-context-user-group-id; docs/security.md)
RUN_AS = 10001
# ephemeral-storage each pod may use besides its emptyDirs: its containers' logs (the kubelet keeps 5 x 10 MiB
# per container by default; the rest is headroom for a chattier engine)
LOG_MIB = 256

# How the router is started: the RouterSettings fields the operator sets, rendered in this order (flag names come
# from server/router/core/settings.py, so a renamed flag breaks a unit test, not a cluster)
ROUTER_COMMAND = ["warmfleet", "route"]
ROUTER_FIELDS = ("discover_service", "host", "port", "model", "policy.epsilon", "engine", "peers", "block_size")
ROUTER_RESOURCES = {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"cpu": "2", "memory": "2Gi"}}

# The init container of hf:// and s3:// sources. NOTE: `warmfleet fetch-model` flags live here (checked against
# warmfleet/fetch.py by a test); it streams to disk, so it needs little memory whatever the model's size.
FETCH_CONTAINER = "fetch-model"
FETCH_COMMAND = ["warmfleet", "fetch-model"]
FETCH_FLAGS = {"dest": "--dest", "tokenizer_only": "--tokenizer-only", "s3_endpoint": "--s3-endpoint",
               "s3_region": "--s3-region", "termination_log": "--termination-log"}
FETCH_RESOURCES = {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"cpu": "2", "memory": "1Gi"}}
MODEL_CACHE_VOLUME = "model-cache"
ROUTER_MODEL_GIB = 1  # the router's emptyDir for configs, tokenizer files and chat templates (no weights)
# Download credentials: Secret key → environment variable (the same names); optional keys may be absent.
HF_SECRET_KEYS = (("HF_TOKEN", False),)
S3_SECRET_KEYS = (("AWS_ACCESS_KEY_ID", False), ("AWS_SECRET_ACCESS_KEY", False), ("AWS_SESSION_TOKEN", True))


@dataclass(frozen=True)
class Owner:
    """The InferenceService the children belong to."""

    name: str
    namespace: str


@dataclass(frozen=True)
class Images:
    """The engine image of the server pods, and the slim `warmfleet` image (no Paddle) of the router pods and
    the fetch-model init step."""

    engine: str
    router: str


def images_for(spec: InferenceServiceSpec, defaults: Images) -> Images:
    """spec.server.image runs the router and, unless engine.image is set, the engine too (one image for both);
    without it the operator's two default images. engine.image (CEL requires it for vllm and fastdeploy) wins."""
    if spec.server.image:
        return Images(engine=spec.engine.image or spec.server.image, router=spec.server.image)
    return Images(engine=spec.engine.image or defaults.engine, router=defaults.router)


@dataclass(frozen=True)
class PlannedPool:
    """A pool with its sizing and the replicas assigned to it."""

    pool: Pool
    sizing: PoolSizing
    replicas: int


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


def _meta(owner: Owner, name: str, component: str, pool: str | None = None) -> dict[str, Any]:
    return {"name": name, "namespace": owner.namespace, "labels": labels(owner, component, pool)}


def render_input(owner: Owner, spec: InferenceServiceSpec, sizing: PoolSizing) -> RenderInput:
    """What a pool's engine arguments are rendered from."""
    assert sizing.sizes is not None
    sz = sizing.sizes
    return RenderInput(
        model_dir=_model_dir(spec), served_name=served_name(spec, owner.name), dtype=spec.model.dtype or DEFAULT_DTYPE,
        max_model_len=spec.model.max_model_len, block_size=spec.cache.block_size, prefix_caching=spec.cache.prefix_caching,
        max_num_batched_tokens=spec.server.max_num_batched_tokens, tensor_parallel=spec.server.gpus_per_replica,
        swap_space_gib=sz.swap_space_gib, processor_cache_gib=sz.processor_cache_gib,
        encoder_cache_tokens=sz.encoder_cache_tokens, gpu_memory_utilization=sz.gpu_memory_utilization,
        lora=LoraLimits(spec.lora.max_loras, spec.lora.num_cpu_loras, spec.lora.max_lora_rank) if spec.lora else None,
    )


def server_args(owner: Owner, spec: InferenceServiceSpec, sizing: PoolSizing) -> list[str]:
    """The engine's arguments for one pool (its description's flags), then server.extraArgs and engine.extraArgs."""
    rendered = engine_of(spec).args(render_input(owner, spec, sizing))
    return rendered + list(spec.server.extra_args) + list(spec.engine.extra_args)


def model_source(spec: InferenceServiceSpec) -> ModelSource | None:
    """spec.model.source parsed; None for the older path (+ pvc) form."""
    return parse_source(spec.model.source) if spec.model.source else None


def _model_dir(spec: InferenceServiceSpec) -> str:
    """The checkpoint directory inside server and router containers."""
    src = model_source(spec)
    if src is None:
        return spec.model.path or ""
    if src.downloads:
        return f"{MODEL_MOUNT}/{src.cache_subdir()}"
    if src.kind == "pvc":
        return f"{MODEL_MOUNT}/{src.path}" if src.path else MODEL_MOUNT
    return src.path


def _claim(spec: InferenceServiceSpec) -> str | None:
    src = model_source(spec)
    return src.claim if src is not None and src.kind == "pvc" else (spec.model.pvc if src is None else None)


def _model_volume(spec: InferenceServiceSpec) -> tuple[list[dict], list[dict]]:
    """Volumes and server mounts of the model: a claim at /models (pvc://, path + pvc), or the model cache's
    directory of this model (hf://, s3://; the fetch-model init container fills it), or nothing (baked in)."""
    src = model_source(spec)
    if src is not None and src.downloads:
        vol = _cache_volume(spec)
        # only this model's directory, read-only (a node-wide cache holds other services' models too)
        mount = {"name": MODEL_CACHE_VOLUME, "mountPath": _model_dir(spec), "subPath": src.cache_subdir(), "readOnly": True}
        return [vol], [mount]
    return _local_model_volume(spec)


def _cache_volume(spec: InferenceServiceSpec) -> dict[str, Any]:
    """The node-local model cache: spec.model.cache's claim or hostPath, else the default hostPath."""
    cache = spec.model.cache
    if cache is not None and cache.pvc:
        return {"name": MODEL_CACHE_VOLUME, "persistentVolumeClaim": {"claimName": cache.pvc}}
    host = (cache.host_path if cache is not None else None) or DEFAULT_MODEL_CACHE
    return {"name": MODEL_CACHE_VOLUME, "hostPath": {"path": host, "type": "DirectoryOrCreate"}}


def _local_model_volume(spec: InferenceServiceSpec) -> tuple[list[dict], list[dict]]:
    claim = _claim(spec)
    if not claim:
        return [], []
    vol = {"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
    mount = {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}
    return [vol], [mount]


ADAPTERS_LIST_VOLUME = "adapters-list"
ADAPTER_FETCH_CONTAINER = "fetch-adapters"  # init step: the adapters listed when the pod starts
ADAPTER_WATCH_CONTAINER = "adapter-fetch"  # sidecar: adapters added while the pod runs
ADAPTER_FETCH_FLAGS = {"adapters": "--adapters", "adapters_dir": "--adapters-dir", "watch_s": "--watch-s",
                       "hub_endpoint": "--hub-endpoint", "s3_endpoint": "--s3-endpoint", "s3_region": "--s3-region"}
ADAPTER_WATCH_RESOURCES = {"requests": {"cpu": "50m", "memory": "256Mi"}, "limits": {"cpu": "1", "memory": "256Mi"}}


def _lora_volumes(owner: Owner, spec: InferenceServiceSpec, model_vols: list[dict]) -> tuple[list[dict], list[dict]]:
    """With spec.lora: the model cache (if the model's volumes lack it) and the adapters ConfigMap; the server's
    read-only mount of the service's adapters directory. Nothing of it depends on spec.adapters."""
    if spec.lora is None:
        return [], []
    vols = [] if any(v["name"] == MODEL_CACHE_VOLUME for v in model_vols) else [_cache_volume(spec)]
    vols.append({"name": ADAPTERS_LIST_VOLUME, "configMap": {"name": names(owner)["adapters"]}})
    mount = {"name": MODEL_CACHE_VOLUME, "mountPath": lora.ADAPTERS_MOUNT,
             "subPath": lora.cache_subdir(owner.namespace, owner.name), "readOnly": True}
    return vols, [mount]


def adapter_fetch_container(owner: Owner, spec: InferenceServiceSpec, image: str, *, watch: bool,
                            ephemeral: dict[str, str] | None = None) -> dict[str, Any]:
    """`warmfleet fetch-model --adapters`: once before the server starts (init), or every fetchIntervalSeconds beside it
    (sidecar). Both read the adapters ConfigMap, so the pod template does not change with spec.adapters."""
    assert spec.lora is not None
    lo = spec.lora
    values: list[tuple[str, str]] = [
        ("adapters", f"{lora.ADAPTERS_LIST_MOUNT}/{lora.ADAPTERS_FILE}"),
        ("adapters_dir", f"{lora.CACHE_MOUNT}/{lora.cache_subdir(owner.namespace, owner.name)}"),
    ]
    if watch:
        values.append(("watch_s", str(lo.fetch_interval_seconds)))
    if lo.hub is not None and lo.hub.endpoint:
        values.append(("hub_endpoint", lo.hub.endpoint))
    if lo.s3 is not None and lo.s3.endpoint:
        values.append(("s3_endpoint", lo.s3.endpoint))
    if lo.s3 is not None and lo.s3.region:
        values.append(("s3_region", lo.s3.region))
    args = [FETCH_COMMAND[1]]
    for key, value in values:
        args += [ADAPTER_FETCH_FLAGS[key], value]
    creds = [{"name": key, "valueFrom": {"secretKeyRef": {"name": lo.credentials_secret, "key": key, "optional": True}}}
             for key, _ in HF_SECRET_KEYS + S3_SECRET_KEYS] if lo.credentials_secret else []
    return {
        "name": ADAPTER_WATCH_CONTAINER if watch else ADAPTER_FETCH_CONTAINER,
        "image": image,
        "imagePullPolicy": spec.server.image_pull_policy,
        "command": [FETCH_COMMAND[0]],
        "args": args,
        "env": [{"name": "HOME", "value": "/tmp"}, {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"}, *creds],
        "resources": _with_ephemeral(ADAPTER_WATCH_RESOURCES if watch else FETCH_RESOURCES, ephemeral),
        "securityContext": _container_security(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [{"name": MODEL_CACHE_VOLUME, "mountPath": lora.CACHE_MOUNT},
                         {"name": ADAPTERS_LIST_VOLUME, "mountPath": lora.ADAPTERS_LIST_MOUNT, "readOnly": True},
                         {"name": "tmp", "mountPath": "/tmp"}],
    }


def adapters_config_map(owner: Owner, spec: InferenceServiceSpec) -> dict[str, Any]:
    """The adapters the fetch steps fetch and the operator loads: [{name, source, path}] (changes roll nothing)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(owner, names(owner)["adapters"], "config"),
        "data": {lora.ADAPTERS_FILE: json.dumps(lora.adapters_list(spec), indent=2, sort_keys=True)},
    }


def _credentials_env(spec: InferenceServiceSpec, src: ModelSource) -> list[dict[str, Any]]:
    name = spec.model.credentials_secret
    if not name:
        return []
    keys = HF_SECRET_KEYS if src.kind == "hf" else S3_SECRET_KEYS
    return [{"name": key, "valueFrom": {"secretKeyRef": {"name": name, "key": key, **({"optional": True} if optional else {})}}}
            for key, optional in keys]


def fetch_container(spec: InferenceServiceSpec, image: str, volume: str, *, tokenizer_only: bool = False,
                    ephemeral: dict[str, str] | None = None) -> dict[str, Any]:
    """The init container that downloads an hf:// or s3:// model into `volume` (mounted at /models) before the
    server (or, with only tokenizer files, the router) starts. Same security as every container; /tmp is its HOME."""
    src = model_source(spec)
    assert src is not None and src.downloads
    m = spec.model
    values: list[tuple[str, str | None]] = [("dest", _model_dir(spec)), ("termination_log", "/dev/termination-log")]
    if tokenizer_only:
        values.append(("tokenizer_only", None))
    if m.s3 is not None and m.s3.endpoint:
        values.append(("s3_endpoint", m.s3.endpoint))
    if m.s3 is not None and m.s3.region:
        values.append(("s3_region", m.s3.region))
    args = [FETCH_COMMAND[1], src.raw]
    for key, value in values:
        args += [FETCH_FLAGS[key]] + ([value] if value is not None else [])
    env = [{"name": "HOME", "value": "/tmp"}, {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"}]
    if src.kind == "hf" and m.hub is not None and m.hub.endpoint:
        env.append({"name": "HF_ENDPOINT", "value": m.hub.endpoint})
    return {
        "name": FETCH_CONTAINER,
        "image": image,
        "imagePullPolicy": spec.server.image_pull_policy,
        "command": [FETCH_COMMAND[0]],
        "args": args,
        "env": env + _credentials_env(spec, src),
        "resources": _with_ephemeral(FETCH_RESOURCES, ephemeral),
        "securityContext": _container_security(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [{"name": volume, "mountPath": MODEL_MOUNT}, {"name": "tmp", "mountPath": "/tmp"}],
    }


def _init_containers(spec: InferenceServiceSpec, image: str, volume: str, *, tokenizer_only: bool = False,
                     ephemeral: dict[str, str] | None = None) -> dict[str, Any]:
    """{"initContainers": [fetch-model]} for hf:// and s3:// sources, else nothing (templates stay as they were)."""
    src = model_source(spec)
    if src is None or not src.downloads:
        return {}
    return {"initContainers": [fetch_container(spec, image, volume, tokenizer_only=tokenizer_only, ephemeral=ephemeral)]}


def _router_model_volume(spec: InferenceServiceSpec) -> tuple[list[dict], list[dict]]:
    """The router reads configs, tokenizer files and chat templates: a small emptyDir the init container fills
    for hf:// and s3:// sources (no node-local cache needed on router nodes), else the server's volume."""
    src = model_source(spec)
    if src is None or not src.downloads:
        return _model_volume(spec)
    vol = {"name": "model", "emptyDir": {"sizeLimit": f"{ROUTER_MODEL_GIB}Gi"}}
    return [vol], [{"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}]


def _server_pod_security(spec: InferenceServiceSpec) -> dict[str, Any]:
    sec = _pod_security()
    src = model_source(spec)
    if src is not None and src.downloads and spec.model.cache is not None and spec.model.cache.pvc:
        sec["fsGroupChangePolicy"] = "OnRootMismatch"  # not a recursive chown of the whole cache at every start
    return sec


def _api_key_env(spec: InferenceServiceSpec, *names: str) -> list[dict]:
    ref = spec.router.api_key_secret
    if ref is None:
        return []
    return [{"name": n, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}
            for n in names or ("WARMFLEET_API_KEY",)]


def _pod_security() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
            "seccompProfile": {"type": "RuntimeDefault"}}


def _container_security() -> dict[str, Any]:
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


def _with_ephemeral(resources: dict[str, dict[str, str]], ephemeral: dict[str, str] | None) -> dict[str, dict[str, str]]:
    if not ephemeral:
        return resources
    return {"requests": {**resources["requests"], **ephemeral}, "limits": {**resources["limits"], **ephemeral}}


def node_affinity(spec: InferenceServiceSpec, pool: Pool) -> dict[str, Any]:
    """Required node affinity to the pool's shape: the service selector, the named pool, GPU labels."""
    wanted = {**spec.node_selector, **dict(pool.selector)}
    exprs = [{"key": k, "operator": "In", "values": [v]} for k, v in sorted(wanted.items())]
    if pool.gpu_product == "unknown":
        exprs.append({"key": GPU_PRODUCT_LABEL, "operator": "DoesNotExist"})
    else:
        exprs.append({"key": GPU_PRODUCT_LABEL, "operator": "In", "values": [pool.gpu_product]})
    if pool.gpu_memory_mib:
        exprs.append({"key": GPU_MEMORY_LABEL, "operator": "In", "values": [str(pool.gpu_memory_mib)]})
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": exprs}]}}}


ENGINE_SIGTERM_DRAIN_S = 30  # what an engine gives in-flight requests after SIGTERM (warmfleet serve's default)


def server_deployment(owner: Owner, spec: InferenceServiceSpec, image: str, planned: PlannedPool,
                      fetch_image: str | None = None) -> dict[str, Any]:
    """One pool's server Deployment; the pod template carries the sizing hash so only changed pools roll.

    hf:// and s3:// models are downloaded first by a `warmfleet fetch-model` init container running
    `fetch_image` (the warmfleet image, whatever the engine's; default `image`).
    """
    pool, sizing = planned.pool, planned.sizing
    assert sizing.sizes is not None
    sz = sizing.sizes
    match = {**server_selector(owner), POOL_LABEL: pool.name}
    d = spec.disruption
    engine = engine_of(spec)
    model_vols, model_mounts = _model_volume(spec)
    lora_vols, lora_mounts = _lora_volumes(owner, spec, model_vols)
    model_mounts = model_mounts + lora_mounts
    volumes = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": format_bytes(sz.shm_bytes)}},
        {"name": "tmp", "emptyDir": {"sizeLimit": f"{engine.tmp_gib}Gi"}},
        *model_vols,
        *lora_vols,
    ]
    ephemeral = pod_ephemeral_storage(volumes)
    inits = _init_containers(spec, fetch_image or image, MODEL_CACHE_VOLUME, ephemeral=ephemeral)
    sidecars: list[dict[str, Any]] = []
    if spec.lora is not None:
        inits.setdefault("initContainers", []).append(
            adapter_fetch_container(owner, spec, fetch_image or image, watch=False, ephemeral=ephemeral))
        sidecars.append(adapter_fetch_container(owner, spec, fetch_image or image, watch=True, ephemeral=ephemeral))
    surge = 0 if d.max_unavailable > 0 else 1  # GPUs are scarce: surge only when nothing may be unavailable
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(owner, k8s_name(owner.name, pool.name), "server", pool.name),
        "spec": {
            "replicas": planned.replicas,
            "selector": {"matchLabels": match},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": d.max_unavailable, "maxSurge": surge}},
            "template": {
                "metadata": {"labels": labels(owner, "server", pool.name), "annotations": {SIZING_HASH_ANNOTATION: sz.hash}},
                "spec": {
                    "affinity": node_affinity(spec, pool),
                    "topologySpreadConstraints": _spread_over_nodes(match),
                    "tolerations": [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}],
                    "securityContext": _server_pod_security(spec),
                    # engines never call the API server: no token of the namespace's default ServiceAccount in the pod
                    "automountServiceAccountToken": False,
                    # preStop, then the engine's SIGTERM drain (`warmfleet serve --drain-timeout-s`, 30 s), then its exit
                    "terminationGracePeriodSeconds": d.drain_seconds + ENGINE_SIGTERM_DRAIN_S + 15,
                    **inits,
                    "containers": [_server_container(owner, spec, image, sizing, model_mounts, ephemeral), *sidecars],
                    "volumes": volumes,
                },
            },
        },
    }


def _spread_over_nodes(match: dict[str, str]) -> list[dict[str, Any]]:
    """Pods matching `match` spread over nodes where they can be (never unschedulable for it)."""
    return [{
        "maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
        "whenUnsatisfiable": "ScheduleAnyway", "labelSelector": {"matchLabels": match},
    }]


def _server_container(owner: Owner, spec: InferenceServiceSpec, image: str, sizing: PoolSizing,
                      model_mounts: list[dict], ephemeral: dict[str, str]) -> dict[str, Any]:
    """The engine's container: its command and rendered arguments, GPU resources, probes, preStop drain."""
    assert sizing.sizes is not None
    engine = engine_of(spec)
    mem = format_bytes(sizing.sizes.memory_bytes)
    amounts = {"cpu": str(spec.server.cpus), "memory": mem, GPU_RESOURCE: str(spec.server.gpus_per_replica), **ephemeral}
    container = {
        "name": "server",
        "image": image,
        "imagePullPolicy": spec.server.image_pull_policy,
        "command": list(engine.command),
        "args": server_args(owner, spec, sizing),
        "env": _engine_env(spec, engine),
        "ports": [{"name": p.name, "containerPort": p.number, "protocol": "TCP"} for p in engine.ports],
        "resources": {"requests": dict(amounts), "limits": dict(amounts)},
        **_server_probes(engine, spec.disruption.startup_timeout_seconds),
        # Drain (docs/router.md): the endpoint turns terminating at once and the router stops sending new requests;
        # during this sleep in-flight ones finish, whatever the engine. SIGTERM then gets the engine's own drain.
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(spec.disruption.drain_seconds)]}}},
        "securityContext": _container_security(),
        "volumeMounts": [
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "tmp", "mountPath": "/tmp"},
            *model_mounts,
        ],
    }
    if engine.working_dir:
        container["workingDir"] = engine.working_dir
    return container


def _server_probes(engine: Engine, startup_timeout_seconds: int) -> dict[str, Any]:
    """Startup (as long as the model may take to load), readiness and liveness probes on the engine's paths."""
    return {
        "startupProbe": {
            "httpGet": {"path": engine.probes.startup, "port": "http"},
            "periodSeconds": 10, "failureThreshold": max(1, -(-startup_timeout_seconds // 10)),
        },
        "readinessProbe": {"httpGet": {"path": engine.probes.readiness, "port": "http"}, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {"httpGet": {"path": engine.probes.liveness, "port": "http"}, "periodSeconds": 10, "failureThreshold": 3, "timeoutSeconds": 5},
    }


def _engine_env(spec: InferenceServiceSpec, engine: Engine) -> list[dict[str, Any]]:
    pod_name = [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}] if engine.pod_name_env else []
    static = [{"name": k, "value": v} for k, v in engine.env + (engine.lora_env if spec.lora else ())]
    # warmfleet's load/unload routes take the admin key; the operator sends the service's API key (docs/lora.md)
    admin: list[dict[str, Any]] = []
    if spec.lora and engine.kind == "warmfleet":
        ref = spec.lora.admin_key_secret
        admin = ([{"name": "WARMFLEET_ADMIN_KEY", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}]
                 if ref else _api_key_env(spec, "WARMFLEET_ADMIN_KEY"))
    return [*pod_name, *static, *_api_key_env(spec, engine.api_key_env), *admin]


def _service(owner: Owner, name: str, component: str, selector: dict[str, str], ports: list[dict[str, Any]],
             **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(owner, name, component),
            "spec": {**spec, "selector": selector, "ports": ports}}


def replicas_service(owner: Owner, spec: InferenceServiceSpec) -> dict[str, Any]:
    """Headless Service over all server pods with the engine's named ports, discovered by the router."""
    return _service(owner, names(owner)["replicas"], "server", server_selector(owner),
                    [{"name": p.name, "port": p.number, "targetPort": p.name, "protocol": "TCP"}
                     for p in engine_of(spec).ports], clusterIP="None")


def routing_values(owner: Owner, spec: InferenceServiceSpec) -> dict[str, Any]:
    """The settings both routing front doors (`warmfleet route`, `warmfleet epp`) get alike: discovery of the replica
    Service, bounded load from loadBound, the engine kind, and the replicas' block size (contract 1: the same hashes)."""
    return {
        "discover_service": f"{owner.namespace}/{names(owner)['replicas']}",
        "host": "0.0.0.0",
        "model": _model_dir(spec),
        "policy": PolicyConfig(epsilon=round(spec.router.load_bound - 1, 6)),  # epsilon = loadBound - 1
        "engine": spec.engine.kind,
        "block_size": spec.cache.block_size,
    }


def router_settings(owner: Owner, spec: InferenceServiceSpec) -> RouterSettings:
    """What the router pod runs with: `routing_values`, its HTTP port and the routers' headless Service as peers."""
    return RouterSettings(
        **routing_values(owner, spec),
        port=HTTP_PORT,
        peers=f"http://{names(owner)['router_peers']}.{owner.namespace}.svc:{HTTP_PORT}",
    )


def router_args(owner: Owner, spec: InferenceServiceSpec) -> list[str]:
    """`warmfleet route` arguments: ROUTER_FIELDS of `router_settings`, rendered by the settings' own flags."""
    return [*ROUTER_COMMAND[1:], *to_args(router_settings(owner, spec), ROUTER_FIELDS)]


@dataclass(frozen=True)
class RoutingPod:
    """What tells a routing Deployment (router, endpoint picker) apart; the rest of the pod is shared."""

    name: str  # Deployment and ServiceAccount name
    component: str  # app.kubernetes.io/component of the Deployment and its pods
    command: list[str]  # `warmfleet <subcommand> <flags>`
    ports: list[dict[str, Any]]  # container ports
    probes: dict[str, Any]  # readinessProbe, livenessProbe


def routing_selector(owner: Owner, component: str) -> dict[str, str]:
    """Selects the pods of one routing component (router, epp) of the service."""
    return {SERVICE_LABEL: owner.name[:63], COMPONENT_LABEL: component}


def routing_deployment(owner: Owner, spec: InferenceServiceSpec, image: str, pod: RoutingPod) -> dict[str, Any]:
    """A Deployment of `spec.router.replicas` routing pods: the tokenizer-only model volume (and fetch-model init
    container), /tmp as HOME, the API key env, the router's resources and hardening; `pod` says the rest."""
    model_vols, model_mounts = _router_model_volume(spec)
    volumes = [{"name": "tmp", "emptyDir": {"sizeLimit": "256Mi"}}, *model_vols]
    ephemeral = pod_ephemeral_storage(volumes)
    match = routing_selector(owner, pod.component)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(owner, pod.name, pod.component),
        "spec": {
            "replicas": spec.router.replicas,
            "selector": {"matchLabels": match},
            "template": {
                "metadata": {"labels": labels(owner, pod.component)},
                "spec": {
                    "serviceAccountName": pod.name,
                    "securityContext": _pod_security(),
                    "topologySpreadConstraints": _spread_over_nodes(match),
                    **_init_containers(spec, image, "model", tokenizer_only=True, ephemeral=ephemeral),
                    "containers": [{
                        "name": pod.component,
                        "image": image,
                        "imagePullPolicy": spec.server.image_pull_policy,
                        "command": [pod.command[0]],
                        "args": pod.command[1:],
                        # The router checks clients' keys (WARMFLEET_API_KEY) and, since it then does not
                        # forward theirs, authenticates to the replicas itself (WARMFLEET_REPLICA_API_KEY).
                        "env": [{"name": "HOME", "value": "/tmp"},
                                *_api_key_env(spec, "WARMFLEET_API_KEY", "WARMFLEET_REPLICA_API_KEY")],
                        "ports": pod.ports,
                        "resources": _with_ephemeral(ROUTER_RESOURCES, ephemeral),
                        **pod.probes,
                        "securityContext": _container_security(),
                        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, *model_mounts],
                    }],
                    "volumes": volumes,
                },
            },
        },
    }


def router_deployment(owner: Owner, spec: InferenceServiceSpec, image: str) -> dict[str, Any]:
    """The router Deployment: `warmfleet route` discovering replicas through EndpointSlices."""
    return routing_deployment(owner, spec, image, RoutingPod(
        name=names(owner)["router"], component="router", command=[ROUTER_COMMAND[0], *router_args(owner, spec)],
        ports=[{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}],
        probes={"readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 5},
                "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10, "failureThreshold": 3}},
    ))


def router_service(owner: Owner, spec: InferenceServiceSpec) -> dict[str, Any]:
    """The OpenAI endpoint: a Service in front of the routers."""
    return _service(owner, names(owner)["endpoint"], "router", _router_selector(owner),
                    [{"name": "http", "port": spec.router.port, "targetPort": "http", "protocol": "TCP"}],
                    type=spec.router.service_type)


def router_peers_service(owner: Owner) -> dict[str, Any]:
    """Headless Service over the router pods: each router finds the others by its name (--peers) and shares load."""
    return _service(owner, names(owner)["router_peers"], "router", _router_selector(owner),
                    [{"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"}], clusterIP="None")


def _router_selector(owner: Owner) -> dict[str, str]:
    return routing_selector(owner, "router")


def routing_rbac(owner: Owner, name: str, component: str) -> list[dict[str, Any]]:
    """ServiceAccount, Role and RoleBinding letting a routing pod (router, epp) get/list/watch EndpointSlices: all it
    reads of the API (discovery of the replicas' headless Service)."""
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(owner, name, component)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _meta(owner, name, component),
            "rules": [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _meta(owner, name, component),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}],
        },
    ]


def router_rbac(owner: Owner) -> list[dict[str, Any]]:
    """ServiceAccount, Role and RoleBinding letting the router list/watch EndpointSlices."""
    return routing_rbac(owner, names(owner)["router"], "router")


def pdb(owner: Owner, spec: InferenceServiceSpec) -> dict[str, Any]:
    """PodDisruptionBudget over all server pods."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(owner, names(owner)["pdb"], "server"),
        "spec": {"maxUnavailable": spec.disruption.max_unavailable, "selector": {"matchLabels": server_selector(owner)}},
    }


def routing_pdb(owner: Owner, name: str, component: str) -> dict[str, Any]:
    """PodDisruptionBudget over one routing component's pods: a node drain takes at most one at a time."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(owner, name, component),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": routing_selector(owner, component)}},
    }


def router_pdb(owner: Owner) -> dict[str, Any]:
    """PodDisruptionBudget over the router pods: a node drain takes at most one router at a time, so the endpoint
    keeps serving while spec.router.replicas > 1 (with one router it cannot help, and does not block the drain)."""
    return routing_pdb(owner, names(owner)["router_pdb"], "router")


def config_map(owner: Owner, spec: InferenceServiceSpec, plan: list[PlannedPool]) -> dict[str, Any]:
    """ConfigMap with the sizing report (pools, sizes, inputs) for humans and tools."""
    from warmfleet.operator.schema import to_dict

    report = {
        "model": served_name(spec, owner.name),
        "engine": spec.engine.kind,
        "endpoint": endpoint_url(owner, spec) if spec.router.mode == "proxy" else "",
        **({"inferencePool": k8s_name(owner.name)} if spec.router.mode == "gateway" else {}),
        "pools": [
            {
                "name": p.pool.name, "nodes": list(p.pool.nodes), "replicas": p.replicas, "fits": p.sizing.fits,
                "message": p.sizing.message, "sizes": to_dict(p.sizing.sizes), "inputs": to_dict(p.sizing.inputs),
            }
            for p in plan
        ],
        **({"lora": lora_report(spec)} if spec.lora else {}),
    }
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(owner, names(owner)["config"], "config"),
        "data": {"sizing.json": json.dumps(report, indent=2, sort_keys=True)},
    }


def lora_report(spec: InferenceServiceSpec) -> dict[str, Any]:
    """The adapter budget with its inputs, and each adapter's own size from its hints (the ConfigMap's `lora`)."""
    assert spec.lora is not None
    budget = lora.budget_size(spec)
    return {
        "maxLoras": spec.lora.max_loras, "maxCpuLoras": spec.lora.num_cpu_loras, "maxLoraRank": spec.lora.max_lora_rank,
        "bytesPerAdapter": budget.bytes, "deviceBytes": spec.lora.max_loras * budget.bytes,
        "hostBytes": spec.lora.num_cpu_loras * budget.bytes, "budgetedAs": budget.note, "shapes": lora.shape_note(spec),
        "adapters": [{"name": a.name, "path": lora.adapter_path(spec, a), "rank": sz.rank, "bytes": sz.bytes, "note": sz.note}
                     for a, sz in ((a, lora.known_size(spec, a)) for a in spec.adapters)],
    }


def build_children(owner: Owner, spec: InferenceServiceSpec, images: Images, plan: list[PlannedPool]) -> list[dict[str, Any]]:
    """Every child object, in apply order; pools that cannot host replicas get no Deployment. Proxy mode: the router's
    Deployment, Services and PDB; gateway mode instead the endpoint picker's objects and the InferencePool (gateway.py)."""
    from warmfleet.operator import gateway

    gateway_mode = spec.router.mode == "gateway"
    objs = [config_map(owner, spec, plan)] + ([adapters_config_map(owner, spec)] if spec.lora else [])
    objs += gateway.epp_rbac(owner) if gateway_mode else router_rbac(owner)
    objs.append(replicas_service(owner, spec))
    objs += [server_deployment(owner, spec, images.engine, p, images.router) for p in plan if p.sizing.fits]
    objs.append(pdb(owner, spec))
    if gateway_mode:
        return objs + gateway.gateway_children(owner, spec, images.router)
    return objs + [router_pdb(owner), router_deployment(owner, spec, images.router), router_service(owner, spec),
                   router_peers_service(owner)]
