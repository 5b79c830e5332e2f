"""Two real vLLM replicas sharing one LMCache multi-process server, as a vLLM pool's node tier would: a prefix computed
by one replica is served to the other from LMCache, output equal, salts apart (docs/node-tier-vllm.md).

lmcache 0.5.6 comes from scripts/lmcache-env.sh (a folder beside the vLLM environment, on PYTHONPATH: its path in
WARMFLEET_LMCACHE_PATH, set by `make test-vllm`). On a CPU-only vLLM, LMCache moves KV by the engine-driven path
(the worker gathers its blocks and sends them), which the server must be started to accept: its default,
lmcache_driven, refuses the worker's registration ("No handler registered for operation
register_kv_cache_engine_driven_context") and vLLM's startup blocks (its message timeout is 300 s).
The operator does not render this yet; the replicas get the connector from `extra_args` on top of what it renders.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import httpx
import pytest

from warmfleet.livefleet import wait_for
from warmfleet.localprocs import free_port

from .conftest import STARTUP_S, VllmReplica

CHUNK = 256  # LMCache's chunk: it stores and serves whole 256-token chunks
PREFIX = [(i * 7919) % 3900 + 100 for i in range(4 * CHUNK + 76)]  # token ids (the bench checkpoint's vocab is 4,096)
# Plain exec of the CLI's main: the folder has no console script (pip --target --no-deps)
LMCACHE_MAIN = "import sys; from lmcache.cli.main import main; sys.argv[0] = 'lmcache'; main()"


@dataclass
class LMCacheServer:
    """`lmcache server` on loopback, host memory only, accepting engine-driven (CPU worker) transfers."""

    python: str
    path: str
    log: Path
    port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    proc: Optional[subprocess.Popen] = None

    def start(self) -> None:
        args = ["server", "--host", "127.0.0.1", "--port", str(self.port), "--http-host", "127.0.0.1",
                "--http-port", str(self.http_port), "--l1-size-gb", "0.5", "--eviction-policy", "LRU",
                "--supported-transfer-mode", "engine_driven", "--disable-observability"]
        env = dict(os.environ, PYTHONPATH=self.path, LMCACHE_DISABLE_BANNER="1")
        self.proc = subprocess.Popen([self.python, "-c", LMCACHE_MAIN, *args], env=env, cwd=self.log.parent,
                                     stdout=self.log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(lambda: httpx.get(f"http://127.0.0.1:{self.http_port}/healthcheck", timeout=2).status_code == 200,
                 f"lmcache server (log: {self.log})", [self.proc], 120)

    def connector_args(self) -> list[str]:
        """vLLM's flag for this server (LMCacheMPConnector; vLLM's own `--kv-offloading-backend lmcache` names it too)."""
        return ["--kv-transfer-config", json.dumps({"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                                                    "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1",
                                                                                  "lmcache.mp.port": self.port}})]

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def lmcache_pair(vllm_python, tmp_path_factory):
    from warmfleet.server.tiny_checkpoints.vl import make_tiny_vl_model

    path = os.environ.get("WARMFLEET_LMCACHE_PATH")
    if not path or not Path(path, "lmcache").is_dir():
        raise RuntimeError("WARMFLEET_LMCACHE_PATH must name scripts/lmcache-env.sh's folder: run `make test-vllm`")
    work = tmp_path_factory.mktemp("lmcache")
    model = make_tiny_vl_model(work / "vl-bench", arch="qwen2_vl", size="bench", seed=0)
    server = LMCacheServer(vllm_python, path, work / "lmcache.log")
    reps: list[VllmReplica] = []
    try:
        server.start()
        env = {"PYTHONPATH": path, "LMCACHE_DISABLE_BANNER": "1"}
        reps = [VllmReplica(vllm_python, model, work / f"vllm-{i}.log", extra_args=server.connector_args(),
                            extra_env=env) for i in range(2)]
        for r in reps:
            r.start()
        for r in reps:
            r.wait_ready([x.proc for x in reps] + [server.proc])
        yield reps
    finally:
        for r in reps:
            r.kill()
        server.kill()


def complete(replica: VllmReplica, salt: Optional[str] = None) -> str:
    body = {"model": "tiny", "prompt": PREFIX, "max_tokens": 8, "temperature": 0, **({"cache_salt": salt} if salt else {})}
    r = httpx.post(replica.url + "/v1/completions", json=body, timeout=STARTUP_S)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def from_lmcache(replica: VllmReplica) -> int:
    """Prompt tokens this replica loaded through its KV connector (vLLM's own counter)."""
    text = httpx.get(replica.url + "/metrics", timeout=10).text
    m = re.search(r'^vllm:prompt_tokens_by_source_total\{[^}]*source="external_kv_transfer"[^}]*\} (\S+)$', text, re.M)
    assert m, "vLLM exports no prompt_tokens_by_source_total for external_kv_transfer"
    return int(float(m.group(1)))


def test_a_prefix_computed_by_one_replica_is_served_to_the_other_from_lmcache(lmcache_pair):
    a, b = lmcache_pair
    cold = complete(a, salt="tenant-a")  # the CPU worker's store is synchronous: in LMCache once this returns
    assert from_lmcache(a) == 0  # a computed it: nothing came from LMCache
    before = from_lmcache(b)
    assert complete(b, salt="tenant-a") == cold  # same greedy output as the cold run
    assert from_lmcache(b) - before == 4 * CHUNK  # every whole chunk of the prefix came from A's stores


def test_another_salt_never_reads_the_entries(lmcache_pair):
    a, b = lmcache_pair
    complete(a, salt="tenant-x")
    before = from_lmcache(b)
    complete(b, salt="tenant-y")
    assert from_lmcache(b) == before
    complete(b, salt="tenant-x")
    assert from_lmcache(b) - before == 4 * CHUNK
