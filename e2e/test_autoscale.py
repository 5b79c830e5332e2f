"""Cache-aware autoscaling against a real control plane (issue 12).

The session's local operator is swapped, for these tests, for one whose autoscaler scrapes a
FakeRouter on loopback (tests/fakerouter.py: the real router's metrics class, scripted) every second
(--router-url-template through WARMFLEET_ROUTER_URL_TEMPLATE); it runs under the same chart
ServiceAccount token, so the chart's RBAC (pods get/patch for the deletion cost) is exercised.
The shared operator is started again afterwards.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import LocalOperator
from e2e_support import Cluster, wait_for

REPO = Path(__file__).resolve().parent.parent
SERVICE_LABEL = "serving.warmfleet.io/service"
COMPONENT_LABEL = "app.kubernetes.io/component"
COST = "controller.kubernetes.io/pod-deletion-cost"
H200_ONLY = {"nvidia.com/gpu.product": "NVIDIA-H200"}  # one pool: the fake H200 nodes of e2e/cluster.sh


def _fake_router_class() -> Any:
    spec = importlib.util.spec_from_file_location("fakerouter", REPO / "tests" / "fakerouter.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.FakeRouter


@pytest.fixture
def fake_router(e2e_cluster: Cluster, local_operator: LocalOperator, namespace: str, tmp_path: Path) -> Iterator[Any]:
    """A FakeRouter, and the session's operator replaced by one that scrapes it every second.

    The test's services are deleted before the session's operator comes back, so it never resumes one in
    a namespace that is being deleted (its writes there would be refused).
    """
    local_operator.stop()
    env = {"WARMFLEET_ROUTER_URL_TEMPLATE": None, "WARMFLEET_AUTOSCALE_INTERVAL_S": None}
    with _fake_router_class()() as router:
        saved = {k: os.environ.get(k) for k in env}
        os.environ["WARMFLEET_ROUTER_URL_TEMPLATE"] = router.url
        os.environ["WARMFLEET_AUTOSCALE_INTERVAL_S"] = "1"
        op = LocalOperator(e2e_cluster, local_operator.kubeconfig, tmp_path)
        try:
            op.start()  # copies os.environ
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        try:
            yield router
        finally:
            e2e_cluster.kubectl("-n", namespace, "delete", "wfis", "--all", "--wait=true", "--timeout=60s",
                                check=False)
            op.stop()
            for log in op.logs:
                print(f"==== autoscaling {log.name}\n{log.read_text(errors='replace')[-20000:]}")
            local_operator.start()


def service(namespace: str, autoscaling: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "serving.warmfleet.io/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "auto", "namespace": namespace},
            "spec": {"model": {"path": "/models/m"}, "nodeSelector": H200_ONLY, "autoscaling": autoscaling}}


def server_replicas(c: Cluster, ns: str) -> int:
    items = c.kubectl_json("-n", ns, "get", "deployments", "-l", f"{SERVICE_LABEL}=auto,{COMPONENT_LABEL}=server")["items"]
    return sum(d["spec"]["replicas"] for d in items)


def ready_server_pods(c: Cluster, ns: str) -> list[dict[str, Any]]:
    pods = c.kubectl_json("-n", ns, "get", "pods", "-l", f"{SERVICE_LABEL}=auto,{COMPONENT_LABEL}=server")["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp") and (p.get("status") or {}).get("podIP")
            and any(x["type"] == "Ready" and x["status"] == "True" for x in p["status"].get("conditions") or [])]


def test_kubectl_scale_works_within_the_bounds(e2e_cluster: Cluster, fake_router: Any, namespace: str) -> None:
    """Bounds without a target: `kubectl scale` (the scale subresource) sets the replicas, clamped to the bounds."""
    c = e2e_cluster
    c.apply(service(namespace, {"minReplicas": 1, "maxReplicas": 3}))
    wait_for(lambda: server_replicas(c, namespace) == 1, 120, "minReplicas 1 without spec.replicas")
    c.kubectl("-n", namespace, "scale", "wfis", "auto", "--replicas=2")
    wait_for(lambda: server_replicas(c, namespace) == 2, 60, "kubectl scale to 2")
    c.kubectl("-n", namespace, "scale", "wfis", "auto", "--replicas=9")
    wait_for(lambda: server_replicas(c, namespace) == 3, 60, "kubectl scale to 9, clamped to maxReplicas 3")
    scale = c.kubectl_json("-n", namespace, "get", "wfis", "auto", "--subresource=scale")
    wait_for(lambda: c.kubectl_json("-n", namespace, "get", "wfis", "auto", "--subresource=scale")
             ["status"]["replicas"] == 3, 60, "the scale subresource's status.replicas at 3")
    assert scale["spec"]["replicas"] == 9 and f"{SERVICE_LABEL}=auto" in scale["status"]["selector"]
    # without a target the operator never writes spec.replicas itself
    assert c.kubectl_json("-n", namespace, "get", "wfis", "auto")["spec"]["replicas"] == 9


def test_load_change_scales_the_pool_and_scale_in_removes_the_coldest_replica(
        e2e_cluster: Cluster, fake_router: Any, namespace: str) -> None:
    c, router = e2e_cluster, fake_router
    c.apply(service(namespace, {"minReplicas": 1, "maxReplicas": 4, "targetQueuedPrefillTokens": 1000,
                                "metricsWindowSeconds": 10, "scaleDownStabilizationSeconds": 0}))
    wait_for(lambda: len(ready_server_pods(c, namespace)) == 1, 120, "one Ready server pod")

    # load arrives: 3000 queued prefill tokens, target 1000 per replica -> 3 replicas, the Deployment follows
    router.set_queued({"http://10.0.0.1:8000": 3000})
    wait_for(lambda: server_replicas(c, namespace) == 3, 60, "the Deployment scaled to 3")
    pods = wait_for(lambda: (lambda p: p if len(p) == 3 else None)(ready_server_pods(c, namespace)), 120,
                    "three Ready server pods")
    svc = c.kubectl_json("-n", namespace, "get", "wfis", "auto")
    assert svc["spec"]["replicas"] == 3 and svc["status"]["autoscaling"]["desiredReplicas"] == 3

    # the routers say how much each replica caches: one warm, two colder; costs land on the pods
    blocks = {p["metadata"]["name"]: b for p, b in zip(sorted(pods, key=lambda p: p["metadata"]["name"]), (9000, 40, 70))}
    router.replicas = [router.replica(f"http://{p['status']['podIP']}:8000", gpu_blocks=blocks[p["metadata"]["name"]])
                       for p in pods]
    warmest = max(blocks, key=blocks.get)

    def costs() -> dict[str, str]:
        return {p["metadata"]["name"]: (p["metadata"].get("annotations") or {}).get(COST) for p in ready_server_pods(c, namespace)}

    wait_for(lambda: costs() == {n: str(b) for n, b in blocks.items()}, 60, "pod-deletion costs from the cached blocks")
    warm = wait_for(lambda: c.kubectl_json("-n", namespace, "get", "wfis", "auto")["status"].get("warmup"),
                    60, "status.warmup")
    assert warm["warm"] == 3

    # load goes away: back to 1 replica, and the one left is the warmest
    router.set_queued({"http://10.0.0.1:8000": 0})
    wait_for(lambda: server_replicas(c, namespace) == 1, 90, "the Deployment scaled back to 1")
    left = wait_for(lambda: (lambda p: p if len(p) == 1 and len(c.kubectl_json(
        "-n", namespace, "get", "pods", "-l", f"{SERVICE_LABEL}=auto,{COMPONENT_LABEL}=server")["items"]) == 1 else None)(
        ready_server_pods(c, namespace)), 120, "one server pod left")
    assert left[0]["metadata"]["name"] == warmest, (left[0]["metadata"]["name"], blocks)
