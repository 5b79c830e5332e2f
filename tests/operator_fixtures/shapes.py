"""Node objects of the shapes the operator tests size for: H200, A100-80GB, L4, no GPU labels, too small."""

from __future__ import annotations

from typing import Any

GiB = 1 << 30
TiB = 1 << 40


def node(name: str, *, product: str | None = None, gpu_mib: int | None = None, gpus: int = 0,
         memory: int = 64 * GiB, ready: bool = True, cordoned: bool = False,
         labels: dict[str, str] | None = None, taints: list[dict[str, str]] | None = None,
         resource: str = "nvidia.com/gpu") -> dict[str, Any]:
    """A Node dict with allocatable GPUs (of `resource`) and memory (memory in bytes, written in Ki like kubelet)."""
    lab = dict(labels or {})
    if product:
        lab["nvidia.com/gpu.product"] = product
    if gpu_mib:
        lab["nvidia.com/gpu.memory"] = str(gpu_mib)
    alloc = {"cpu": "64", "memory": f"{memory // 1024}Ki"}
    if gpus:
        alloc[resource] = str(gpus)
    body: dict[str, Any] = {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": lab, "resourceVersion": "1", "uid": f"uid-{name}"},
        "status": {"allocatable": alloc, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }
    if cordoned:
        body.setdefault("spec", {})["unschedulable"] = True
    if taints:
        body.setdefault("spec", {})["taints"] = [dict(t) for t in taints]
    return body


def h200(name: str = "h200-a", **kw: Any) -> dict[str, Any]:
    """8x H200 (143771 MiB each), 2 TiB host memory."""
    return node(name, **{"product": "NVIDIA-H200", "gpu_mib": 143771, "gpus": 8, "memory": 2 * TiB, **kw})


def a100(name: str = "a100-a", **kw: Any) -> dict[str, Any]:
    """8x A100-SXM4-80GB, 1 TiB host memory."""
    return node(name, **{"product": "NVIDIA-A100-SXM4-80GB", "gpu_mib": 81920, "gpus": 8, "memory": 1 * TiB, **kw})


def l4(name: str = "l4-a", **kw: Any) -> dict[str, Any]:
    """4x L4 (23034 MiB each), 192 GiB host memory."""
    return node(name, **{"product": "NVIDIA-L4", "gpu_mib": 23034, "gpus": 4, "memory": 192 * GiB, **kw})


def service(name: str = "qwen", spec: dict[str, Any] | None = None, **meta: Any) -> dict[str, Any]:
    """An InferenceService dict with a minimal spec merged with `spec`; warmfleet's engine unless `spec` names an
    engine (these tests check warmfleet's flags; engine.kind auto is tested in test_operator_engine_choice.py)."""
    body_spec = {"model": {"path": "/models/qwen"}, "engine": {"kind": "warmfleet"}, **(spec or {})}
    return {
        "apiVersion": "serving.warmfleet.io/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}", "generation": 1,
                     "resourceVersion": "1", **meta},
        "spec": body_spec,
    }
