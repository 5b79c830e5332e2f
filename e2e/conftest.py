"""Fixtures for warmfleet's end-to-end tests against a real Kubernetes control plane.

The session fixture ``e2e_cluster`` brings up a kwok cluster with ``e2e/cluster.sh up``
(real etcd, kube-apiserver, kube-controller-manager, kube-scheduler; kwok fakes the GPU
nodes and marks pods Running/Ready) and deletes it at the end of the session. To reuse a
cluster that is already running, set ``WARMFLEET_E2E_KUBECONFIG`` (and optionally
``WARMFLEET_E2E_BIN`` to the toolchain directory); such a cluster is never deleted.
``WARMFLEET_E2E_KEEP=1`` keeps a cluster this fixture created (``e2e/cluster.sh down`` later).

A missing toolchain (no Go, failed build) fails the session with cluster.sh's message: the
e2e suite never skips silently.

Helpers: ``Cluster.kubectl(...)``, ``Cluster.kubectl_json(...)``, ``Cluster.helm(...)`` and
``wait_for(fn, timeout, what)``, which polls with a deadline instead of sleeping blindly.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import httpx

import pytest

from e2e_support import Cluster, LocalProcess, free_port, wait_for, warmfleet_command

E2E_DIR = Path(__file__).resolve().parent
REPO_ROOT = E2E_DIR.parent
CLUSTER_SH = E2E_DIR / "cluster.sh"


def _run_cluster_sh(*args: str, env: dict[str, str], timeout: float) -> str:
    proc = subprocess.run(["bash", str(CLUSTER_SH), *args], capture_output=True, text=True,
                          env=env, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(
            f"e2e/cluster.sh {' '.join(args)} failed (exit {proc.returncode}); the e2e suite "
            f"needs the control-plane toolchain, see e2e/README.md.\n{proc.stderr[-6000:]}",
            pytrace=False)
    return proc.stdout


def _toolchain_dir(env: dict[str, str]) -> Path:
    if env.get("WARMFLEET_E2E_BIN"):
        return Path(env["WARMFLEET_E2E_BIN"])
    # Builds on first use (tens of minutes on 2 cores), instant from the cache afterwards.
    out = _run_cluster_sh("bin", env=env, timeout=3 * 3600)
    return Path(out.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def e2e_cluster() -> Iterator[Cluster]:
    env = dict(os.environ)
    reuse = env.get("WARMFLEET_E2E_KUBECONFIG")
    name: str | None = None
    owned = False
    if reuse:
        kubeconfig = Path(reuse)
        if not kubeconfig.is_file():
            pytest.fail(f"WARMFLEET_E2E_KUBECONFIG={reuse} is not a file", pytrace=False)
        bin_dir: Path | None = Path(env["WARMFLEET_E2E_BIN"]) if env.get("WARMFLEET_E2E_BIN") else None
        if bin_dir is None and not shutil.which("kubectl", path=env.get("PATH")):
            bin_dir = _toolchain_dir(env)
    else:
        bin_dir = _toolchain_dir(env)
        env["WARMFLEET_E2E_BIN"] = str(bin_dir)
        name = f"wf-e2e-py-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        out = _run_cluster_sh("up", name, env=env, timeout=900)
        kubeconfig = Path(out.strip().splitlines()[-1])
        owned = True

    def tool(name_: str) -> Path | None:
        override = env.get(f"WARMFLEET_E2E_{name_.upper()}")
        if override:
            return Path(override)
        if bin_dir is not None and (bin_dir / name_).is_file():
            return bin_dir / name_
        found = shutil.which(name_, path=env.get("PATH"))
        return Path(found) if found else None

    kubectl = tool("kubectl")
    if kubectl is None:
        pytest.fail("kubectl not found (set WARMFLEET_E2E_BIN or WARMFLEET_E2E_KUBECTL)", pytrace=False)
    run_env = dict(env)
    run_env["KUBECONFIG"] = str(kubeconfig)
    if bin_dir is not None:
        run_env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    cluster = Cluster(kubeconfig=kubeconfig, bin_dir=bin_dir, kubectl_path=kubectl,
                      helm_path=tool("helm"), name=name, owned=owned, env=run_env)
    try:
        yield cluster
    finally:
        if owned and env.get("WARMFLEET_E2E_KEEP") != "1":
            subprocess.run(["bash", str(CLUSTER_SH), "down", name or ""], env=env,
                           capture_output=True, text=True, timeout=300)


@pytest.fixture
def namespace(e2e_cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace per test, deleted afterwards (without waiting for it to go)."""
    base = request.node.name.lower().replace("_", "-")[:40].strip("-")
    ns = f"{base}-{uuid.uuid4().hex[:5]}"
    e2e_cluster.kubectl("create", "namespace", ns)
    # Pods need the namespace's default ServiceAccount (made by kube-controller-manager).
    wait_for(lambda: e2e_cluster.kubectl("-n", ns, "get", "serviceaccount", "default",
                                         check=False).returncode == 0,
             60, f"default ServiceAccount in {ns}")
    try:
        yield ns
    finally:
        e2e_cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)



# ---- the chart, the operator and the example service (shared by test_operator and test_dataplane) ----

RELEASE = "warmfleet"
RELEASE_NS = "warmfleet-system"
CHART = REPO_ROOT / "charts" / "warmfleet"


def operator_image() -> str:
    """The image the chart runs the operator from (its slim image)."""
    import yaml

    return yaml.safe_load((CHART / "values.yaml").read_text())["image"]["repository"]
EXAMPLE = REPO_ROOT / "examples" / "inferenceservice.yaml"
CRD_NAME = "inferenceservices.serving.warmfleet.io"
SERVING_LABEL = "warmfleet.io/serving"  # the example's spec.nodeSelector


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "destructive: deletes the shared example service or the chart; runs last")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that delete the shared service / uninstall the chart run after every other e2e test
    (stable: file order is kept otherwise)."""
    items.sort(key=lambda it: 1 if it.get_closest_marker("destructive") else 0)


@dataclass
class Release:
    """The chart installed with helm: its name, namespace and operator ServiceAccount."""

    name: str
    namespace: str
    service_account: str
    installed: bool = True
    install_output: str = ""
    install_seconds: float = 0.0


@pytest.fixture(scope="session")
def release(e2e_cluster: Cluster) -> Iterator[Release]:
    """`helm install` of charts/warmfleet; the chart's own operator Deployment is scaled to 0 so that
    only the local operator (under the chart's ServiceAccount) acts."""
    import time

    c = e2e_cluster
    if c.helm_path is None:
        pytest.fail("helm is not available: the e2e toolchain must provide it", pytrace=False)
    # A reused cluster may hold a release of a session that died, or still be deleting what one left.
    if c.helm("status", RELEASE, "--namespace", RELEASE_NS, check=False).returncode == 0:
        c.helm("uninstall", RELEASE, "--namespace", RELEASE_NS, "--wait")
    # A reused cluster may still be deleting what a previous session left (namespace, CRD).
    wait_for(lambda: not terminating(c, "namespace", RELEASE_NS) and not terminating(c, "crd", CRD_NAME),
             120, f"namespace {RELEASE_NS} and CRD {CRD_NAME} of an earlier run to finish deleting")
    t0 = time.monotonic()
    out = c.helm("install", RELEASE, str(CHART), "--namespace", RELEASE_NS, "--create-namespace",
                 "--wait", "--timeout", "120s").stdout
    rel = Release(RELEASE, RELEASE_NS, RELEASE, install_output=out, install_seconds=time.monotonic() - t0)
    try:
        yield rel
    finally:
        if rel.installed:
            c.helm("uninstall", RELEASE, "--namespace", RELEASE_NS, "--wait", check=False)
        # leave a reused cluster as we found it: the CRD is kept by helm on purpose
        c.kubectl("delete", "crd", CRD_NAME, "--ignore-not-found", "--wait=false", check=False)
        c.kubectl("delete", "namespace", RELEASE_NS, "--ignore-not-found", "--wait=false", check=False)


def terminating(c: Cluster, *what: str) -> bool:
    """Whether the object exists and is being deleted."""
    r = c.kubectl("get", *what, "-o", "json", check=False)
    return r.returncode == 0 and bool(json.loads(r.stdout)["metadata"].get("deletionTimestamp"))


def scale_chart_operator_to_zero(c: Cluster, rel: Release) -> None:
    c.kubectl("-n", rel.namespace, "scale", "deployment", f"{rel.name}-operator", "--replicas=0")
    wait_for(lambda: not c.kubectl_json("-n", rel.namespace, "get", "pods", "-l",
                                        "app.kubernetes.io/name=warmfleet")["items"],
             60, "the chart's operator pod to go (scaled to 0)")


@dataclass
class LocalOperator:
    """`warmfleet operator run` as a local process authenticated only by the chart's ServiceAccount token."""

    cluster: Cluster
    kubeconfig: Path
    workdir: Path
    proc: LocalProcess | None = None
    health_port: int = 0
    generation: int = 0
    logs: list[Path] = field(default_factory=list)

    def start(self) -> None:
        assert self.proc is None or not self.proc.alive()
        self.generation += 1
        self.health_port = free_port()
        env = dict(os.environ)
        env.pop("KUBERNETES_SERVICE_HOST", None)  # never the in-cluster login
        env["KUBECONFIG"] = str(self.kubeconfig)
        # as an admin would through the chart (operator.allowedEndpointHosts): the hubs and stores the tests run are on
        # loopback, an address the operator otherwise refuses to read (EndpointRefused)
        env["WARMFLEET_ALLOWED_ENDPOINT_HOSTS"] = "127.0.0.1"
        log = self.workdir / f"operator-{self.generation}.log"
        self.logs.append(log)
        self.proc = LocalProcess(
            f"operator #{self.generation}",
            [*warmfleet_command(operator_image()), "operator", "run",
             f"--liveness=http://127.0.0.1:{self.health_port}/healthz"],
            env=env, cwd=self.workdir, log_path=log)

        def healthy() -> bool:
            self.proc.check_alive()
            try:
                return httpx.get(f"http://127.0.0.1:{self.health_port}/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, 90, f"operator #{self.generation} liveness endpoint")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    def log(self) -> str:
        return self.proc.log(200) if self.proc else ""

    def denials(self) -> list[str]:
        """Log lines of requests the API server refused with 403, but for a namespace being deleted (another test's:
        NamespaceTerminating refuses new objects with 403 too, which says nothing about RBAC)."""
        return [ln for ln in self.log().splitlines()
                if (" 403 " in ln or "status=403" in ln or "Forbidden" in ln) and "is being terminated" not in ln]

    def count(self, text: str) -> int:
        return self.proc.log_path.read_text(errors="replace").count(text) if self.proc else 0


@pytest.fixture(scope="session")
def local_operator(e2e_cluster: Cluster, release: Release, tmp_path_factory) -> Iterator[LocalOperator]:
    scale_chart_operator_to_zero(e2e_cluster, release)
    workdir = tmp_path_factory.mktemp("operator")  # cwd outside the repo (operator/ shadows the stdlib)
    kubeconfig = e2e_cluster.token_kubeconfig(release.namespace, release.service_account,
                                              workdir / "operator.kubeconfig")
    op = LocalOperator(e2e_cluster, kubeconfig, workdir)
    op.start()
    try:
        yield op
    finally:
        op.stop()
        for log in op.logs:  # surfaced by pytest on failure (-rA shows it for every test)
            print(f"==== {log.name}\n{log.read_text(errors='replace')[-20000:]}")


def is_ready(obj: dict[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (obj.get("status") or {}).get("conditions", []))


@dataclass
class Example:
    """examples/inferenceservice.yaml applied with kubectl, plus what it expects to exist."""

    name: str
    namespace: str
    api_key: str


def model_store(namespace: str) -> list[dict[str, Any]]:
    """The `model-store` PVC the example mounts, bound to a static PV (no provisioner under kwok)."""
    return [
        {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"e2e-model-store-{namespace}"},
         "spec": {"capacity": {"storage": "100Gi"}, "accessModes": ["ReadOnlyMany"], "storageClassName": "",
                  "hostPath": {"path": "/models"}, "persistentVolumeReclaimPolicy": "Retain",
                  "claimRef": {"namespace": namespace, "name": "model-store"}}},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "model-store", "namespace": namespace},
         "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "", "volumeName": f"e2e-model-store-{namespace}",
                  "resources": {"requests": {"storage": "100Gi"}}}},
    ]


@pytest.fixture(scope="session")
def example(e2e_cluster: Cluster, local_operator: LocalOperator) -> Iterator[Example]:
    """The example service, Ready: its node selector label on the GPU nodes, its model PVC and API-key Secret."""
    import yaml

    c = e2e_cluster
    doc = yaml.safe_load(EXAMPLE.read_text())
    name, ns = doc["metadata"]["name"], doc["metadata"].get("namespace", "default")
    secret = doc["spec"]["router"]["apiKeySecret"]["name"]
    assert doc["spec"]["nodeSelector"] == {SERVING_LABEL: "true"}, "the e2e setup labels nodes for this selector"
    c.kubectl("label", "nodes", "-l", "nvidia.com/gpu.present=true", f"{SERVING_LABEL}=true", "--overwrite")
    wait_for(lambda: not terminating(c, "-n", ns, "pvc", "model-store")
             and not terminating(c, "pv", f"e2e-model-store-{ns}")
             and not terminating(c, "-n", ns, "wfis", name),
             120, "the example's objects of an earlier run to finish deleting")
    c.apply(model_store(ns))
    api_key = f"sk-e2e-{uuid.uuid4().hex[:12]}"
    c.kubectl("-n", ns, "delete", "secret", secret, "--ignore-not-found")
    c.kubectl("-n", ns, "create", "secret", "generic", secret, f"--from-literal=api-key={api_key}")
    # The example names no engine (kind auto: vLLM on these fake GPU nodes). The data-plane test starts the rendered
    # servers as local processes, and on this machine only warmfleet's own engine runs: pin it, as a user may.
    doc["spec"]["engine"] = {"kind": "warmfleet"}
    try:
        c.apply(doc)
        wait_for(lambda: is_ready(c.kubectl_json("-n", ns, "get", "wfis", name)), 120,
                 f"InferenceService {name} Ready")
        yield Example(name, ns, api_key)
    finally:
        c.kubectl("-n", ns, "delete", "wfis", name, "--ignore-not-found", "--wait=false", check=False)
        c.kubectl("-n", ns, "delete", "secret", secret, "--ignore-not-found", check=False)
        c.kubectl("-n", ns, "delete", "pvc", "model-store", "--ignore-not-found", "--wait=false", check=False)
        c.kubectl("delete", "pv", f"e2e-model-store-{ns}", "--ignore-not-found", "--wait=false", check=False)
        c.kubectl("label", "nodes", "-l", "nvidia.com/gpu.present=true", f"{SERVING_LABEL}-", check=False)
