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

import os
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from e2e_support import Cluster, wait_for

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
