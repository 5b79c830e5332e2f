"""LoRA adapters on Kubernetes: checks the schema cannot make, adapter paths in the pod, adapter sizes; pure, no kopf.

What the pod template carries depends on spec.lora only (limits, the adapters directory, the fetch steps);
spec.adapters reaches the pods through the adapters ConfigMap (fetch) and the operator's runtime pass
(adapters_pass.py: /v1/load_lora_adapter, /v1/unload_lora_adapter), so adding or removing one restarts nothing.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from warmfleet.operator.spec.inference_service import (
    AdapterSpec,
    DEFAULT_DTYPE,
    DEFAULT_HIDDEN_SIZE,
    InferenceServiceSpec,
    LORA_PROJECTIONS,
    ModelShape,
)
from warmfleet.operator.spec.schema import SpecError
from warmfleet.server.config import DTYPE_BYTES
from warmfleet.source import parse_source

ADAPTERS_MOUNT = "/adapters"  # server containers: one directory per fetched (hf://, s3://) adapter, read-only
ADAPTERS_LIST_MOUNT = "/etc/warmfleet/adapters"  # the adapters ConfigMap (what the fetch steps read)
ADAPTERS_FILE = "adapters.json"
CACHE_MOUNT = "/models"  # the fetch steps mount the whole model cache here (as fetch-model does for models)
ENGINES_WITH_LORA = ("warmfleet", "vllm")


def cache_subdir(namespace: str, name: str) -> str:
    """The service's adapters directory relative to the model cache root (per service: a node's cache is shared)."""
    return f"lora/{namespace}/{name}"


def fetch_dir(adapter: AdapterSpec) -> str:
    """The fetched adapter's directory name: NAME-<digest of its source>, so a new source is a new path (the runtime
    pass then reloads it) and never overwrites files a replica has loaded."""
    return f"{adapter.name}-{hashlib.sha256(adapter.source.encode()).hexdigest()[:8]}"


def adapter_path(spec: InferenceServiceSpec, adapter: AdapterSpec) -> str:
    """Where the server finds the adapter's files: /adapters/NAME-DIGEST (fetched), under the model's claim, or the path."""
    src = parse_source(adapter.source)
    if src.downloads:
        return f"{ADAPTERS_MOUNT}/{fetch_dir(adapter)}"
    if src.kind == "pvc":
        return f"/models/{src.path}" if src.path else "/models"
    return src.path


def check(spec: InferenceServiceSpec, served: str) -> None:
    """What CEL cannot check about adapters (the served name, the engine, ranks, claims); raises SpecError."""
    if spec.lora is None:
        return
    kind = spec.engine.kind
    if kind not in ENGINES_WITH_LORA:
        raise SpecError("spec.lora", f"engine {kind} serves no LoRA adapters (its docs/parameters.md and "
                                     "fastdeploy/engine/args_utils.py define no LoRA flag); use engine.kind warmfleet or vllm, "
                                     "or remove spec.lora and spec.adapters")
    model_claim = None
    if spec.model.source and spec.model.source.startswith("pvc://"):
        model_claim = parse_source(spec.model.source).claim
    elif spec.model.pvc:
        model_claim = spec.model.pvc
    for i, a in enumerate(spec.adapters):
        path = f"spec.adapters[{i}]"
        if a.name == served:
            raise SpecError(f"{path}.name", f"is {a.name!r}, the served model name; an adapter needs a name of its own")
        if a.rank is not None and a.rank > spec.lora.max_lora_rank:
            raise SpecError(f"{path}.rank", f"is {a.rank}, above spec.lora.maxLoraRank {spec.lora.max_lora_rank}: the "
                                            "engine would refuse the adapter; raise maxLoraRank (rolls the replicas)")
        src = parse_source(a.source)
        if src.kind == "pvc" and src.claim != model_claim:
            raise SpecError(f"{path}.source", f"names claim {src.claim!r}, but replicas mount only the model's claim "
                                              f"({model_claim or 'none'}); mounting another would restart them: put the "
                                              "adapter on the model's claim, in the image, or on hf:// / s3://")
        if src.kind == "pvc" and not src.path:
            raise SpecError(f"{path}.source", "must name the adapter's directory inside the claim (pvc://CLAIM/PATH)")
    shape = spec.lora.model_shape or ModelShape()
    missing = [n for n, v in (("numLayers", shape.num_layers), ("intermediateSize", shape.intermediate_size)) if v is None]
    if missing:
        raise SpecError("spec.lora.modelShape", f"needs {' and '.join(missing)} to size adapters: config.json does not say "
                                                "(or cannot be read for this source); set them from the model's config.json")


@dataclass(frozen=True)
class AdapterSize:
    """Bytes of one adapter and what they were computed from."""

    bytes: int
    rank: int
    modules: tuple[str, ...]
    note: str  # how the inputs were chosen (assumed where unknown)


def projection_dims(spec: InferenceServiceSpec) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection LoRA may adapt, from the hidden size and spec.lora.modelShape.

    Unknown head counts make q/k/v/o hidden x hidden (multi-head attention: the largest they can be).
    """
    assert spec.lora is not None
    shape = spec.lora.model_shape or ModelShape()
    h = spec.model.hidden_size or DEFAULT_HIDDEN_SIZE
    inter = shape.intermediate_size or 0
    heads = shape.num_attention_heads
    head_dim = shape.head_dim or (h // heads if heads else None)
    q_out = heads * head_dim if heads and head_dim else h
    kv_heads = shape.num_key_value_heads or heads
    kv_out = kv_heads * head_dim if kv_heads and head_dim else h
    return {"q_proj": (h, q_out), "k_proj": (h, kv_out), "v_proj": (h, kv_out), "o_proj": (q_out, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def adapter_bytes(spec: InferenceServiceSpec, rank: int, modules: tuple[str, ...] = LORA_PROJECTIONS) -> int:
    """A and B of every layer's `modules` at `rank`: layers x rank x sum(in + out) x dtype bytes."""
    assert spec.lora is not None
    dims = projection_dims(spec)
    layers = (spec.lora.model_shape or ModelShape()).num_layers or 0
    per_rank = sum(dims[m][0] + dims[m][1] for m in modules)
    return layers * rank * per_rank * DTYPE_BYTES[spec.model.dtype or DEFAULT_DTYPE]


def budget_size(spec: InferenceServiceSpec) -> AdapterSize:
    """The size every slot is budgeted for: all seven projections at maxLoraRank. The engines accept any adapter up to
    --max-lora-rank at run time, and the budget is in the pod template, so it cannot follow spec.adapters."""
    assert spec.lora is not None
    r = spec.lora.max_lora_rank
    return AdapterSize(adapter_bytes(spec, r), r, LORA_PROJECTIONS,
                       f"all seven projections at maxLoraRank {r} (the largest adapter the engine accepts)")


def known_size(spec: InferenceServiceSpec, adapter: AdapterSpec) -> AdapterSize:
    """One adapter's size from its hints (rank, targetModules), maxLoraRank and all seven projections where unknown."""
    assert spec.lora is not None
    rank = adapter.rank or spec.lora.max_lora_rank
    modules = tuple(adapter.target_modules) or LORA_PROJECTIONS
    notes = [] if adapter.rank else ["rank unknown: maxLoraRank"]
    if not adapter.target_modules:
        notes.append("target modules unknown: all seven")
    return AdapterSize(adapter_bytes(spec, rank, modules), rank, modules, "; ".join(notes) or "from the spec's hints")


def shape_note(spec: InferenceServiceSpec) -> str:
    """The shapes an adapter's size came from, for the sizing inputs."""
    assert spec.lora is not None
    shape = spec.lora.model_shape or ModelShape()
    dims = projection_dims(spec)
    return (f"layers {shape.num_layers}, hidden {spec.model.hidden_size or DEFAULT_HIDDEN_SIZE}, intermediate "
            f"{shape.intermediate_size}, q/o {dims['q_proj'][1]}, k/v {dims['k_proj'][1]}"
            + ("" if shape.num_attention_heads else " (heads unknown: q/k/v/o taken as hidden x hidden)")
            + f", {spec.model.dtype or DEFAULT_DTYPE}")


def adapters_list(spec: InferenceServiceSpec) -> list[dict[str, str]]:
    """The adapters ConfigMap's list: what the fetch steps fetch and the runtime pass loads."""
    return [{"name": a.name, "source": a.source, "path": adapter_path(spec, a),
             **({"dir": fetch_dir(a)} if parse_source(a.source).downloads else {})} for a in spec.adapters]
