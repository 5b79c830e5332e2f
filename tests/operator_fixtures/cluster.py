"""The in-process operator's world: kmock resources the operator touches (`declare`), running the operator
(`operator`), waiting (`eventually`) and reading what it wrote (`obj`, `status`, `condition`,
`server_deployments`, `writes`). The `cluster` fixture (tests/conftest.py) is a kmock server declared so."""

from __future__ import annotations

from typing import Any, AsyncContextManager, Callable

import kmock

from operator_fixtures.kmock_apply import FakeApplyEmulator
from operator_fixtures.running import InProcessOperator, run_operator
from waiting import poll

ISVC = "serving.warmfleet.io/v1alpha1/inferenceservices"
DEPLOY = "apps/v1/deployments"
NODES = "v1/nodes"
PODS = "v1/pods"
KINDS = {
    "v1/configmaps": "ConfigMap", "v1/services": "Service", "v1/serviceaccounts": "ServiceAccount",
    "v1/events": "Event", DEPLOY: "Deployment", "policy/v1/poddisruptionbudgets": "PodDisruptionBudget",
    "rbac.authorization.k8s.io/v1/roles": "Role", "rbac.authorization.k8s.io/v1/rolebindings": "RoleBinding",
    PODS: "Pod", "v1/persistentvolumeclaims": "PersistentVolumeClaim",
    "v1/secrets": "Secret", "networking.k8s.io/v1/networkpolicies": "NetworkPolicy",
    "apps/v1/daemonsets": "DaemonSet",
}
TIMEOUT_S = 15


def declare(cluster: FakeApplyEmulator) -> FakeApplyEmulator:
    everything = {"list", "watch", "get", "create", "patch", "delete"}
    cluster.resources["v1/namespaces"] = kmock.ResourceInfo(kind="Namespace", namespaced=False, verbs={"list", "watch"})
    cluster.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = kmock.ResourceInfo(
        kind="CustomResourceDefinition", namespaced=False, verbs={"list", "watch"})
    cluster.resources[ISVC] = kmock.ResourceInfo(kind="InferenceService", namespaced=True, verbs=everything, subresources={"status"})
    cluster.resources[NODES] = kmock.ResourceInfo(kind="Node", namespaced=False, verbs={"list", "watch", "get", "patch"})
    for res, kind in KINDS.items():
        cluster.resources[res] = kmock.ResourceInfo(kind=kind, namespaced=True, verbs=everything)
    cluster.objects["v1/namespaces", None, "default"] = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "default", "resourceVersion": "1"}}
    return cluster


def operator(cluster: kmock.KubernetesEmulator) -> AsyncContextManager[InProcessOperator]:
    """Run the operator in-process until the block ends."""
    return run_operator(cluster, TIMEOUT_S)


async def eventually(check: Callable[[], Any], what: str) -> Any:
    """Wait until `check()` is truthy (re-checking as the event loop runs); fail with `what` after a timeout."""
    value = await poll(check, TIMEOUT_S)
    if not value:
        raise AssertionError(f"timed out waiting for {what}")
    return value


def obj(cluster, res: str, name: str, ns: str | None = "default") -> dict[str, Any] | None:
    try:
        found = cluster.objects[res, ns, name]
    except KeyError:
        return None
    return None if found.deleted else found.raw


def status(cluster, name: str = "qwen") -> dict[str, Any]:
    return (obj(cluster, ISVC, name) or {}).get("status") or {}


def condition(cluster, type_: str, name: str = "qwen") -> dict[str, Any]:
    return next((c for c in status(cluster, name).get("conditions", []) if c["type"] == type_), {})


def server_deployments(cluster) -> dict[str, dict[str, Any]]:
    out = {}
    for (res, ns, name), o in cluster.objects.items():
        if res.plural == "deployments" and not o.deleted and o.raw["metadata"]["labels"].get("app.kubernetes.io/component") == "server":
            out[name] = o.raw
    return out


def writes(cluster, since: int = 0) -> list[str]:
    """Mutating requests to children (not status, not kopf's own annotations on the service)."""
    return [f"{r.method} {r.url.path}" for r in list(cluster)[since:]
            if str(r.method).upper().endswith(("POST", "PATCH", "PUT", "DELETE")) and "/inferenceservices" not in r.url.path
            and "/events" not in r.url.path and "/nodes" not in r.url.path]


def seed(cluster, *objs: dict[str, Any], res: str = NODES) -> None:
    for o in objs:
        cluster.objects[res, o["metadata"].get("namespace"), o["metadata"]["name"]] = o
