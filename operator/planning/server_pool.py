"""A node pool's server objects: its Deployment (engine container, probes, affinity, hardening), the replicas'
headless Service and the servers' PodDisruptionBudget; pure (plain dicts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from warmfleet.operator.planning.adapter_objects import adapter_fetch_container, lora_volumes
from warmfleet.operator.planning.admin_policy import AdminPolicy
from warmfleet.operator.planning.engine_descriptions import Engine, LoraLimits, RenderInput, engine_of
from warmfleet.operator.planning.model_volumes import (
    MODEL_CACHE_VOLUME,
    MODEL_MOUNT,
    init_containers,
    model_dir,
    model_volume,
    node_cache_dir,
)
from warmfleet.operator.planning.nodes import (
    GPU_MEMORY_LABEL,
    GPU_PRODUCT_LABEL,
    GPU_RESOURCE,
    INSTANCE_TYPE_LABEL,
    Pool,
    format_bytes,
    gpu_tolerations,
)
from warmfleet.operator.planning.objects import (
    Owner,
    admin_key_env,
    api_key_env,
    container_security,
    k8s_name,
    labels,
    meta,
    names,
    pod_ephemeral_storage,
    pod_security,
    server_selector,
    service,
    spread_over_nodes,
)
from warmfleet.operator.planning.pod_overlay import overlay_server_pod
from warmfleet.operator.planning.sizing import PoolSizing, cpu_only
from warmfleet.operator.planning.tracing import engine_tracing
from warmfleet.operator.spec.constants import POOL_LABEL, SIZING_HASH_ANNOTATION
from warmfleet.operator.spec.inference_service import DEFAULT_DTYPE, InferenceServiceSpec, served_name
from warmfleet.operator.spec.pod_overlay import server_node_selector


@dataclass(frozen=True)
class PlannedPool:
    """A pool with its sizing and the replicas assigned to it."""

    pool: Pool
    sizing: PoolSizing
    replicas: int



def render_input(owner: Owner, spec: InferenceServiceSpec, sizing: PoolSizing) -> RenderInput:
    """What a pool's engine arguments are rendered from."""
    assert sizing.sizes is not None
    sz = sizing.sizes
    return RenderInput(
        model_dir=model_dir(spec), served_name=served_name(spec, owner.name), dtype=spec.model.dtype or DEFAULT_DTYPE,
        max_model_len=spec.model.max_model_len, block_size=spec.cache.block_size, prefix_caching=spec.cache.prefix_caching,
        max_num_batched_tokens=spec.server.max_num_batched_tokens, tensor_parallel=spec.server.gpus_per_replica,
        swap_space_gib=sz.swap_space_gib, processor_cache_gib=sz.processor_cache_gib,
        encoder_cache_tokens=sz.encoder_cache_tokens, gpu_memory_utilization=sz.gpu_memory_utilization,
        lora=LoraLimits(spec.lora.max_loras, spec.lora.num_cpu_loras, spec.lora.max_lora_rank) if spec.lora else None,
    )


def server_args(owner: Owner, spec: InferenceServiceSpec, sizing: PoolSizing) -> list[str]:
    """The engine's arguments for one pool (its description's flags and spec.tracing's), then server.extraArgs and
    engine.extraArgs."""
    engine = engine_of(spec)
    rendered = engine.args(render_input(owner, spec, sizing)) + engine_tracing(owner, spec, engine.kind)[0]
    return rendered + list(spec.server.extra_args) + list(spec.engine.extra_args)



def _server_pod_security(spec: InferenceServiceSpec) -> dict[str, Any]:
    sec = pod_security()
    src = spec.model.parsed_source
    if src is not None and src.downloads and spec.model.cache is not None and spec.model.cache.pvc:
        sec["fsGroupChangePolicy"] = "OnRootMismatch"  # not a recursive chown of the whole cache at every start
    return sec



def node_affinity(spec: InferenceServiceSpec, pool: Pool) -> dict[str, Any]:
    """Required node affinity to the pool's shape: the service selector, the named pool, GPU labels, and a CPU pool's
    fence against GPU nodes without those labels."""
    wanted = {**server_node_selector(spec.node_selector, spec.server.pod), **dict(pool.selector)}
    exprs = [{"key": k, "operator": "In", "values": [v]} for k, v in sorted(wanted.items())]
    if pool.gpu_product == "unknown":
        exprs.append({"key": GPU_PRODUCT_LABEL, "operator": "DoesNotExist"})
    else:
        exprs.append({"key": GPU_PRODUCT_LABEL, "operator": "In", "values": [pool.gpu_product]})
    if pool.gpu_memory_source == "label":  # a figure from a table or the spec is on no node's labels
        exprs.append({"key": GPU_MEMORY_LABEL, "operator": "In", "values": [str(pool.gpu_memory_mib)]})
    if pool.instance_types:  # the memory came from the instance type: only nodes of those types have it
        exprs.append({"key": INSTANCE_TYPE_LABEL, "operator": "In", "values": list(pool.instance_types)})
    term: dict[str, list[dict[str, Any]]] = {"matchExpressions": exprs}
    if pool.fence is not None:  # a CPU pool beside GPU nodes without GPU feature discovery's labels (pool_fence.py)
        where, requirement = pool.fence.requirement()
        term.setdefault(where, []).append(requirement)
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}}


ENGINE_SIGTERM_DRAIN_S = 30  # what an engine gives in-flight requests after SIGTERM (warmfleet serve's default)


def server_deployment(owner: Owner, spec: InferenceServiceSpec, image: str, planned: PlannedPool,
                      fetch_image: str | None = None, policy: AdminPolicy = AdminPolicy()) -> dict[str, Any]:
    """One pool's server Deployment; the pod template carries the sizing hash so only changed pools roll.

    hf:// and s3:// models are downloaded first by a `warmfleet fetch-model` init container running
    `fetch_image` (the operator's own warmfleet image, whatever the engine's or the spec's; default `image`) into
    the node cache's directory for this endpoint, source and (unless `policy` shares the cache) namespace.
    """
    pool, sizing = planned.pool, planned.sizing
    assert sizing.sizes is not None
    sz = sizing.sizes
    match = {**server_selector(owner), POOL_LABEL: pool.name}
    d = spec.disruption
    engine = engine_of(spec)
    cpu = cpu_only(spec, pool)
    src = spec.model.parsed_source
    cache_dir = (node_cache_dir(spec, None if policy.share_model_cache else owner.namespace)
                 if src is not None and src.downloads else None)
    model_vols, model_mounts = model_volume(spec, cache_dir)
    lora_vols, lora_mounts = lora_volumes(owner, spec, model_vols)
    model_mounts = model_mounts + lora_mounts
    volumes = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": format_bytes(sz.shm_bytes)}},
        {"name": "tmp", "emptyDir": {"sizeLimit": f"{engine.tmp_gib}Gi"}},
        *model_vols,
        *lora_vols,
    ]
    ephemeral = pod_ephemeral_storage(volumes)
    inits = init_containers(spec, fetch_image or image, MODEL_CACHE_VOLUME, ephemeral=ephemeral,
                            dest=f"{MODEL_MOUNT}/{cache_dir}" if cache_dir else None)
    sidecars: list[dict[str, Any]] = []
    if spec.lora is not None:
        inits.setdefault("initContainers", []).append(
            adapter_fetch_container(owner, spec, fetch_image or image, watch=False, ephemeral=ephemeral))
        sidecars.append(adapter_fetch_container(owner, spec, fetch_image or image, watch=True, ephemeral=ephemeral))
    surge = 0 if d.max_unavailable > 0 else 1  # GPUs are scarce: surge only when nothing may be unavailable
    dep = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta(owner, k8s_name(owner.name, pool.name), "server", pool.name),
        "spec": {
            "replicas": planned.replicas,
            "selector": {"matchLabels": match},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": d.max_unavailable, "maxSurge": surge}},
            "template": {
                "metadata": {"labels": labels(owner, "server", pool.name), "annotations": {SIZING_HASH_ANNOTATION: sz.hash}},
                "spec": {
                    "affinity": node_affinity(spec, pool),
                    "topologySpreadConstraints": spread_over_nodes(match),
                    # a CPU-only replica (sizing.cpu_only) takes no GPU, so it tolerates no GPU node's taint either;
                    # pools leave out nodes whose taints these (with spec.server.pod's) do not tolerate (nodes.py)
                    "tolerations": gpu_tolerations(spec, pool.gpu_resource, pool.has_gpus),
                    "securityContext": _server_pod_security(spec),
                    # engines never call the API server: no token of the namespace's default ServiceAccount in the pod
                    "automountServiceAccountToken": False,
                    # preStop, then the engine's SIGTERM drain (`warmfleet serve --drain-timeout-s`, 30 s), then its exit
                    "terminationGracePeriodSeconds": d.drain_seconds + ENGINE_SIGTERM_DRAIN_S + 15,
                    **inits,
                    "containers": [_server_container(owner, spec, image, sizing, model_mounts, ephemeral,
                                                     None if cpu else pool.gpu_resource),
                                   *sidecars],
                    "volumes": volumes,
                },
            },
        },
    }
    dep["spec"]["template"] = overlay_server_pod(dep["spec"]["template"], spec)  # spec.server.pod (pod_overlay.py)
    return dep



def _server_container(owner: Owner, spec: InferenceServiceSpec, image: str, sizing: PoolSizing,
                      model_mounts: list[dict], ephemeral: dict[str, str], gpu_resource: str | None = GPU_RESOURCE) -> dict[str, Any]:
    """The engine's container: its command and rendered arguments, GPU resources (the pool's; None: a CPU-only
    replica, none), probes, preStop drain."""
    assert sizing.sizes is not None
    engine = engine_of(spec)
    mem = format_bytes(sizing.sizes.memory_bytes)
    gpus = {gpu_resource: str(spec.server.gpus_per_replica)} if gpu_resource else {}
    amounts = {"cpu": str(spec.server.cpus), "memory": mem, **gpus, **ephemeral}
    container = {
        "name": "server",
        "image": image,
        "imagePullPolicy": spec.server.image_pull_policy,
        "command": list(engine.command),
        "args": server_args(owner, spec, sizing),
        "env": _engine_env(owner, spec, engine),
        "ports": [{"name": p.name, "containerPort": p.number, "protocol": "TCP"} for p in engine.ports],
        "resources": {"requests": dict(amounts), "limits": dict(amounts)},
        **_server_probes(engine, spec.disruption.startup_timeout_seconds),
        # Drain (docs/router.md): the endpoint turns terminating at once and the router stops sending new requests;
        # during this sleep in-flight ones finish, whatever the engine. SIGTERM then gets the engine's own drain.
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(spec.disruption.drain_seconds)]}}},
        "securityContext": container_security(),
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


def _engine_env(owner: Owner, spec: InferenceServiceSpec, engine: Engine) -> list[dict[str, Any]]:
    pod_name = [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}] if engine.pod_name_env else []
    static = [{"name": k, "value": v} for k, v in engine.env + (engine.lora_env if spec.lora else ())]
    # warmfleet's admin routes (load/unload adapters) always take the admin key: spec.lora.adminKeySecret, else the
    # one the operator generated (never the client API key, which every client holds)
    admin = admin_key_env(owner, spec) if engine.kind == "warmfleet" else []
    tracing = engine_tracing(owner, spec, engine.kind)[1]  # spec.tracing: the engine's own switches
    return [*pod_name, *static, *api_key_env(spec, engine.api_key_env), *admin, *tracing]



def replicas_service(owner: Owner, spec: InferenceServiceSpec) -> dict[str, Any]:
    """Headless Service over all server pods with the engine's named ports, discovered by the router."""
    return service(owner, names(owner)["replicas"], "server", server_selector(owner),
                    [{"name": p.name, "port": p.number, "targetPort": p.name, "protocol": "TCP"}
                     for p in engine_of(spec).ports], clusterIP="None")



def server_pdb(owner: Owner, spec: InferenceServiceSpec) -> dict[str, Any]:
    """PodDisruptionBudget over all server pods."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": meta(owner, names(owner)["pdb"], "server"),
        "spec": {"maxUnavailable": spec.disruption.max_unavailable, "selector": {"matchLabels": server_selector(owner)}},
    }

