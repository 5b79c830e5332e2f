"""Gateway mode with kopf in-process against kmock: a cluster without the GIE CRD gets a condition and an Event and is
retried, installing the CRD heals it, and turning back to proxy mode prunes the gateway objects."""

from __future__ import annotations

import json
from typing import Any

import kmock

from operator_fixtures.cluster import DEPLOY, ISVC, condition, eventually, obj, operator, seed, status
from operator_fixtures.shapes import h200, service
from warmfleet.operator.wiring import handlers

POOLS = "inference.networking.k8s.io/v1/inferencepools"
ROUTES = "gateway.networking.k8s.io/v1/httproutes"
EVERYTHING = {"list", "watch", "get", "create", "patch", "delete"}
SERVICE_PATH = f"/apis/{ISVC.rsplit('/', 1)[0]}/namespaces/default/inferenceservices/qwen"


def posted_events(cluster, reason: str) -> list[dict[str, Any]]:
    """Events posted with `reason` (from the request log: kmock refuses a second Event of one name with 409)."""
    return [r.data for r in list(cluster) if str(r.method).upper().endswith("POST") and r.url.path.endswith("/events")
            and isinstance(r.data, dict) and r.data.get("reason") == reason]


def handler_progress(cluster) -> dict[str, Any] | None:
    """kopf's progress record of the create/update/resume handler on service qwen (None once it has succeeded)."""
    annotations = ((obj(cluster, ISVC, "qwen") or {}).get("metadata") or {}).get("annotations") or {}
    raw = next((v for k, v in annotations.items() if k.endswith("reconcile_service")), None)
    record = json.loads(raw) if raw else None
    return None if record is None or record.get("success") else record


def install(cluster, res: str, kind: str) -> None:
    """Serve a CRD's kind from now on (what `kubectl apply -f` of the CRD does to discovery)."""
    cluster.resources[res] = kmock.ResourceInfo(kind=kind, namespaced=True, verbs=EVERYTHING)


async def test_missing_gie_crd_is_a_condition_and_an_event_then_installing_it_heals(cluster, monkeypatch):
    monkeypatch.setattr(handlers, "MISSING_CRD_DELAYS_S", (1,))  # the backoff's first step, shortened for the test
    seed(cluster, h200("h1"))
    seed(cluster, service(spec={"replicas": 1, "router": {"mode": "gateway"}}), res=ISVC)
    async with operator(cluster):
        cond = await eventually(lambda: condition(cluster, "InferencePoolReady").get("status") == "False"
                                and condition(cluster, "InferencePoolReady"), "InferencePoolReady=False")
        assert cond["reason"] == "GatewayAPIInferenceExtensionMissing"
        assert "inferencepools.inference.networking.k8s.io" in cond["message"]
        assert condition(cluster, "Ready")["reason"] == "GatewayAPIInferenceExtensionMissing"
        events = await eventually(lambda: posted_events(cluster, "GatewayAPIInferenceExtensionMissing"), "a Warning Event")
        assert events[0]["type"] == "Warning" and "gateway-api-inference-extension" in events[0]["message"]
        # the rest is applied meanwhile: the servers and the endpoint picker do not wait for the CRD
        assert obj(cluster, DEPLOY, "qwen-epp") is not None and obj(cluster, "v1/services", "qwen-epp") is not None
        assert obj(cluster, DEPLOY, "qwen-router") is None
        # the handler retries (kopf's TemporaryError, its progress in the service's annotations), again and again ...
        await eventually(lambda: (handler_progress(cluster) or {}).get("retries", 0) >= 2, "the reconcile retried")
        assert "inferencepools.inference.networking.k8s.io" in handler_progress(cluster)["message"]
        # ... until a retry finds the CRD installed: the handler succeeds (kopf drops its progress) and the pool is there
        install(cluster, POOLS, "InferencePool")
        await eventually(lambda: obj(cluster, POOLS, "qwen") is not None and handler_progress(cluster) is None,
                         "the InferencePool created by a retry that succeeded")
        await eventually(lambda: condition(cluster, "InferencePoolReady").get("status") == "True", "InferencePoolReady=True")
        pool = obj(cluster, POOLS, "qwen")
        assert pool["spec"]["endpointPickerRef"]["name"] == "qwen-epp"
        assert pool["metadata"]["ownerReferences"][0]["uid"] == "uid-qwen"
        assert condition(cluster, "Ready")["reason"] != "GatewayAPIInferenceExtensionMissing"
        # Ready once servers and an endpoint picker report ready
        for name in ["qwen-epp", *[n for (r, _, n), o in cluster.objects.items()
                                   if r.plural == "deployments" and not o.deleted and n.startswith("qwen-h200")]]:
            await cluster.patch(f"/apis/apps/v1/namespaces/default/deployments/{name}", json={"status": {"readyReplicas": 1}})
        await eventually(lambda: condition(cluster, "Ready").get("status") == "True", "Ready=True")
        assert condition(cluster, "EndpointPickerReady")["status"] == "True"
        assert status(cluster)["endpoint"] == ""  # no Gateway named: clients come through a route of the user's


async def test_missing_httproute_crd_with_a_gateway_then_back_to_proxy_prunes(cluster, monkeypatch):
    monkeypatch.setattr(handlers, "MISSING_CRD_DELAYS_S", (1,))
    install(cluster, POOLS, "InferencePool")
    seed(cluster, h200("h1"))
    seed(cluster, service(spec={"replicas": 1, "router": {"mode": "gateway", "gateway": {"name": "gw"}}}), res=ISVC)
    async with operator(cluster):
        cond = await eventually(lambda: condition(cluster, "HTTPRouteReady").get("reason") == "GatewayAPIMissing"
                                and condition(cluster, "HTTPRouteReady"), "HTTPRouteReady=False GatewayAPIMissing")
        assert "httproutes.gateway.networking.k8s.io" in cond["message"]
        assert condition(cluster, "Ready")["reason"] == "GatewayAPIMissing"
        assert obj(cluster, POOLS, "qwen") is not None
        await eventually(lambda: posted_events(cluster, "GatewayAPIMissing"), "a Warning Event")
        install(cluster, ROUTES, "HTTPRoute")
        await eventually(lambda: obj(cluster, ROUTES, "qwen") is not None, "the HTTPRoute created on a retry")
        route = obj(cluster, ROUTES, "qwen")
        assert route["spec"]["parentRefs"][0]["name"] == "gw"
        assert route["spec"]["rules"][0]["backendRefs"][0]["kind"] == "InferencePool"
        await eventually(lambda: condition(cluster, "HTTPRouteReady").get("status") == "True", "HTTPRouteReady=True")
        # back to proxy mode: the gateway objects go, the router comes, the gateway conditions are removed
        await cluster.patch(SERVICE_PATH, json={"metadata": {"generation": 2}, "spec": {"router": {"mode": "proxy", "gateway": None}}})
        await eventually(lambda: status(cluster).get("observedGeneration") == 2 and obj(cluster, DEPLOY, "qwen-router"), "proxy mode")
        await eventually(lambda: obj(cluster, POOLS, "qwen") is None and obj(cluster, ROUTES, "qwen") is None, "gateway objects pruned")
        assert obj(cluster, DEPLOY, "qwen-epp") is None and obj(cluster, "v1/services", "qwen-epp") is None
        await eventually(lambda: not [c for c in status(cluster).get("conditions", [])
                                      if c["type"] in ("InferencePoolReady", "EndpointPickerReady", "HTTPRouteReady")],
                         "gateway conditions removed")
