"""Why a service is not Ready, from pod dicts shaped as the scheduler and the kubelet leave them (pure)."""

from __future__ import annotations

import copy
from typing import Any

from warmfleet.operator.planning.diagnose import Diagnosis, claims_to_check, diagnose, pod_finding, slim_pod
from warmfleet.operator.planning.service_status import warnings

T = "2026-11-30T11:56:41Z"
PVC_SCHED = ('0/4 nodes are available: persistentvolumeclaim "model-store" not found. not found')  # kube-scheduler 1.37, seen on kwok
GPU_SCHED = ("0/5 nodes are available: 5 Insufficient nvidia.com/gpu. preemption: 0/5 nodes are available: "
             "5 Preemption is not helpful for scheduling.")


def pod(name: str, component: str = "server", *, claim: str | None = "model-store") -> dict[str, Any]:
    """A pod of the service as its ReplicaSet creates it (labels, the model claim), before the scheduler saw it."""
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}", "creationTimestamp": T,
                     "labels": {"app.kubernetes.io/component": component, "serving.warmfleet.io/service": "qwen-vl",
                                "app.kubernetes.io/managed-by": "warmfleet-operator", "pod-template-hash": "abc"}},
        "spec": {"containers": [{"name": component, "image": "img:1"}],
                 "volumes": [{"name": "tmp", "emptyDir": {}},
                             *([{"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}] if claim else []),
                             {"name": "kube-api-access-x", "projected": {"sources": []}}]},
        "status": {"phase": "Pending", "qosClass": "Guaranteed"},
    }


def unschedulable(p: dict[str, Any], message: str) -> dict[str, Any]:
    p["status"]["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message,
                                  "lastProbeTime": None, "lastTransitionTime": T, "observedGeneration": 1}]
    return p


def bound(p: dict[str, Any], *, ready: bool, state: dict[str, Any], restarts: int = 0,
          last: dict[str, Any] | None = None, phase: str = "Running") -> dict[str, Any]:
    """Scheduled to a node; the kubelet's view of its one container."""
    name = p["spec"]["containers"][0]["name"]
    p["spec"]["nodeName"] = "gpu-h200-0"
    flag = "True" if ready else "False"
    p["status"].update(phase=phase, hostIP="10.0.0.9", startTime=T, conditions=[
        {"type": "PodReadyToStartContainers", "status": "True" if phase == "Running" else "False", "lastTransitionTime": T},
        {"type": "Initialized", "status": "True", "lastTransitionTime": T},
        {"type": "Ready", "status": flag, "lastTransitionTime": T,
         **({} if ready else {"reason": "ContainersNotReady", "message": f"containers with unready status: [{name}]"})},
        {"type": "ContainersReady", "status": flag, "lastTransitionTime": T,
         **({} if ready else {"reason": "ContainersNotReady", "message": f"containers with unready status: [{name}]"})},
        {"type": "PodScheduled", "status": "True", "lastTransitionTime": T}])
    p["status"]["containerStatuses"] = [{"name": name, "image": "img:1", "imageID": "", "ready": ready, "started": ready,
                                         "restartCount": restarts, "state": state, "lastState": last or {}}]
    return p


def running(p: dict[str, Any], ready: bool = True) -> dict[str, Any]:
    return bound(p, ready=ready, state={"running": {"startedAt": T}})


def waiting(p: dict[str, Any], reason: str, message: str | None = None, **kw: Any) -> dict[str, Any]:
    w = {"reason": reason, **({"message": message} if message else {})}
    return bound(p, ready=False, state={"waiting": w}, **kw)


def test_all_ready_says_nothing():
    assert diagnose([running(pod("s1")), running(pod("r1", "router"))]) == Diagnosis()
    assert diagnose([]) == Diagnosis()


def test_unschedulable_pods_carry_the_schedulers_message_counted():
    pods = [unschedulable(pod(f"s{i}"), GPU_SCHED) for i in range(3)] + [running(pod(f"s{i}")) for i in range(3, 12)]
    d = diagnose(pods)
    assert d.reason == "Unschedulable" and d.problem
    assert d.message == f"3/12 server pods Unschedulable: {GPU_SCHED}"


def test_missing_pvc_as_the_scheduler_reports_it():
    pods = [unschedulable(pod(f"s{i}"), PVC_SCHED) for i in range(12)] + \
           [unschedulable(pod(f"r{i}", "router"), PVC_SCHED) for i in range(2)]
    d = diagnose(pods)
    assert d.reason == "MissingPVC"
    assert d.message == f"12/12 server pods, 2/2 router pods MissingPVC: {PVC_SCHED}"
    assert claims_to_check(pods) == {"model-store"}


def test_missing_pvc_of_a_bound_pod_as_the_kubelet_leaves_it():
    # The kubelet reports FailedMount ("... persistentvolumeclaims "model-store" not found") only as an
    # Event; the pod's status just waits in ContainerCreating. The direct check names the claim.
    p = waiting(pod("s1"), "ContainerCreating", phase="Pending")
    assert pod_finding(p).reason == "Starting"
    assert diagnose([p]).message == "1/1 server pods Starting: containers not ready: server ContainerCreating"
    d = diagnose([p], missing_claims={"model-store"})
    assert (d.reason, d.message) == ("MissingPVC", '1/1 server pods MissingPVC: persistentvolumeclaim "model-store" not found')
    # a claim that exists, or a pod without one, is not blamed
    assert diagnose([p], missing_claims={"other"}).reason == "Starting"
    assert diagnose([waiting(pod("s2", claim=None), "ContainerCreating", phase="Pending")], {"model-store"}).reason == "Starting"


def test_missing_secret_from_create_container_config_error():
    p = waiting(pod("r1", "router", claim=None), "CreateContainerConfigError", 'secret "qwen-vl-api-key" not found', phase="Pending")
    d = diagnose([p, running(pod("r2", "router", claim=None))])
    assert (d.reason, d.message) == ("MissingSecret", '1/2 router pods MissingSecret: secret "qwen-vl-api-key" not found')
    key = waiting(pod("r3", "router"), "CreateContainerConfigError", "couldn't find key api-key in Secret default/qwen-vl-api-key")
    assert pod_finding(key).reason == "MissingSecret"
    other = waiting(pod("r4", "router"), "CreateContainerConfigError", 'configmap "x" not found')
    assert (pod_finding(other).reason, pod_finding(other).detail) == ("CreateContainerConfigError", 'container router: configmap "x" not found')


def test_image_pull_failures_are_one_reason():
    msg = 'Back-off pulling image "ghcr.io/x/warmfleet:nope"'
    backoff = waiting(pod("s1"), "ImagePullBackOff", msg, phase="Pending")
    err = waiting(pod("s2"), "ErrImagePull", "rpc error: code = NotFound desc = failed to pull and unpack image", phase="Pending")
    d = diagnose([backoff, err, running(pod("s3"))])
    assert d.reason == "ImagePullBackOff"
    assert d.message.startswith("2/3 server pods ImagePullBackOff: container server: ")
    assert pod_finding(backoff).detail == f"container server: ImagePullBackOff: {msg}"
    assert pod_finding(waiting(pod("s4"), "InvalidImageName", "couldn't parse image name")).reason == "ImagePullBackOff"


def test_crash_loop_names_the_last_exit():
    last = {"terminated": {"exitCode": 137, "reason": "OOMKilled", "startedAt": T, "finishedAt": T, "containerID": "c://1"}}
    p = waiting(pod("s1"), "CrashLoopBackOff", "back-off 5m0s restarting failed container=server pod=s1", restarts=7, last=last)
    d = diagnose([p])
    assert (d.reason, d.message) == ("CrashLoopBackOff", "1/1 server pods CrashLoopBackOff: container server restarted 7 times, "
                                                         "last exit code 137 (OOMKilled)")
    last = {"terminated": {"exitCode": 1, "reason": "Error", "message": "FileNotFoundError: /models/Qwen2-VL-7B-Instruct"}}
    f = pod_finding(waiting(pod("s2"), "CrashLoopBackOff", "back-off", restarts=2, last=last))
    assert f.detail == "container server restarted 2 times, last exit code 1 (Error): FileNotFoundError: /models/Qwen2-VL-7B-Instruct"


def test_init_container_crash_loop():
    p = waiting(pod("s1"), "PodInitializing", phase="Pending")
    p["status"]["initContainerStatuses"] = [{"name": "download", "ready": False, "restartCount": 3,
                                             "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                                             "lastState": {"terminated": {"exitCode": 2, "reason": "Error"}}}]
    f = pod_finding(p)
    assert (f.reason, f.detail) == ("CrashLoopBackOff", "init container download restarted 3 times, last exit code 2 (Error)")


def test_running_not_ready_is_starting():
    d = diagnose([running(pod("s1"), ready=False), running(pod("s2")), running(pod("r1", "router"), ready=False)])
    assert not d.problem and d.reason == "Starting"
    assert d.message == ("1/2 server pods Starting: containers not ready: server running, not ready; "
                         "1/1 router pods Starting: containers not ready: router running, not ready")
    fresh = pod("s3")  # created, not yet seen by the scheduler
    assert pod_finding(fresh).detail == "waiting to be scheduled"


def test_most_severe_first_and_deleted_or_finished_pods_do_not_count():
    pods = [running(pod("s1"), ready=False), unschedulable(pod("s2"), GPU_SCHED),
            waiting(pod("s3"), "CrashLoopBackOff", restarts=1, last={"terminated": {"exitCode": 1, "reason": "Error"}}),
            waiting(pod("s4"), "ImagePullBackOff", "Back-off pulling image", phase="Pending")]
    gone = running(pod("s5"), ready=False)
    gone["metadata"]["deletionTimestamp"] = T
    evicted = pod("s6")
    evicted["status"].update(phase="Failed", reason="Evicted")
    d = diagnose(pods + [gone, evicted])
    assert d.reason == "ImagePullBackOff"
    assert [part.split(": ")[0] for part in d.message.split("; ")] == [
        "1/4 server pods ImagePullBackOff", "1/4 server pods CrashLoopBackOff", "1/4 server pods Unschedulable",
        "1/4 server pods Starting"]
    assert diagnose(list(reversed(pods))) == d  # deterministic whatever the order pods arrive in


def test_long_messages_are_clipped():
    p = unschedulable(pod("s1"), "0/900 nodes are available: " + "x " * 2000)
    assert len(diagnose([p] * 3).message) <= 1000
    assert len(pod_finding(p).detail) <= 400


def test_slim_pod_keeps_what_diagnose_reads_and_nothing_else():
    pods = [unschedulable(pod("s1"), PVC_SCHED), waiting(pod("s2"), "ContainerCreating", phase="Pending"),
            waiting(pod("s3"), "CrashLoopBackOff", "x", restarts=4, last={"terminated": {"exitCode": 3, "reason": "Error"}}),
            waiting(pod("r1", "router", claim=None), "CreateContainerConfigError", 'secret "k" not found'), running(pod("s4"))]
    slim = [slim_pod(p) for p in pods]
    for missing in (set(), {"model-store"}):
        assert diagnose(slim, missing) == diagnose(pods, missing)
    assert claims_to_check(slim) == claims_to_check(pods) == {"model-store"}
    assert "image" not in str(slim) and "uid-" not in str(slim) and "lastTransitionTime" not in str(slim)


def _status(reason: str, ready: str = "False", degraded: tuple[str, str] = ("False", "AsExpected"), message: str = "m") -> dict:
    return {"conditions": [{"type": "Ready", "status": ready, "reason": reason, "message": message},
                           {"type": "Degraded", "status": degraded[0], "reason": degraded[1], "message": "d"}]}


def test_warnings_only_when_the_reason_changes_to_a_problem():
    assert warnings({}, _status("MissingPVC")) == [("MissingPVC", "m")]
    assert warnings(_status("MissingPVC"), _status("MissingPVC", message="other counts")) == []  # de-duplicated
    assert warnings(_status("MissingPVC"), _status("Unschedulable")) == [("Unschedulable", "m")]
    assert warnings(_status("MissingPVC"), _status("Starting")) == []  # progress is not a warning
    assert warnings(_status("NotReady"), _status("AllReplicasReady", ready="True")) == []
    assert warnings(_status("Starting"), _status("Starting")) == []
    # Degraded turning True is posted once; with the same reason on Ready only one Event
    nomatch = _status("NoMatchingNodes", degraded=("True", "NoMatchingNodes"))
    assert warnings(_status("NotReady"), nomatch) == [("NoMatchingNodes", "m")]
    assert warnings(nomatch, copy.deepcopy(nomatch)) == []
    short = _status("Starting", degraded=("True", "InsufficientCapacity"))
    assert warnings(_status("Starting"), short) == [("InsufficientCapacity", "d")]
