"""The model's volumes and the fetch-model init container (hf://, s3://, pvc://, baked in): plain dicts, pure."""

from __future__ import annotations

from typing import Any

from warmfleet.operator.planning.objects import container_security, with_ephemeral
from warmfleet.operator.spec.inference_service import DEFAULT_MODEL_CACHE, InferenceServiceSpec
from warmfleet.source import ModelSource

MODEL_MOUNT = "/models"

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



def model_dir(spec: InferenceServiceSpec) -> str:
    """The checkpoint directory inside server and router containers."""
    src = spec.model.parsed_source
    if src is None:
        return spec.model.path or ""
    if src.downloads:
        return f"{MODEL_MOUNT}/{src.cache_subdir()}"
    if src.kind == "pvc":
        return f"{MODEL_MOUNT}/{src.path}" if src.path else MODEL_MOUNT
    return src.path


def _claim(spec: InferenceServiceSpec) -> str | None:
    src = spec.model.parsed_source
    return src.claim if src is not None and src.kind == "pvc" else (spec.model.pvc if src is None else None)


def node_cache_dir(spec: InferenceServiceSpec, namespace: str | None) -> str:
    """The model's directory in the node cache (hf://, s3://), keyed by endpoint, source, revision and `namespace`
    (None: shared across namespaces, an admin's choice): source.ModelSource.node_cache_subdir."""
    src, m = spec.model.parsed_source, spec.model
    assert src is not None and src.downloads
    endpoint = (m.hub.endpoint if m.hub else None) if src.kind == "hf" else (m.s3.endpoint if m.s3 else None)
    return src.node_cache_subdir(endpoint, namespace)


def model_volume(spec: InferenceServiceSpec, cache_dir: str | None = None) -> tuple[list[dict], list[dict]]:
    """Volumes and server mounts of the model: a claim at /models (pvc://, path + pvc), or the model cache's
    directory of this model (hf://, s3://; `cache_dir`, from node_cache_dir; the fetch-model init container fills
    it) at model_dir, or nothing (baked in)."""
    src = spec.model.parsed_source
    if src is not None and src.downloads:
        vol = cache_volume(spec)
        # only this model's directory, read-only (a node-wide cache holds other services' models too)
        mount = {"name": MODEL_CACHE_VOLUME, "mountPath": model_dir(spec), "subPath": cache_dir or src.cache_subdir(),
                 "readOnly": True}
        return [vol], [mount]
    return _local_model_volume(spec)


def cache_volume(spec: InferenceServiceSpec) -> dict[str, Any]:
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



def _credentials_env(spec: InferenceServiceSpec, src: ModelSource) -> list[dict[str, Any]]:
    name = spec.model.credentials_secret
    if not name:
        return []
    keys = HF_SECRET_KEYS if src.kind == "hf" else S3_SECRET_KEYS
    return [{"name": key, "valueFrom": {"secretKeyRef": {"name": name, "key": key, **({"optional": True} if optional else {})}}}
            for key, optional in keys]


def fetch_container(spec: InferenceServiceSpec, image: str, volume: str, *, tokenizer_only: bool = False,
                    ephemeral: dict[str, str] | None = None, dest: str | None = None) -> dict[str, Any]:
    """The init container that downloads an hf:// or s3:// model into `volume` (mounted at /models; `dest`, default
    model_dir) before the server (or, with only tokenizer files, the router) starts. Same security as every
    container; /tmp is its HOME. Where `volume` is the node cache, `image` must be the operator's own."""
    src = spec.model.parsed_source
    assert src is not None and src.downloads
    m = spec.model
    values: list[tuple[str, str | None]] = [("dest", dest or model_dir(spec)), ("termination_log", "/dev/termination-log")]
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
        "resources": with_ephemeral(FETCH_RESOURCES, ephemeral),
        "securityContext": container_security(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [{"name": volume, "mountPath": MODEL_MOUNT}, {"name": "tmp", "mountPath": "/tmp"}],
    }


def init_containers(spec: InferenceServiceSpec, image: str, volume: str, *, tokenizer_only: bool = False,
                     ephemeral: dict[str, str] | None = None, dest: str | None = None) -> dict[str, Any]:
    """{"initContainers": [fetch-model]} for hf:// and s3:// sources, else nothing (templates stay as they were)."""
    src = spec.model.parsed_source
    if src is None or not src.downloads:
        return {}
    return {"initContainers": [fetch_container(spec, image, volume, tokenizer_only=tokenizer_only, ephemeral=ephemeral,
                                               dest=dest)]}


def router_model_volume(spec: InferenceServiceSpec) -> tuple[list[dict], list[dict]]:
    """The router reads configs, tokenizer files and chat templates: a small emptyDir the init container fills
    for hf:// and s3:// sources (no node-local cache needed on router nodes), else the server's volume."""
    src = spec.model.parsed_source
    if src is None or not src.downloads:
        return model_volume(spec)
    vol = {"name": "model", "emptyDir": {"sizeLimit": f"{ROUTER_MODEL_GIB}Gi"}}
    return [vol], [{"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}]

