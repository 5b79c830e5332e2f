"""LoRA's objects in the server pods: the adapters ConfigMap, its volumes, the fetch step and the fetch sidecar; pure."""

from __future__ import annotations

import json
from typing import Any

from warmfleet.operator.planning import lora_plan
from warmfleet.operator.planning.model_volumes import (
    FETCH_COMMAND,
    FETCH_RESOURCES,
    HF_SECRET_KEYS,
    MODEL_CACHE_VOLUME,
    S3_SECRET_KEYS,
    cache_volume,
)
from warmfleet.operator.planning.objects import Owner, container_security, meta, names, with_ephemeral
from warmfleet.operator.spec.inference_service import InferenceServiceSpec

ADAPTERS_LIST_VOLUME = "adapters-list"
ADAPTER_FETCH_CONTAINER = "fetch-adapters"  # init step: the adapters listed when the pod starts
ADAPTER_WATCH_CONTAINER = "adapter-fetch"  # sidecar: adapters added while the pod runs
ADAPTER_FETCH_FLAGS = {"adapters": "--adapters", "adapters_dir": "--adapters-dir", "watch_s": "--watch-s",
                       "hub_endpoint": "--hub-endpoint", "s3_endpoint": "--s3-endpoint", "s3_region": "--s3-region"}
ADAPTER_WATCH_RESOURCES = {"requests": {"cpu": "50m", "memory": "256Mi"}, "limits": {"cpu": "1", "memory": "256Mi"}}


def lora_volumes(owner: Owner, spec: InferenceServiceSpec, model_vols: list[dict]) -> tuple[list[dict], list[dict]]:
    """With spec.lora: the model cache (if the model's volumes lack it) and the adapters ConfigMap; the server's
    read-only mount of the service's adapters directory. Nothing of it depends on spec.adapters."""
    if spec.lora is None:
        return [], []
    vols = [] if any(v["name"] == MODEL_CACHE_VOLUME for v in model_vols) else [cache_volume(spec)]
    vols.append({"name": ADAPTERS_LIST_VOLUME, "configMap": {"name": names(owner)["adapters"]}})
    mount = {"name": MODEL_CACHE_VOLUME, "mountPath": lora_plan.ADAPTERS_MOUNT,
             "subPath": lora_plan.cache_subdir(owner.namespace, owner.name), "readOnly": True}
    return vols, [mount]


def adapter_fetch_container(owner: Owner, spec: InferenceServiceSpec, image: str, *, watch: bool,
                            ephemeral: dict[str, str] | None = None) -> dict[str, Any]:
    """`warmfleet fetch-model --adapters`: once before the server starts (init), or every fetchIntervalSeconds beside it
    (sidecar). Both read the adapters ConfigMap, so the pod template does not change with spec.adapters."""
    assert spec.lora is not None
    lo = spec.lora
    values: list[tuple[str, str]] = [
        ("adapters", f"{lora_plan.ADAPTERS_LIST_MOUNT}/{lora_plan.ADAPTERS_FILE}"),
        ("adapters_dir", f"{lora_plan.CACHE_MOUNT}/{lora_plan.cache_subdir(owner.namespace, owner.name)}"),
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
        "resources": with_ephemeral(ADAPTER_WATCH_RESOURCES if watch else FETCH_RESOURCES, ephemeral),
        "securityContext": container_security(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [{"name": MODEL_CACHE_VOLUME, "mountPath": lora_plan.CACHE_MOUNT},
                         {"name": ADAPTERS_LIST_VOLUME, "mountPath": lora_plan.ADAPTERS_LIST_MOUNT, "readOnly": True},
                         {"name": "tmp", "mountPath": "/tmp"}],
    }


def adapters_config_map(owner: Owner, spec: InferenceServiceSpec) -> dict[str, Any]:
    """The adapters the fetch steps fetch and the operator loads: [{name, source, path}] (changes roll nothing)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta(owner, names(owner)["adapters"], "config"),
        "data": {lora_plan.ADAPTERS_FILE: json.dumps(lora_plan.adapters_list(spec), indent=2, sort_keys=True)},
    }

