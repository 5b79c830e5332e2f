"""Two operators elect a leader on the chart's Lease (issue 39, "an operator that survives its own failure").

Two `warmfleet operator run --leader-election` processes under the chart's ServiceAccount token (its Role grants the
Lease `<fullname>-operator` only): one leads and reconciles, the other stands by and reconciles nothing; the leader's
process is killed (SIGKILL: no release of the Lease), and a spec change is reconciled by the standby within 30 s of
the kill. The session's plain local operator is stopped for the test (it would reconcile beside them) and started again.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from conftest import Example, LocalOperator, Release, is_ready, operator_image
from e2e_support import Cluster, LocalProcess, free_port, wait_for, warmfleet_command
from test_operator import GPU_NODES, deployments, wfis

TAKEOVER_S = 30  # the bound: a standby reconciles within 30 s of the leader's death


class Candidate:
    """One `warmfleet operator run --leader-election` process and its /healthz + /metrics port."""

    def __init__(self, identity: str, kubeconfig: Path, workdir: Path, release: Release) -> None:
        self.identity, self.port = identity, free_port()
        env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
        env["KUBECONFIG"] = str(kubeconfig)
        self.proc = LocalProcess(identity, [
            *warmfleet_command(operator_image()), "operator", "run", f"--liveness=http://127.0.0.1:{self.port}/healthz",
            "--leader-election", f"--lease-name={release.name}-operator", f"--lease-namespace={release.namespace}",
            f"--identity={identity}"], env=env, cwd=workdir, log_path=workdir / f"{identity}.log")

    def role(self) -> str | None:
        self.proc.check_alive()
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/healthz", timeout=2).json().get("role")
        except (httpx.HTTPError, ValueError):
            return None

    def reconciles(self) -> float:
        """Sum of warmfleet_operator_reconciles_total over outcomes, from its /metrics."""
        text = httpx.get(f"http://127.0.0.1:{self.port}/metrics", timeout=2).text
        return sum(float(v) for v in re.findall(r"^warmfleet_operator_reconciles_total\{[^}]*\} (\S+)$", text, re.M))

    def reconciled_lines(self) -> int:
        return self.proc.log_path.read_text(errors="replace").count("reconciled:")


@pytest.fixture
def candidates(e2e_cluster: Cluster, local_operator: LocalOperator, release: Release,
               tmp_path: Path) -> Iterator[list[Candidate]]:
    local_operator.stop()  # the only reconcilers during this test are the two candidates
    made: list[Candidate] = []
    try:
        yield made
    finally:
        for cand in made:
            cand.proc.stop()
            print(f"==== {cand.identity}\n{cand.proc.log(150)}")
        e2e_cluster.kubectl("-n", release.namespace, "delete", "lease", f"{release.name}-operator", "--ignore-not-found",
                            check=False)
        local_operator.start()


def service(namespace: str, replicas: int) -> dict[str, Any]:
    return {"apiVersion": "serving.warmfleet.io/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "ha", "namespace": namespace},
            "spec": {"model": {"path": "/models/qwen", "hiddenSize": 896}, "replicas": replicas,
                     "nodeSelector": GPU_NODES}}


def test_a_standby_operator_takes_over_within_30s_of_the_leaders_death_and_never_both_reconcile(
        e2e_cluster: Cluster, release: Release, candidates: list[Candidate], namespace: str, local_operator: LocalOperator,
        tmp_path: Path) -> None:
    c = e2e_cluster
    a = Candidate("op-a", local_operator.kubeconfig, tmp_path, release)
    candidates.append(a)
    wait_for(lambda: a.role() == "leader", 60, "op-a to acquire the Lease")
    b = Candidate("op-b", local_operator.kubeconfig, tmp_path, release)
    candidates.append(b)
    wait_for(lambda: b.role() == "standby", 60, "op-b to stand by")
    lease = c.kubectl_json("-n", release.namespace, "get", "lease", f"{release.name}-operator")
    assert lease["spec"]["holderIdentity"] == "op-a"

    ex = Example("ha", namespace, "")
    c.apply(service(namespace, 1))
    wait_for(lambda: is_ready(wfis(c, ex)), 90, "op-a to reconcile the service to Ready")
    assert a.reconciles() >= 1 and a.reconciled_lines() >= 1
    assert b.role() == "standby" and b.reconciles() == 0 and b.reconciled_lines() == 0  # the standby did nothing

    a.proc.proc.send_signal(signal.SIGKILL)  # no clean shutdown: the Lease is not released, it must lapse
    killed = time.monotonic()
    a.proc.proc.wait(timeout=10)
    c.kubectl("-n", namespace, "patch", "wfis", "ha", "--type", "merge", "-p", json.dumps({"spec": {"replicas": 2}}))
    generation = wfis(c, ex)["metadata"]["generation"]

    def reconciled_by_b() -> bool:
        st = wfis(c, ex).get("status") or {}
        return st.get("observedGeneration") == generation and st.get("desiredReplicas") == 2

    wait_for(reconciled_by_b, TAKEOVER_S - (time.monotonic() - killed), "op-b to reconcile the spec change")
    print(json.dumps({"kill_to_reconciled_s": round(time.monotonic() - killed, 1)}))  # the figure, for the record
    assert b.role() == "leader" and b.reconciles() >= 1
    assert sum(d["spec"]["replicas"] for n, d in deployments(c, ex).items()
               if d["metadata"]["labels"].get("app.kubernetes.io/component") == "server") == 2
    lease = c.kubectl_json("-n", release.namespace, "get", "lease", f"{release.name}-operator")
    assert lease["spec"]["holderIdentity"] == "op-b" and lease["spec"]["leaseTransitions"] >= 1
    assert "Forbidden" not in b.proc.log(400)  # the chart's Role suffices (create, get/update of this Lease)
