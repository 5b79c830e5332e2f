"""Helpers shared by warmfleet's e2e tests: a handle on a running cluster and a deadline poll.

Kept out of conftest.py so test modules can import them (``from e2e_support import ...``)
without clashing with tests/conftest.py when both directories run in one session.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

from warmfleet.localprocs import free_port  # noqa: F401  (e2e modules import it from here)

T = TypeVar("T")


class WaitTimeout(AssertionError):
    pass


class GiveUp(AssertionError):
    """Raised inside a ``wait_for`` condition when waiting longer cannot help (a process died)."""


def wait_for(
    fn: Callable[[], T | None],
    timeout: float,
    what: str,
    interval: float = 0.25,
) -> T:
    """Call ``fn`` until it returns a truthy value or ``timeout`` seconds pass.

    Exceptions from ``fn`` count as "not yet" and the last one is reported on timeout,
    together with the last value seen.
    """
    deadline = time.monotonic() + timeout
    last: Any = None
    last_exc: BaseException | None = None
    while True:
        try:
            last = fn()
            last_exc = None
            if last:
                return last
        except Exception as exc:  # noqa: BLE001 - reported below
            last_exc = exc
        if time.monotonic() >= deadline:
            detail = f"last error: {last_exc!r}" if last_exc else f"last value: {last!r}"
            raise WaitTimeout(f"timed out after {timeout:.0f}s waiting for {what} ({detail})")
        time.sleep(interval)


@dataclass(frozen=True)
class Cluster:
    """A running control plane and the tools to talk to it."""

    kubeconfig: Path
    bin_dir: Path | None
    kubectl_path: Path
    helm_path: Path | None
    name: str | None = None
    owned: bool = False
    env: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    def run(self, argv: list[str], *, input: str | None = None, check: bool = True,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(argv, input=input, capture_output=True, text=True,
                              env=self.env, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(
                f"command failed ({proc.returncode}): {' '.join(argv)}\n"
                f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
        return proc

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return self.run([str(self.kubectl_path), "--kubeconfig", str(self.kubeconfig),
                         "--request-timeout=60s", *args],
                        input=input, check=check, timeout=timeout)

    def kubectl_json(self, *args: str) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    def apply(self, manifest: str | dict | list, namespace: str | None = None) -> None:
        if not isinstance(manifest, str):
            docs = manifest if isinstance(manifest, list) else [manifest]
            manifest = json.dumps({"apiVersion": "v1", "kind": "List", "items": docs})
        ns = ["-n", namespace] if namespace else []
        self.kubectl("apply", *ns, "-f", "-", input=manifest)

    def token_kubeconfig(self, namespace: str, service_account: str, path: Path,
                         duration: str = "2h") -> Path:
        """Write a kubeconfig at ``path`` that authenticates only as the ServiceAccount.

        The token comes from the TokenRequest API (``kubectl create token``), so the RBAC the
        API server enforces is exactly the account's; no client certificate is included.
        """
        token = self.kubectl("-n", namespace, "create", "token", service_account,
                             f"--duration={duration}").stdout.strip()
        raw = self.kubectl_json("config", "view", "--raw", "--minify", "--flatten")
        cluster = raw["clusters"][0]["cluster"]
        user = f"system:serviceaccount:{namespace}:{service_account}"
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "e2e", "cluster": {
                "server": cluster["server"],
                "certificate-authority-data": cluster["certificate-authority-data"],
            }}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": user,
                                                     "namespace": namespace}}],
            "current-context": "e2e",
        }
        path.write_text(json.dumps(config, indent=2))  # JSON is YAML
        path.chmod(0o600)
        return path

    def as_kubeconfig(self, kubeconfig: Path) -> "Cluster":
        """The same cluster and tools, talking through another kubeconfig."""
        env = dict(self.env)
        env["KUBECONFIG"] = str(kubeconfig)
        return Cluster(kubeconfig=kubeconfig, bin_dir=self.bin_dir, kubectl_path=self.kubectl_path,
                       helm_path=self.helm_path, name=self.name, owned=False, env=env)

    def helm(self, *args: str, check: bool = True,
             timeout: float = 300) -> subprocess.CompletedProcess[str]:
        if self.helm_path is None:
            raise AssertionError("helm is not available (no WARMFLEET_E2E_BIN/helm, none on PATH)")
        return self.run([str(self.helm_path), "--kubeconfig", str(self.kubeconfig), *args],
                        check=check, timeout=timeout)


# ---- local processes (the operator, and the data plane from the operator's pod specs) ----

IMAGES_ENV = "WARMFLEET_E2E_IMAGES"


def image_environments() -> dict[str, Path]:
    """$WARMFLEET_E2E_IMAGES (`REPOSITORY=BIN_DIR,...`, printed by .ci/installed.sh): the environment that stands
    for each image, so a pod's process runs from what its image installs, not from the checkout."""
    out: dict[str, Path] = {}
    for item in filter(None, os.environ.get(IMAGES_ENV, "").split(",")):
        repo, sep, bin_dir = item.partition("=")
        if not sep or not (Path(bin_dir) / "warmfleet").is_file():
            raise AssertionError(f"{IMAGES_ENV}: {item!r} is not REPOSITORY=DIR with DIR/warmfleet")
        out[repo] = Path(bin_dir)
    return out


def warmfleet_command(image: str | None = None) -> list[str]:
    """How to run the `warmfleet` console script: from the environment standing for `image` (a container's image,
    repository[:tag]) when $WARMFLEET_E2E_IMAGES maps images, else from this interpreter's environment."""
    import sys

    envs = image_environments()
    if envs and image is not None:
        repo = image.rsplit(":", 1)[0] if ":" in image.rsplit("/", 1)[-1] else image
        if repo not in envs:
            raise AssertionError(f"no environment stands for image {image!r} in {IMAGES_ENV} ({sorted(envs)})")
        return [str(envs[repo] / "warmfleet")]
    script = Path(sys.executable).parent / "warmfleet"
    if script.is_file():
        return [str(script)]
    # -P: never put a cwd on sys.path (the repo's operator/ shadows the standard library)
    return [sys.executable, "-P", "-m", "warmfleet.cli"]


class LocalProcess:
    """A subprocess whose combined output goes to a log file; stopped with SIGTERM, then SIGKILL."""

    def __init__(self, name: str, argv: list[str], *, env: dict[str, str], cwd: Path, log_path: Path) -> None:
        self.name, self.argv, self.log_path = name, argv, log_path
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self, tail: int = 60) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-tail:])

    def check_alive(self) -> None:
        if not self.alive():
            raise GiveUp(f"{self.name} exited with {self.proc.returncode}:\n{self.log()}")

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=timeout)
        self._log.close()
        return self.proc.returncode


def expand_k8s_vars(value: str, env: dict[str, str]) -> str:
    """Kubelet's `$(VAR)` expansion of command and args: `$$` escapes, unknown names stay as they are."""
    import re

    def sub(m: "re.Match[str]") -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", sub, value)


def container_env(cluster: Cluster, namespace: str, container: dict[str, Any],
                  pod: dict[str, Any]) -> dict[str, str]:
    """The environment the kubelet would give `container` in `pod`: plain values, fieldRefs of the
    pod's metadata and secretKeyRefs read from the cluster (what a real pod would see)."""
    import base64

    out: dict[str, str] = {}
    for item in container.get("env") or []:
        name = item["name"]
        if "value" in item:
            out[name] = expand_k8s_vars(item["value"], out)
            continue
        src = item.get("valueFrom") or {}
        if "fieldRef" in src:
            path = src["fieldRef"]["fieldPath"]
            meta = pod["metadata"]
            fields = {"metadata.name": meta["name"], "metadata.namespace": meta.get("namespace", namespace),
                      "metadata.uid": meta.get("uid", ""), "spec.nodeName": pod.get("spec", {}).get("nodeName", ""),
                      "status.podIP": pod.get("status", {}).get("podIP", "")}
            if path not in fields:
                raise AssertionError(f"fieldRef {path} of env {name} is not emulated")
            out[name] = fields[path]
        elif "secretKeyRef" in src:
            ref = src["secretKeyRef"]
            secret = cluster.kubectl_json("-n", namespace, "get", "secret", ref["name"])
            out[name] = base64.b64decode(secret["data"][ref["key"]]).decode()
        else:
            raise AssertionError(f"env {name}: valueFrom {sorted(src)} is not emulated")
    return out
