"""KServe's InferenceService CRD (serving.kserve.io, shortName isvc) installed beside ours: the bare names resolve to
KServe's, and every kubectl command the chart's NOTES print works as printed and resolves to warmfleet's (issue 39).

The commands are read from the NOTES of the chart installed by the session (`helm install` output) and from the
crds.install=false branch of NOTES.txt; a NOTES command this test does not know fails it, so a new one cannot go
unchecked. They run through bash, as a user pastes them, with kubectl on PATH and a kubeconfig whose current
namespace is the test's (the NOTES' example names `namespace: default`: that one line is pointed at the test's
namespace). `kubectl port-forward` cannot forward under kwok (pods never run: e2e/README.md); what it resolves,
svc/my-model, is checked to be the Service our operator made for our InferenceService.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import threading
from pathlib import Path
from typing import Iterator

import pytest

from conftest import CHART, E2E_DIR, Release, operator_image
from e2e_support import Cluster, wait_for, warmfleet_command

KSERVE_CRD = E2E_DIR / "fixtures" / "kserve-inferenceservices-crd.yaml"
KSERVE_CRD_NAME = "inferenceservices.serving.kserve.io"
OURS = "serving.warmfleet.io"
NAME = "my-model"  # the NOTES' example


@pytest.fixture(scope="module")
def kserve_crd(e2e_cluster: Cluster) -> Iterator[None]:
    c = e2e_cluster
    c.kubectl("apply", "-f", str(KSERVE_CRD))
    wait_for(lambda: c.kubectl("get", "isvc", "-A", check=False).returncode == 0, 60,
             "KServe's InferenceService CRD served (kubectl get isvc)")
    # its schema reaches the API server's OpenAPI a little after the CRD is established (kubectl explain reads it)
    wait_for(lambda: c.kubectl("explain", f"{KSERVE_CRD_NAME}.spec", check=False).returncode == 0, 60,
             "KServe's schema published (kubectl explain)")
    try:
        yield
    finally:
        c.kubectl("delete", "crd", KSERVE_CRD_NAME, "--ignore-not-found", "--wait=false", check=False)


def notes(release: Release) -> str:
    out = release.install_output
    assert "NOTES:" in out, out
    return out.split("NOTES:", 1)[1]


def heredoc(text: str) -> str:
    """The NOTES' `cat <<'YAML' | kubectl apply -f -` block, dedented, with its closing YAML line."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.strip() == "cat <<'YAML' | kubectl apply -f -")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].strip() == "YAML")
    indent = len(lines[start]) - len(lines[start].lstrip())
    return "\n".join(ln[indent:] for ln in lines[start:end + 1]) + "\n"


def commands(text: str) -> list[str]:
    """Every other command the NOTES print: indented lines starting with kubectl/warmfleet, and `backticked` ones."""
    found = []
    for ln in text.splitlines():
        s = ln.strip()
        if ln.startswith("  ") and re.match(r"(kubectl|warmfleet) ", s):
            found.append(re.split(r"\s{2,}#", s)[0].strip())
    found += re.findall(r"`((?:kubectl|warmfleet) [^`]+)`", text)
    return list(dict.fromkeys(found))


class Shell:
    """bash with the cluster's kubectl first on PATH, `warmfleet` the operator image's, and a kubeconfig whose
    current namespace is the test's."""

    def __init__(self, c: Cluster, namespace: str, cwd: Path):
        self.cwd = cwd
        kubeconfig = cwd / "kubeconfig"
        kubeconfig.write_text(Path(c.kubeconfig).read_text())
        env = {**os.environ, **c.env, "KUBECONFIG": str(kubeconfig)}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        bin_dir = cwd / "bin"
        bin_dir.mkdir()
        (bin_dir / "kubectl").symlink_to(c.kubectl_path)
        wf = bin_dir / "warmfleet"
        wf.write_text("#!/bin/sh\nexec " + " ".join(map(shlex.quote, warmfleet_command(operator_image()))) + ' "$@"\n')
        wf.chmod(0o755)
        env["PATH"] = f"{bin_dir}:{env.get('PATH', '')}"
        self.env = env
        self.run(f"kubectl config set-context --current --namespace={shlex.quote(namespace)}")

    def run(self, script: str, timeout: float = 120) -> str:
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=self.cwd, env=self.env,
                              capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, f"{script!r} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        return proc.stdout

    def first_lines(self, script: str, until: str, timeout: float = 60) -> list[str]:
        """A command that streams (kubectl get -w): its lines up to the first containing `until`, then stopped."""
        proc = subprocess.Popen(["bash", "-c", f"exec {script}"], cwd=self.cwd, env=self.env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        lines: list[str] = []
        deadline = threading.Timer(timeout, proc.kill)  # bounds the read below: a silent stream is killed
        deadline.start()
        try:
            for line in proc.stdout:
                lines.append(line.rstrip("\n"))
                if until in line:
                    break
        finally:
            deadline.cancel()
            proc.kill()
            proc.wait(timeout=10)
        assert any(until in ln for ln in lines), f"{script!r} printed no line with {until!r}:\n" + "\n".join(lines)
        return lines


def test_every_notes_command_works_and_resolves_to_warmfleet_beside_kserve(e2e_cluster, release, local_operator,
                                                                            kserve_crd, namespace, tmp_path):
    c = e2e_cluster
    sh = Shell(c, namespace, tmp_path)
    text = notes(release)
    # the premise: with KServe's CRD installed, the bare names are KServe's (the group sorted first)
    assert "GROUP:      serving.kserve.io" in sh.run("kubectl explain inferenceservice.spec")
    assert f"GROUP:      {OURS}" in sh.run("kubectl explain wfis.spec")  # NOTE: checked again below, as printed

    # 1. the inline example, piped to kubectl apply as printed (its namespace pointed at the test's)
    block = heredoc(text)
    assert "namespace: default" in block and f"name: {NAME}" in block
    applied = sh.run(block.replace("namespace: default", f"namespace: {namespace}"))
    assert f"inferenceservice.{OURS}/{NAME} created" in applied, applied
    (tmp_path / f"{NAME}.yaml").write_text("\n".join(block.splitlines()[1:-1]) + "\n")  # "my-model.yaml holds it"

    checks = {
        f"kubectl describe wfis {NAME}": lambda out: f"API Version:  {OURS}/v1alpha1" in out,
        f"kubectl explain wfis.spec": lambda out: f"GROUP:      {OURS}" in out and "tracing" in out,
        f"kubectl get wfis {NAME} -o yaml": lambda out: f"apiVersion: {OURS}/v1alpha1" in out and f"name: {NAME}" in out,
        "kubectl get nodes -o yaml > nodes.yaml": lambda out: (tmp_path / "nodes.yaml").read_text().startswith("apiVersion"),
        f"warmfleet operator render -f {NAME}.yaml --nodes nodes.yaml":
            lambda out: "kind: Deployment" in out and f"name: {NAME}" in out,
    }
    ran = set()
    for cmd in commands(text):
        if cmd == "kubectl get wfis -w":  # streams: read its header and our service's row, then stop it
            lines = sh.first_lines(cmd, NAME)
            assert lines[0].split()[:3] == ["NAME", "READY", "REASON"] and "ENGINE" in lines[0], lines
        elif cmd == f"kubectl port-forward svc/{NAME} 8000:8000":
            wait_for(lambda: c.kubectl("-n", namespace, "get", "svc", NAME, check=False).returncode == 0, 120,
                     f"Service {NAME} made by the operator")
            (owner,) = c.kubectl_json("-n", namespace, "get", "svc", NAME)["metadata"]["ownerReferences"]
            assert (owner["apiVersion"], owner["kind"], owner["name"]) == (f"{OURS}/v1alpha1", "InferenceService", NAME)
        elif cmd in checks:
            out = sh.run(cmd)
            assert checks[cmd](out), f"{cmd!r} printed:\n{out[-3000:]}"
        else:
            pytest.fail(f"the NOTES print a command this test does not run: {cmd!r}")
        ran.add(cmd)
    assert {"kubectl get wfis -w", f"kubectl port-forward svc/{NAME} 8000:8000", *checks} == ran

    # 2. the crds.install=false branch of NOTES.txt: the CRD from the operator, applied (server-side dry run: the
    # chart's CRD is left as it is)
    (crd_cmd,) = re.findall(r"\((warmfleet operator crd \| kubectl apply -f -)\)",
                            (CHART / "templates" / "NOTES.txt").read_text())
    out = sh.run(crd_cmd + " --dry-run=server")
    assert f"customresourcedefinition.apiextensions.k8s.io/inferenceservices.{OURS}" in out, out

    # KServe's CRD still answers by its own names: nothing of ours went to it
    assert sh.run("kubectl get isvc -o name") == ""
    sh.run(f"kubectl delete wfis {NAME} --wait=false")
