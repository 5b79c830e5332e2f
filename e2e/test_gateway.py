"""Gateway mode (spec.router.mode: gateway) against a real API server: the InferencePool, the endpoint picker and the
HTTPRoute it renders are accepted by the GIE and Gateway API CRDs themselves; a cluster without those CRDs says why in
a condition and an Event, and installing them heals it; turning back to proxy mode prunes them under the chart's RBAC.

The CRDs come from their Go modules (`e2e/cluster.sh gateway-crds`, cached). No other e2e test needs them, so this module
owns them: its first test removes them if a reused cluster has them, then installs them itself (tests run in file
order); the module's teardown deletes them again.
"""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import CLUSTER_SH, LocalOperator, is_ready
from e2e_support import Cluster, wait_for

GIE_CRD = "inferencepools.inference.networking.k8s.io"
HTTPROUTE_CRD = "httproutes.gateway.networking.k8s.io"
SERVICE_LABEL = "serving.warmfleet.io/service"
NAME = "gw"
# Small fixed caches: the shared cluster's GPU nodes also host the example service of test_operator.py.
SPEC: dict[str, Any] = {
    "model": {"path": "/models/qwen", "servedName": "qwen-gw", "hiddenSize": 1024},
    "replicas": 1,
    "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-L4"},
    "server": {"engineMemoryGib": 4, "cpus": 1},
    "cache": {"swapSpace": {"mode": "Fixed", "size": 1}, "processorCache": {"mode": "Fixed", "size": 1}},
    "router": {"mode": "gateway", "replicas": 2, "failureMode": "FailOpen"},
}


def crd_files(c: Cluster) -> list[Path]:
    out = subprocess.run(["bash", str(CLUSTER_SH), "gateway-crds"], capture_output=True, text=True, env=c.env, timeout=300)
    if out.returncode != 0:
        pytest.fail(f"e2e/cluster.sh gateway-crds failed: {out.stderr[-3000:]}", pytrace=False)
    files = [Path(p) for p in out.stdout.split()]
    assert len(files) == 2 and all(f.is_file() for f in files), files
    return files


def crd_served(c: Cluster, name: str) -> bool:
    r = c.kubectl("get", "crd", name, "-o", "json", check=False)
    if r.returncode != 0:
        return False
    conds = {x["type"]: x["status"] for x in (json.loads(r.stdout).get("status") or {}).get("conditions", [])}
    return conds.get("Established") == "True"


def remove_crds(c: Cluster) -> None:
    c.kubectl("delete", "crd", GIE_CRD, HTTPROUTE_CRD, "--ignore-not-found", "--wait=true", "--timeout=120s", check=False)
    wait_for(lambda: c.kubectl("get", "crd", GIE_CRD, check=False).returncode != 0
             and c.kubectl("get", "crd", HTTPROUTE_CRD, check=False).returncode != 0, 120, "the gateway CRDs gone")


@pytest.fixture(scope="module")
def gateway_crds(e2e_cluster: Cluster, local_operator: LocalOperator) -> Iterator[list[Path]]:
    """The CRD files; the cluster starts without them (removed if a reused cluster has them) and ends without them."""
    files = crd_files(e2e_cluster)
    remove_crds(e2e_cluster)
    try:
        yield files
    finally:
        remove_crds(e2e_cluster)


def service(namespace: str, **router: Any) -> dict[str, Any]:
    spec = copy.deepcopy(SPEC)
    spec["router"].update(router)
    return {"apiVersion": "serving.warmfleet.io/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": NAME, "namespace": namespace}, "spec": spec}


def wfis(c: Cluster, ns: str) -> dict[str, Any]:
    return c.kubectl_json("-n", ns, "get", "wfis", NAME)


def condition(c: Cluster, ns: str, type_: str) -> dict[str, Any]:
    return next((x for x in (wfis(c, ns).get("status") or {}).get("conditions", []) if x["type"] == type_), {})


def get(c: Cluster, ns: str, kind: str, name: str) -> dict[str, Any] | None:
    r = c.kubectl("-n", ns, "get", kind, name, "-o", "json", check=False)
    return json.loads(r.stdout) if r.returncode == 0 else None


def events(c: Cluster, ns: str, reason: str) -> list[dict[str, Any]]:
    items = c.kubectl_json("-n", ns, "get", "events", "--field-selector", f"involvedObject.name={NAME},reason={reason}")["items"]
    return [e for e in items if e["involvedObject"].get("kind") == "InferenceService"]


def test_without_the_gie_crds_a_condition_and_an_event_say_why_and_installing_them_heals(
        e2e_cluster: Cluster, gateway_crds: list[Path], local_operator: LocalOperator, namespace: str) -> None:
    c = e2e_cluster
    assert not crd_served(c, GIE_CRD)
    c.apply(service(namespace))
    cond = wait_for(lambda: condition(c, namespace, "InferencePoolReady").get("reason") == "GatewayAPIInferenceExtensionMissing"
                    and condition(c, namespace, "InferencePoolReady"), 90, "InferencePoolReady=False for the missing CRD")
    assert cond["status"] == "False" and GIE_CRD in cond["message"] and "gateway-api-inference-extension" in cond["message"]
    ready = condition(c, namespace, "Ready")
    assert ready["status"] == "False" and ready["reason"] == "GatewayAPIInferenceExtensionMissing"
    (event, *_) = wait_for(lambda: events(c, namespace, "GatewayAPIInferenceExtensionMissing"), 60, "a Warning Event")
    assert event["type"] == "Warning" and GIE_CRD in event["message"]
    # the operator is alive and did everything else: the endpoint picker and the servers exist
    local_operator.proc.check_alive()
    assert get(c, namespace, "deployment", f"{NAME}-epp") is not None and get(c, namespace, "service", f"{NAME}-epp") is not None
    assert get(c, namespace, "deployment", f"{NAME}-router") is None

    for f in gateway_crds:
        c.kubectl("apply", "--server-side", "-f", str(f))
    wait_for(lambda: crd_served(c, GIE_CRD) and crd_served(c, HTTPROUTE_CRD), 60, "the gateway CRDs Established")
    # healed on the operator's next retry (backoff: 10 s, 20 s, 40 s, ...)
    pool = wait_for(lambda: get(c, namespace, "inferencepool", NAME), 180, "the InferencePool created after the CRD came")
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
    wait_for(lambda: condition(c, namespace, "InferencePoolReady").get("status") == "True", 60, "InferencePoolReady=True")
    wait_for(lambda: is_ready(wfis(c, namespace)), 120, "Ready once the EPP and server pods are (kwok marks them ready)")
    local_operator.proc.check_alive()


def test_gateway_mode_objects_are_accepted_and_status_says_pool_and_epp_ready(
        e2e_cluster: Cluster, gateway_crds: list[Path], local_operator: LocalOperator, namespace: str) -> None:
    c = e2e_cluster
    for f in gateway_crds:  # the first test installed them; applying again is a no-op, and lets this test run alone
        c.kubectl("apply", "--server-side", "-f", str(f))
    wait_for(lambda: crd_served(c, GIE_CRD) and crd_served(c, HTTPROUTE_CRD), 60, "the gateway CRDs Established")
    c.apply(service(namespace, gateway={"name": "inference-gateway", "sectionName": "http"}))
    svc = wait_for(lambda: (s := wfis(c, namespace)) and is_ready(s) and s, 180, "Ready")
    conds = {x["type"]: (x["status"], x["reason"]) for x in svc["status"]["conditions"]}
    assert conds["InferencePoolReady"] == ("True", "InferencePoolCreated")
    assert conds["EndpointPickerReady"] == ("True", "EndpointPickerAvailable")
    assert conds["HTTPRouteReady"] == ("True", "HTTPRouteCreated")  # no Gateway controller here to accept it
    assert svc["status"]["endpoint"] == ""  # no Gateway object, so no address yet

    uid = svc["metadata"]["uid"]
    pool = get(c, namespace, "inferencepool", NAME)
    assert pool["spec"]["selector"]["matchLabels"] == {SERVICE_LABEL: NAME, "app.kubernetes.io/component": "server"}
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["endpointPickerRef"] == {"group": "", "kind": "Service", "name": f"{NAME}-epp", "port": {"number": 9002},
                                                 "failureMode": "FailOpen"}  # group: the CRD's default, filled by the API server
    route = get(c, namespace, "httproute", NAME)
    assert route["spec"]["parentRefs"][0]["name"] == "inference-gateway" and route["spec"]["parentRefs"][0]["sectionName"] == "http"
    assert route["spec"]["rules"][0]["backendRefs"][0]["kind"] == "InferencePool"
    for obj in (pool, route):
        assert [(r["kind"], r["uid"]) for r in obj["metadata"]["ownerReferences"]] == [("InferenceService", uid)]

    # the pool's selector picks exactly the server pods; the EPP Service's pods are the EPP's
    servers = c.kubectl_json("-n", namespace, "get", "pods", "-l",
                             ",".join(f"{k}={v}" for k, v in pool["spec"]["selector"]["matchLabels"].items()))["items"]
    assert servers and all(p["metadata"]["labels"]["app.kubernetes.io/component"] == "server" for p in servers)
    epp = get(c, namespace, "deployment", f"{NAME}-epp")
    assert epp["spec"]["replicas"] == 2 and (epp.get("status") or {}).get("readyReplicas") == 2
    (ctr,) = epp["spec"]["template"]["spec"]["containers"]
    # HTTP probes on the side port (the kubelet's gRPC probes speak no TLS, the gRPC port only TLS); scheme: the
    # API server's default
    assert ctr["args"][0] == "epp" and ctr["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http", "scheme": "HTTP"}
    assert ctr["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http", "scheme": "HTTP"}
    assert {p["name"]: p["containerPort"] for p in ctr["ports"]} == {"grpc": 9002, "http": 9090}
    # stopping a picker: preStop sleeps while the gateway drops it, then --drain-grace-s, all within the pod's grace
    assert ctr["lifecycle"]["preStop"] == {"sleep": {"seconds": 5}}
    assert ctr["args"][ctr["args"].index("--drain-grace-s") + 1] == "30.0"
    assert epp["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 40
    svc_epp = get(c, namespace, "service", f"{NAME}-epp")
    assert {p["name"]: p.get("appProtocol") for p in svc_epp["spec"]["ports"]} == {"grpc": "http2", "http": None}
    assert get(c, namespace, "poddisruptionbudget", f"{NAME}-epp") is not None
    assert get(c, namespace, "deployment", f"{NAME}-router") is None and get(c, namespace, "service", NAME) is None

    # back to proxy mode: the gateway objects are pruned (delete is in the chart's RBAC), the router comes back
    c.kubectl("-n", namespace, "patch", "wfis", NAME, "--type", "merge",
              "-p", json.dumps({"spec": {"router": {"mode": "proxy", "gateway": None}}}))
    wait_for(lambda: get(c, namespace, "inferencepool", NAME) is None and get(c, namespace, "httproute", NAME) is None
             and get(c, namespace, "deployment", f"{NAME}-epp") is None, 120, "the gateway objects pruned")
    wait_for(lambda: get(c, namespace, "deployment", f"{NAME}-router") is not None, 60, "the router Deployment")
    svc = wait_for(lambda: (s := wfis(c, namespace)) and is_ready(s)
                   and s["status"].get("observedGeneration") == s["metadata"]["generation"] and s, 120, "Ready in proxy mode")
    assert not {x["type"] for x in svc["status"]["conditions"]} & {"InferencePoolReady", "EndpointPickerReady", "HTTPRouteReady"}
    assert svc["status"]["endpoint"] == f"http://{NAME}.{namespace}.svc:8000/v1"
    denied = local_operator.denials()  # pruning the gateway objects needs delete in the chart's RBAC
    assert not denied, "\n".join(denied)
