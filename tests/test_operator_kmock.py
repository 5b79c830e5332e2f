"""Handler flows with kopf running in-process against kmock: create, update, nodes, bad spec, delete, restart."""

from __future__ import annotations

import json
from typing import Any


from fakehub import FakeHub
from operator_fixtures.cluster import (DEPLOY, ISVC, NODES, condition, eventually, obj, operator, seed, server_deployments,
                                       status, writes)
from operator_fixtures.shapes import GiB, TiB, a100, h200, l4, service
from warmfleet.operator.spec.constants import SIZING_HASH_ANNOTATION


async def test_create_builds_children_and_status(cluster):
    seed(cluster, h200("h1"), l4("l1"))
    seed(cluster, service(spec={"replicas": 3}), res=ISVC)
    async with operator(cluster):
        await eventually(lambda: condition(cluster, "InvalidSpec").get("status") == "False", "a reconciled status")
        deps = server_deployments(cluster)
        assert len(deps) == 2 and sum(d["spec"]["replicas"] for d in deps.values()) == 3
        for res, name in [("v1/services", "qwen"), ("v1/services", "qwen-replicas"), ("v1/configmaps", "qwen-config"),
                          ("policy/v1/poddisruptionbudgets", "qwen-server"), (DEPLOY, "qwen-router"),
                          ("rbac.authorization.k8s.io/v1/roles", "qwen-router")]:
            child = obj(cluster, res, name)
            assert child is not None, name
            assert child["metadata"]["ownerReferences"][0]["uid"] == "uid-qwen"
        st = status(cluster)
        assert st["observedGeneration"] == 1 and st["desiredReplicas"] == 3 and st["readyReplicas"] == 0
        assert st["endpoint"] == "http://qwen.default.svc:8000/v1"
        assert {p["shape"]["gpuProduct"] for p in st["pools"]} == {"NVIDIA-H200", "NVIDIA-L4"}
        h = next(p for p in st["pools"] if p["shape"]["gpuProduct"] == "NVIDIA-H200")
        assert h["sizes"]["swapSpaceGib"] == 161.25 and h["inputs"]["hostBytesPerReplica"] == int(2 * TiB * 0.9 / 8)
        assert condition(cluster, "Ready")["status"] == "False"
        assert condition(cluster, "Progressing")["status"] == "True"
        assert condition(cluster, "Degraded")["status"] == "False"

        # Readiness of a child flows into the parent's status through the Deployment watch.
        for name in list(deps) + ["qwen-router"]:
            d = obj(cluster, DEPLOY, name)
            await cluster.patch(f"/apis/apps/v1/namespaces/default/deployments/{name}",
                                json={"status": {"readyReplicas": d["spec"]["replicas"]}})
        await eventually(lambda: condition(cluster, "Ready").get("status") == "True", "Ready=True")
        assert status(cluster)["readyReplicas"] == 3 and status(cluster)["ready"] == "True"


async def test_update_spec_and_restart_without_changes(cluster, caplog):
    seed(cluster, h200("h1"))
    seed(cluster, service(spec={"replicas": 2}), res=ISVC)
    async with operator(cluster):
        await eventually(lambda: status(cluster).get("replicas") == 2, "2 replicas")
        (name,) = server_deployments(cluster)
        hash_before = server_deployments(cluster)[name]["spec"]["template"]["metadata"]["annotations"][SIZING_HASH_ANNOTATION]
        ready_since = condition(cluster, "Ready")["lastTransitionTime"]
        await cluster.patch(f"/apis/{ISVC.rsplit('/', 1)[0]}/namespaces/default/inferenceservices/qwen",
                            json={"metadata": {"generation": 2}, "spec": {"replicas": 4, "cache": {"swapSpace": {"mode": "Fixed", "size": 32}}}})
        await eventually(lambda: status(cluster).get("observedGeneration") == 2, "generation 2 observed")
        dep = server_deployments(cluster)[name]
        assert dep["spec"]["replicas"] == 4
        assert dep["spec"]["template"]["metadata"]["annotations"][SIZING_HASH_ANNOTATION] != hash_before
        assert "32.0" in dep["spec"]["template"]["spec"]["containers"][0]["args"]
        assert condition(cluster, "Ready")["lastTransitionTime"] == ready_since  # status unchanged → time kept
    mark = len(list(cluster))
    caplog.set_level("INFO", logger="kopf")
    caplog.clear()
    async with operator(cluster):
        # the resume handler runs and finds nothing to change: no child writes at all
        await eventually(lambda: any("reconcile_service' succeeded" in r.getMessage() for r in caplog.records), "resume handled")
    assert writes(cluster, mark) == []
    assert any("/services/qwen" in r.url.path for r in list(cluster)[mark:])  # the children were read back


async def test_a_field_the_operator_stops_setting_is_removed(cluster):
    """Server-side apply: an hf:// source renders a fetch-model init container; switching to a baked path
    drops `initContainers` from every pod template (a merge patch leaves a key it does not mention)."""
    config = {"architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl", "hidden_size": 3584,
              "torch_dtype": "bfloat16", "vision_config": {"embed_dim": 1280}}
    with FakeHub() as hub:
        hub.add("acme/m", {"config.json": json.dumps(config).encode()})
        seed(cluster, h200("h1"))
        seed(cluster, service(spec={"replicas": 1, "model": {"source": "hf://acme/m@main", "hub": {"endpoint": hub.url}}}),
             res=ISVC)
        async with operator(cluster):
            def templates() -> list[dict[str, Any]]:
                deps = [*server_deployments(cluster).values(), obj(cluster, DEPLOY, "qwen-router")]
                return [d["spec"]["template"]["spec"] for d in deps if d]

            await eventually(lambda: len(templates()) == 2 and all("initContainers" in t for t in templates()),
                             "fetch-model init containers")
            applies = cluster.applies
            await cluster.patch(f"/apis/{ISVC.rsplit('/', 1)[0]}/namespaces/default/inferenceservices/qwen",
                                json={"metadata": {"generation": 2},
                                      "spec": {"model": {"source": None, "hub": None, "path": "/models/qwen"}}})
            await eventually(lambda: status(cluster).get("observedGeneration") == 2, "generation 2 observed")
            assert len(templates()) == 2 and not any("initContainers" in t for t in templates())
            assert cluster.applies > applies  # removed by applying the new intent, not by deleting the Deployments
            assert all(c["args"][c["args"].index("--model") + 1] == "/models/qwen" for t in templates()
                       for c in t["containers"] if "--model" in c["args"])


async def test_node_added_and_changed(cluster):
    seed(cluster, h200("h1"), a100("a1"))
    seed(cluster, service(spec={"replicas": 20}), res=ISVC)
    async with operator(cluster):
        await eventually(lambda: condition(cluster, "Degraded").get("reason") == "InsufficientCapacity", "capacity short")
        before = {n: d["spec"]["template"] for n, d in server_deployments(cluster).items()}
        mark = len(list(cluster))
        # a second H200 node: more capacity, same sizes → replicas move, no template changes
        await cluster.post("/api/v1/nodes", json=h200("h2"))
        await eventually(lambda: status(cluster).get("replicas") == 20, "20 replicas placed")
        assert condition(cluster, "Degraded")["status"] == "False"
        after = {n: d["spec"]["template"] for n, d in server_deployments(cluster).items()}
        assert after == before
        # a heartbeat-like node update that changes no shape causes no writes
        mark = len(list(cluster))
        await cluster.patch("/api/v1/nodes/h1", json={"status": {"conditions": [{"type": "Ready", "status": "True", "lastHeartbeatTime": "now"}]}})
        await cluster.patch("/api/v1/nodes/h2", json={"metadata": {"annotations": {"touched": "yes"}}})
        # the A100 node's allocatable memory shrinks: only the A100 pool rolls
        await cluster.patch("/api/v1/nodes/a1", json={"status": {"allocatable": {"memory": f"{(TiB - 64 * GiB) // 1024}Ki"}}})
        a100_name = next(n for n in before if "a100" in n)
        await eventually(lambda: server_deployments(cluster)[a100_name]["spec"]["template"] != before[a100_name], "a100 re-sized")
        after = {n: d["spec"]["template"] for n, d in server_deployments(cluster).items()}
        assert [n for n in before if after[n] != before[n]] == [a100_name]
        child_writes = writes(cluster, mark)
        assert child_writes and all("deployments/" + a100_name in w or "configmaps" in w for w in child_writes), child_writes


async def test_node_removed_prunes_its_pool(cluster):
    seed(cluster, h200("h1"), l4("l1"))
    seed(cluster, service(spec={"replicas": 2}), res=ISVC)
    async with operator(cluster):
        await eventually(lambda: len(server_deployments(cluster)) == 2, "two pools")
        await cluster.delete("/api/v1/nodes/l1")
        await eventually(lambda: len(server_deployments(cluster)) == 1, "the L4 pool deleted")
        assert "h200" in next(iter(server_deployments(cluster)))
        await eventually(lambda: len(status(cluster).get("pools", [])) == 1, "one pool in status")


async def test_bad_spec_is_a_condition_and_an_event_not_a_crash(cluster):
    seed(cluster, h200("h1"))
    seed(cluster, service(spec={"replicas": 1, "autoscaling": {"minReplicas": 4, "maxReplicas": 3}}), res=ISVC)
    async with operator(cluster):
        cond = await eventually(lambda: condition(cluster, "InvalidSpec").get("status") == "True" and condition(cluster, "InvalidSpec"), "InvalidSpec")
        assert "minReplicas must be <= maxReplicas" in cond["message"]
        assert server_deployments(cluster) == {}
        events = await eventually(lambda: [o.raw for (r, _, _), o in cluster.objects.items()
                                           if r.plural == "events" and not o.deleted and o.raw.get("reason") == "InvalidSpec"], "an Event")
        assert events[0]["type"] == "Warning" and events[0]["involvedObject"]["name"] == "qwen"
        # fixing the spec recovers
        await cluster.patch(f"/apis/{ISVC.rsplit('/', 1)[0]}/namespaces/default/inferenceservices/qwen",
                            json={"metadata": {"generation": 2}, "spec": {"autoscaling": None}})
        await eventually(lambda: condition(cluster, "InvalidSpec").get("status") == "False", "InvalidSpec cleared")
        assert len(server_deployments(cluster)) == 1


async def test_delete_is_not_blocked_and_not_recreated(cluster):
    seed(cluster, h200("h1"))
    seed(cluster, service(spec={"replicas": 1}), res=ISVC)
    async with operator(cluster):
        await eventually(lambda: status(cluster).get("replicas") == 1 and obj(cluster, "v1/services", "qwen"), "reconciled")
        await cluster.delete(f"/apis/{ISVC.rsplit('/', 1)[0]}/namespaces/default/inferenceservices/qwen")
        await eventually(lambda: obj(cluster, ISVC, "qwen") is None, "the service gone (no blocking finalizer)")
        mark = len(list(cluster))
        await cluster.post("/api/v1/nodes", json=h200("h2"))
        await eventually(lambda: obj(cluster, NODES, "h2", None) is not None, "node seen")
        assert writes(cluster, mark) == []


async def test_a_vllm_service_reconciles_with_its_engine_in_status(cluster):
    seed(cluster, h200("h1"), l4("l1"))
    seed(cluster, service(spec={"replicas": 2, "engine": {"kind": "vllm", "image": "vllm/vllm-openai:v0.32.0"}}), res=ISVC)
    async with operator(cluster):
        await eventually(lambda: condition(cluster, "InvalidSpec").get("status") == "False", "a reconciled status")
        deps = server_deployments(cluster)
        assert len(deps) == 2
        for dep in deps.values():
            c = dep["spec"]["template"]["spec"]["containers"][0]
            assert c["command"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"] and c["image"] == "vllm/vllm-openai:v0.32.0"
            assert "--kv-offloading-size" in c["args"] and "--max-encoder-cache" not in c["args"]
        router = obj(cluster, DEPLOY, "qwen-router")["spec"]["template"]["spec"]["containers"][0]
        assert router["image"] == "img:test" and router["args"][router["args"].index("--engine") + 1] == "vllm"
        headless = obj(cluster, "v1/services", "qwen-replicas")
        assert [p["name"] for p in headless["spec"]["ports"]] == ["http", "kv-events", "kv-replay"]
        pools = status(cluster)["pools"]
        assert [p["engine"] for p in pools] == ["vllm", "vllm"]
        assert all("encoderCacheTokens" not in p["sizes"] and p["sizes"]["gpuMemoryUtilization"] == 0.9 for p in pools)


async def test_warmfleet_with_tensor_parallelism_is_invalid_spec_and_an_event(cluster):
    seed(cluster, h200("h1"))
    seed(cluster, service(spec={"replicas": 1, "server": {"gpusPerReplica": 2}}), res=ISVC)
    async with operator(cluster):
        cond = await eventually(lambda: condition(cluster, "InvalidSpec").get("status") == "True" and condition(cluster, "InvalidSpec"),
                                "InvalidSpec")
        assert cond["message"].startswith("spec.server.gpusPerReplica: is 2, but engine warmfleet runs one GPU per replica")
        assert server_deployments(cluster) == {}  # nothing silently requests two GPUs
        events = await eventually(lambda: [o.raw for (r, _, _), o in cluster.objects.items()
                                           if r.plural == "events" and not o.deleted and o.raw.get("reason") == "InvalidSpec"], "an Event")
        assert "engine warmfleet runs one GPU per replica" in events[0]["message"]
        # switching the engine to one that runs tensor parallel recovers
        await cluster.patch(f"/apis/{ISVC.rsplit('/', 1)[0]}/namespaces/default/inferenceservices/qwen",
                            json={"metadata": {"generation": 2}, "spec": {"engine": {"kind": "fastdeploy", "image": "fd:2"}}})
        await eventually(lambda: condition(cluster, "InvalidSpec").get("status") == "False", "InvalidSpec cleared")
        (dep,) = server_deployments(cluster).values()
        c = dep["spec"]["template"]["spec"]["containers"][0]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "2" and c["args"][c["args"].index("--tensor-parallel-size") + 1] == "2"


def events(cluster, reason: str) -> list[dict[str, Any]]:
    """Events the operator posted with `reason` (from the request log: kmock ignores generateName, so a
    second Event of one test is refused with 409 and never stored, though it was posted)."""
    return [r.data for r in list(cluster) if str(r.method).upper().endswith("POST") and r.url.path.endswith("/events")
            and isinstance(r.data, dict) and r.data.get("reason") == reason]


def a_pod(name: str, component: str, status: dict[str, Any], node: str | None = None) -> dict[str, Any]:
    """A pod of service qwen as its ReplicaSet makes it (labels, the model claim), with the given status."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "resourceVersion": "1",
                         "labels": {"app.kubernetes.io/managed-by": "warmfleet-operator", "serving.warmfleet.io/service": "qwen",
                                    "app.kubernetes.io/component": component}},
            "spec": {"nodeName": node, "containers": [{"name": component, "image": "img:test"}],
                     "volumes": [{"name": "model", "persistentVolumeClaim": {"claimName": "model-store", "readOnly": True}}]},
            "status": status}


def unschedulable(message: str) -> dict[str, Any]:
    return {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}]}


def container(name: str, ready: bool, state: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"phase": "Pending" if (state.get("waiting") or {}).get("reason") == "ContainerCreating" else "Running",
            "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True" if ready else "False"}],
            "containerStatuses": [{"name": name, "ready": ready, "restartCount": extra.get("restarts", 0), "state": state,
                                   "lastState": extra.get("last", {})}]}


async def test_pod_problems_become_the_ready_reason_with_one_warning_per_reason(cluster):
    seed(cluster, h200("h1"))
    seed(cluster, service(spec={"replicas": 2, "model": {"path": "/models/m", "pvc": "model-store"}}), res=ISVC)
    pvc_msg = '0/1 nodes are available: persistentvolumeclaim "model-store" not found. not found'
    async with operator(cluster):
        await eventually(lambda: condition(cluster, "InvalidSpec").get("status") == "False", "a reconciled status")
        assert condition(cluster, "Ready")["reason"] == "NotReady"  # no pod yet
        # The scheduler refuses the server pods; the router pod is bound and waits in ContainerCreating
        # (the kubelet's FailedMount is only an Event): the operator checks the claim itself.
        for name in ("qwen-h200-a", "qwen-h200-b"):
            await cluster.post("/api/v1/namespaces/default/pods", json=a_pod(name, "server", unschedulable(pvc_msg)))
        await cluster.post("/api/v1/namespaces/default/pods", json=a_pod(
            "qwen-router-a", "router", container("router", False, {"waiting": {"reason": "ContainerCreating"}}), node="h1"))
        cond = await eventually(lambda: "1/1 router pods" in condition(cluster, "Ready").get("message", "")
                                and condition(cluster, "Ready"), "MissingPVC for every pod")
        assert cond["status"] == "False" and cond["reason"] == "MissingPVC"
        assert cond["message"] == (f"2/2 server pods MissingPVC: {pvc_msg}; "
                                   '1/1 router pods MissingPVC: persistentvolumeclaim "model-store" not found; '
                                   "0/2 server replicas, 0 routers ready")
        (event,) = await eventually(lambda: events(cluster, "MissingPVC"), "a MissingPVC Event")
        assert event["type"] == "Warning" and event["involvedObject"]["name"] == "qwen" and "model-store" in event["message"]

        # The scheduler's message changes (more nodes): the status follows, the reason and its Event stay.
        new_msg = pvc_msg.replace("0/1", "0/2")
        for name in ("qwen-h200-a", "qwen-h200-b"):
            await cluster.patch(f"/api/v1/namespaces/default/pods/{name}", json={"status": unschedulable(new_msg)})
        await eventually(lambda: new_msg in condition(cluster, "Ready").get("message", ""), "the new scheduler message")

        # The claim appears; one server crash-loops, the others run: a new reason, a new Event, and
        # still a single MissingPVC Event (kopf posts in order, so none can be pending behind it).
        await cluster.post("/api/v1/namespaces/default/persistentvolumeclaims", json={
            "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "model-store", "namespace": "default", "resourceVersion": "1"}})
        crash = container("server", False, {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}},
                          restarts=3, last={"terminated": {"exitCode": 1, "reason": "Error"}})
        await cluster.patch("/api/v1/namespaces/default/pods/qwen-h200-a", json={"spec": {"nodeName": "h1"}, "status": crash})
        await cluster.patch("/api/v1/namespaces/default/pods/qwen-h200-b",
                            json={"spec": {"nodeName": "h1"}, "status": container("server", True, {"running": {}})})
        await cluster.patch("/api/v1/namespaces/default/pods/qwen-router-a", json={"status": container("router", True, {"running": {}})})
        cond = await eventually(lambda: condition(cluster, "Ready").get("reason") == "CrashLoopBackOff" and condition(cluster, "Ready"),
                                "CrashLoopBackOff")
        assert cond["message"].startswith("1/2 server pods CrashLoopBackOff: container server restarted 3 times, last exit code 1 (Error)")
        await eventually(lambda: events(cluster, "CrashLoopBackOff"), "a CrashLoopBackOff Event")
        assert len(events(cluster, "MissingPVC")) == 1

        # Everything Ready: no reason left from the pods, the Deployments' readiness decides.
        await cluster.patch("/api/v1/namespaces/default/pods/qwen-h200-a", json={"status": container("server", True, {"running": {}})})
        for name in list(server_deployments(cluster)) + ["qwen-router"]:
            d = obj(cluster, DEPLOY, name)
            await cluster.patch(f"/apis/apps/v1/namespaces/default/deployments/{name}", json={"status": {"readyReplicas": d["spec"]["replicas"]}})
        await eventually(lambda: condition(cluster, "Ready").get("reason") == "AllReplicasReady", "Ready")
        assert len(events(cluster, "MissingPVC")) == 1 and len(events(cluster, "CrashLoopBackOff")) == 1


async def test_no_matching_nodes_is_the_ready_reason_and_one_warning(cluster, caplog):
    seed(cluster, h200("h1"))
    seed(cluster, service(spec={"replicas": 1, "nodeSelector": {"pool": "nowhere"}}), res=ISVC)
    async with operator(cluster):
        cond = await eventually(lambda: condition(cluster, "Ready").get("reason") == "NoMatchingNodes" and condition(cluster, "Ready"),
                                "NoMatchingNodes")
        assert cond["status"] == "False" and condition(cluster, "Degraded")["reason"] == "NoMatchingNodes"
        (event,) = await eventually(lambda: events(cluster, "NoMatchingNodes"), "a NoMatchingNodes Event")
        assert event["type"] == "Warning" and "node selector" in event["message"]
    caplog.set_level("INFO", logger="kopf")
    caplog.clear()
    async with operator(cluster):  # a restart reads the reason back from status: no second Event
        await eventually(lambda: any("reconcile_service' succeeded" in r.getMessage() for r in caplog.records), "resume handled")
        # then a node that matches: the reason goes, and comes back (a new Event) when the node goes
        await cluster.post("/api/v1/nodes", json=h200("h2", labels={"pool": "nowhere"}))
        await eventually(lambda: condition(cluster, "Ready").get("reason") not in (None, "NoMatchingNodes"), "a pool")
        assert len(events(cluster, "NoMatchingNodes")) == 1
        await cluster.delete("/api/v1/nodes/h2")
        await eventually(lambda: len(events(cluster, "NoMatchingNodes")) == 2, "a second NoMatchingNodes Event")
