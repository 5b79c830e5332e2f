"""Smoke test of the e2e control plane itself: real API server, scheduler, controller-manager,
fake GPU nodes from kwok. The operator/chart e2e tests build on the same fixtures."""

from __future__ import annotations

from e2e_support import Cluster, wait_for

GIB = 1024**3
SHAPES = {
    # product: (gpu.memory MiB label, allocatable host memory, cpu)
    "NVIDIA-H200": ("143771", "2Ti", "192"),
    "NVIDIA-L4": ("23034", "384Gi", "96"),
}


def _ready(obj: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in obj.get("status", {}).get("conditions", []))


def _gpu_nodes(cluster: Cluster) -> list[dict]:
    return cluster.kubectl_json("get", "nodes", "-l", "nvidia.com/gpu.present=true")["items"]


def test_control_plane_version(e2e_cluster: Cluster) -> None:
    version = e2e_cluster.kubectl_json("version")
    server = version["serverVersion"]
    assert server["gitVersion"].startswith("v1."), server
    # The client and server come from the same pinned k8s.io/kubernetes module.
    assert version["clientVersion"]["gitVersion"] == server["gitVersion"]
    healthz = e2e_cluster.kubectl("get", "--raw", "/readyz?verbose").stdout
    assert "readyz check passed" in healthz


def test_fake_gpu_nodes_have_both_shapes_and_are_ready(e2e_cluster: Cluster) -> None:
    nodes = wait_for(lambda: [n for n in _gpu_nodes(e2e_cluster) if _ready(n)] or None,
                     60, "Ready GPU nodes")
    by_product: dict[str, list[dict]] = {}
    for node in nodes:
        by_product.setdefault(node["metadata"]["labels"]["nvidia.com/gpu.product"], []).append(node)
    assert set(by_product) >= set(SHAPES), sorted(by_product)
    for product, (gpu_mem, host_mem, cpu) in SHAPES.items():
        for node in by_product[product]:
            meta, status = node["metadata"], node["status"]
            assert meta["annotations"]["kwok.x-k8s.io/node"] == "fake"
            assert meta["labels"]["nvidia.com/gpu.memory"] == gpu_mem
            assert status["allocatable"]["nvidia.com/gpu"] == "8"
            assert status["allocatable"]["memory"] == host_mem
            assert status["allocatable"]["cpu"] == cpu
            assert _ready(node)
            # Nothing may dial a fake node anywhere but loopback.
            ips = [a["address"] for a in status["addresses"] if a["type"] == "InternalIP"]
            assert ips == ["127.0.0.1"], ips


def test_deployment_pods_become_ready_on_gpu_nodes(e2e_cluster: Cluster, namespace: str) -> None:
    replicas = 3
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "smoke"},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": "smoke"}},
            "template": {
                "metadata": {"labels": {"app": "smoke"}},
                "spec": {
                    "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-L4"},
                    "containers": [{
                        "name": "server",
                        "image": "warmfleet.invalid/never-pulled:0",
                        "resources": {
                            "requests": {"cpu": "4", "memory": "32Gi", "nvidia.com/gpu": "2"},
                            "limits": {"memory": "32Gi", "nvidia.com/gpu": "2"},
                        },
                    }],
                },
            },
        },
    }
    e2e_cluster.apply(deployment, namespace=namespace)

    def ready_replicas() -> bool:
        st = e2e_cluster.kubectl_json("-n", namespace, "get", "deployment", "smoke")["status"]
        return st.get("readyReplicas") == replicas and st.get("availableReplicas") == replicas

    wait_for(ready_replicas, 120, f"{replicas} ready replicas of deployment smoke")
    pods = e2e_cluster.kubectl_json("-n", namespace, "get", "pods", "-l", "app=smoke")["items"]
    l4_nodes = {n["metadata"]["name"] for n in _gpu_nodes(e2e_cluster)
                if n["metadata"]["labels"]["nvidia.com/gpu.product"] == "NVIDIA-L4"}
    assert len(pods) == replicas
    for pod in pods:
        assert pod["status"]["phase"] == "Running"
        assert _ready(pod)
        assert pod["spec"]["nodeName"] in l4_nodes  # placed by the real kube-scheduler
        assert pod["status"].get("podIP")


def test_scheduler_respects_gpu_capacity(e2e_cluster: Cluster, namespace: str) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "too-many-gpus"},
        "spec": {"containers": [{
            "name": "c", "image": "warmfleet.invalid/never-pulled:0",
            "resources": {"limits": {"nvidia.com/gpu": "9"}},
        }]},
    }
    e2e_cluster.apply(pod, namespace=namespace)

    def unschedulable() -> bool:
        p = e2e_cluster.kubectl_json("-n", namespace, "get", "pod", "too-many-gpus")
        return any(c["type"] == "PodScheduled" and c["status"] == "False"
                   and c.get("reason") == "Unschedulable"
                   for c in p.get("status", {}).get("conditions", []))

    wait_for(unschedulable, 60, "PodScheduled=False/Unschedulable for a 9-GPU pod")


def test_garbage_collector_deletes_dependents(e2e_cluster: Cluster, namespace: str) -> None:
    owner = e2e_cluster.kubectl_json(
        "-n", namespace, "create", "configmap", "owner", "--from-literal=k=v")
    dependent = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "dependent",
            "ownerReferences": [{
                "apiVersion": "v1", "kind": "ConfigMap", "name": "owner",
                "uid": owner["metadata"]["uid"],
            }],
        },
        "data": {"k": "v"},
    }
    e2e_cluster.apply(dependent, namespace=namespace)
    e2e_cluster.kubectl("-n", namespace, "delete", "configmap", "owner", "--cascade=background")

    def dependent_gone() -> bool:
        r = e2e_cluster.kubectl("-n", namespace, "get", "configmap", "dependent", check=False)
        return r.returncode != 0 and "NotFound" in r.stderr

    wait_for(dependent_gone, 60, "garbage collection of the dependent ConfigMap")


def test_rbac_is_enforced_for_service_account_tokens(
        e2e_cluster: Cluster, namespace: str, tmp_path) -> None:
    e2e_cluster.kubectl("-n", namespace, "create", "serviceaccount", "probe")
    probe = e2e_cluster.as_kubeconfig(
        e2e_cluster.token_kubeconfig(namespace, "probe", tmp_path / "probe.kubeconfig"))
    who = probe.kubectl_json("auth", "whoami")
    assert who["status"]["userInfo"]["username"] == f"system:serviceaccount:{namespace}:probe"
    denied = probe.kubectl("-n", namespace, "get", "pods", check=False)
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower(), denied.stderr

    e2e_cluster.kubectl("-n", namespace, "create", "role", "pod-reader",
                        "--verb=get,list", "--resource=pods")
    e2e_cluster.kubectl("-n", namespace, "create", "rolebinding", "probe-reads",
                        "--role=pod-reader", f"--serviceaccount={namespace}:probe")
    wait_for(lambda: probe.kubectl("-n", namespace, "get", "pods", check=False).returncode == 0,
             30, "the RoleBinding to take effect")
    still_denied = probe.kubectl("-n", namespace, "create", "configmap", "nope", check=False)
    assert still_denied.returncode != 0 and "forbidden" in still_denied.stderr.lower()


def test_helm_client_works(e2e_cluster: Cluster) -> None:
    out = e2e_cluster.helm("version", "--short").stdout
    assert out.startswith("v"), out
    # Talks to the cluster: lists releases in all namespaces (none yet is fine).
    e2e_cluster.helm("list", "--all-namespaces")
