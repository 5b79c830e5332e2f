"""Gateway benchmark (issue 24): warmfleet's proxy vs Envoy + warmfleet's EPP vs Envoy + GIE's lwepp, and routing.py's peers.

    python -P bench/gateway.py [--quick] [--json] [--fronts proxy,epp,lwepp,rr,sglang,vllm] [--model DIR]
                               [--replicas N] [--requests N] [--rates 4] [--seeds 0] [--gpu-blocks N]
                               [--envoy PATH] [--lwepp PATH] [--out DIR] [--logs DIR]

The same seeded text workload as bench/routing.py (its `workload`, replicas, client and summary are imported
from it, not copied), through each front on fresh `warmfleet serve` replicas per (rate, seed), fronts
interleaved so that they share the machine's load:

- `proxy`: `warmfleet route` (the HTTP proxy, as bench/routing.py runs it);
- `epp`: Envoy in front of `warmfleet epp` as bench/routing.py's `epp` router starts them (ext_proc; headers
  SEND, bodies FULL_DUPLEX_STREAMED, as GIE's gateways configure it; the bootstrap from the product's
  generator, server/router/epp/envoy_bootstrap.py);
- `lwepp`: the same generator's bootstrap in front of GIE v1.6.0's reference round-robin EPP `lwepp`
  (scripts/lwepp.sh builds it), changed only where lwepp needs it (`for_lwepp`: a buffer filter, then a
  STREAMED request body sent without waiting for the headers answer; no response body). lwepp has no static endpoint
  list: it watches an InferencePool and its pods through a Kubernetes API, so this bench brings up a kwok
  control plane (e2e/cluster.sh, one fake node, torn down at the end), installs the InferencePool CRD from
  the module, and declares one pod per replica (podIP 127.0.0.1, Ready, the annotation
  `inference.networking.k8s.io/active-ports` naming its port: lwepp's endpoints are pods x targetPorts);
  the control plane's CPU is not counted in the routing tier (a cluster runs it for everything);
- `gateway-proxy`: proxy mode behind a gateway, the case a cluster that already runs one is in: the same
  generator's bootstrap without ext_proc (`for_gateway_proxy`), Envoy forwarding everything to one
  `warmfleet route` (as an HTTPRoute to the router's Service would), which routes to the replicas;
- `rr`, `sglang`, `vllm`: bench/routing.py's peers (client-side round-robin; the two cache_aware routers).

Reports per front the cached-token ratio (from `usage`), TTFT p50/p90, spread (max / mean requests per
replica, from the replicas' x-warmfleet-replica header, which Envoy passes through), errors, and the routing
tier's CPU seconds per 1,000 requests: utime + stime of its processes (router; or Envoy + EPP) and of all
their descendants, reaped children included (/proc/PID/stat fields 14-17), from just before the first request
to just after the last answer; and the same net of the tier's idle burn (health checks, metric polls, KV
events: measured for 5 s with no traffic before each run), the marginal cost of requests. Targets (booleans under "targets"): the EPP's cached ratio within 0.02 of the
proxy's and ahead of lwepp and every peer; its TTFT p90 <= the proxy's; its CPU per request below the
proxy's (and, reported beside it, below gateway-proxy's: Envoy + proxy). A front that could not run is skipped, said up front and recorded under "skipped_fronts".

--sim-rates R1,R2,...: the tier's CPU at a gateway's rates, where a real engine here cannot go and where the
tier's per-wakeup costs no longer dominate (Envoy without ext_proc: ~2.5 ms per request at 4-16 requests/s,
0.4 at 400): the fronts (rr and the peers left out) in front of bench/simfleet.py's replicas with the zero time model
(real scheduler, block pool and KV events; answers at once), all started once and measured in turn per rate and
round (`--sim-rounds`, interleaved; the median round counts), offered by router_throughput.py's `hey` processes
(streamed chat bodies, `max_tokens` 4, usage included: ~6 response chunks). Reported under "sim": CPU ms per
request of the tier and of each of its processes, client latency p50/p99, errors; targets
`sim_epp_cpu_below_proxy` (every rate) and `sim_envoy_alone_below_proxy` (Envoy's own share of the EPP front
against the whole proxy: false means no endpoint picker, however cheap, can bring the tier below the proxy).

Both Envoys start alike (routing.py's flags: default --concurrency, one worker per core).
Writes gateway.json and gateway.png to --out; progress on stderr; with --json the last stdout line is one
JSON object. Sizes: --quick is routing.py's quick shape (tiny checkpoint, 2 replicas with 48 KV blocks,
60 requests, one rate, one seed: a few minutes); the default is its text shape (bench checkpoint,
4 replicas with 160 blocks, 120 requests, rates 2 and 6, seeds 0-2).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Mapping, Optional

import httpx

sys.path.append(str(Path(__file__).resolve().parent))  # bench/harness.py, after the stdlib
import harness  # noqa: E402
from warmfleet.livefleet import Envoy  # noqa: E402
from warmfleet.localprocs import free_port  # noqa: E402

routing_fleet = harness.sibling("routing_fleet")
routing_report = harness.sibling("routing_report")
routing_runners = harness.sibling("routing_runners")
routing_workload = harness.sibling("routing_workload")
progress = harness.reporter("gateway")

REPO = harness.BENCH.parent
EPP_FRONTS = ("epp", "lwepp")  # pickers behind Envoy
ENVOY_FRONTS = (*EPP_FRONTS, "gateway-proxy")  # fronts that need the Envoy binary
FRONTS = ("proxy", *EPP_FRONTS, "gateway-proxy", *routing_report.PEERS)
COLORS = {"proxy": harness.ROUTER_COLORS["warmfleet"], "epp": "#1b6b3a", "lwepp": "#8c564b"}
TARGETS = ("EPP cached ratio within 0.02 of the proxy's and ahead of lwepp and every peer; "
           "EPP TTFT p90 <= the proxy's; EPP routing-tier CPU per request < the proxy's")
POOL, NAMESPACE, POD_LABEL = "bench", "default", "warmfleet-bench-replica"
ACTIVE_PORTS = "inference.networking.k8s.io/active-ports"


def total(by_role: Optional[Mapping[str, float]]) -> float:
    return sum(by_role.values()) if by_role else 0.0


def net_of_idle(cpu_s: Optional[float], idle_cpu_s: Optional[float], idle_s: float, run_s: float) -> Optional[float]:
    """CPU of a run less what the tier burns idle over as long (measured for `idle_s` before it); never < 0."""
    if cpu_s is None or idle_cpu_s is None or idle_s <= 0:
        return None
    return max(0.0, cpu_s - idle_cpu_s / idle_s * run_s)


def per_1000(cpu_s: Optional[float], num_requests: int) -> Optional[float]:
    return round(cpu_s * 1000 / num_requests, 3) if cpu_s is not None and num_requests else None


# --- targets ----------------------------------------------------------------------------------------
def verdict(res: Mapping[str, Mapping]) -> dict:
    """The issue's targets for the EPP over the fronts measured (each a mean_of summary with
    cpu_s_per_1000_requests); empty without both the EPP and the proxy."""
    epp, proxy = res.get("epp"), res.get("proxy")
    if not epp or not proxy or epp.get("cached_ratio") is None or proxy.get("cached_ratio") is None:
        return {}
    others = {k: v["cached_ratio"] for k, v in res.items()  # gateway-proxy is warmfleet's proxy too: not a rival
              if k not in ("epp", "proxy", "gateway-proxy") and v.get("cached_ratio") is not None}
    out = {"epp_minus_proxy_ratio": round(epp["cached_ratio"] - proxy["cached_ratio"], 4),
           "epp_ratio_within_0.02_of_proxy": abs(epp["cached_ratio"] - proxy["cached_ratio"]) <= 0.02}
    if others:
        out["epp_minus_best_other_ratio"] = round(epp["cached_ratio"] - max(others.values()), 4)
        out["epp_ratio_ahead_of_lwepp_and_peers"] = all(epp["cached_ratio"] > r for r in others.values())
    if "lwepp" not in others:
        out["lwepp_measured"] = False  # "ahead of lwepp" then says nothing about lwepp
    if epp.get("ttft_p90_s") is not None and proxy.get("ttft_p90_s") is not None:
        out["epp_ttft_p90_vs_proxy"] = round(epp["ttft_p90_s"] / proxy["ttft_p90_s"], 3)
        out["epp_ttft_p90_le_proxy"] = epp["ttft_p90_s"] <= proxy["ttft_p90_s"]
    e_cpu, p_cpu = epp.get("cpu_s_per_1000_requests"), proxy.get("cpu_s_per_1000_requests")
    if e_cpu is not None and p_cpu:
        out["epp_cpu_vs_proxy"] = round(e_cpu / p_cpu, 3)
        out["epp_cpu_per_request_below_proxy"] = e_cpu < p_cpu
    g_cpu = (res.get("gateway-proxy") or {}).get("cpu_s_per_1000_requests")
    if e_cpu is not None and g_cpu:  # beside the issue's target: against proxy mode behind the same gateway
        out["epp_cpu_vs_gateway_proxy"] = round(e_cpu / g_cpu, 3)
        out["epp_cpu_per_request_below_gateway_proxy"] = e_cpu < g_cpu
    return out


# --- tools ------------------------------------------------------------------------------------------
def script_output(script: str) -> str:
    """Last stdout line of scripts/`script` (the cached binary's path)."""
    out = subprocess.run([str(REPO / "scripts" / script)], capture_output=True, text=True, check=True,
                         cwd=tempfile.gettempdir())
    return out.stdout.strip().splitlines()[-1]


def envoy_binary(arg: Optional[str]) -> str:
    """--envoy, else routing.py's (which the epp front runs too): $WARMFLEET_ENVOY or scripts/envoy-env.sh's."""
    if arg:
        os.environ["WARMFLEET_ENVOY"] = arg  # routing_fleet.start_gateway reads it
    return routing_fleet.envoy_path()


def lwepp_binary(arg: Optional[str]) -> str:
    return arg or os.environ.get("WARMFLEET_LWEPP") or script_output("lwepp.sh")


EPP_MAIN, BOOTSTRAP = "warmfleet.server.router.epp.main", "warmfleet.server.router.epp.envoy_bootstrap"


def installed(module: str) -> bool:
    """Whether `module` is importable (`warmfleet epp` and its Envoy bootstrap generator: issue 24)."""
    import importlib.util

    return importlib.util.find_spec(module) is not None


# --- the Kubernetes side lwepp needs ------------------------------------------------------------------
class KubePool:
    """A kwok control plane with the InferencePool CRD, one pool and one Ready pod per replica (lwepp's view)."""

    def __init__(self) -> None:
        self.name = f"wf-gw-bench-{os.getpid()}"
        self.kubeconfig = ""
        self.kubectl = ""

    def __enter__(self) -> "KubePool":
        env = dict(os.environ, WARMFLEET_E2E_H200_NODES="0", WARMFLEET_E2E_L4_NODES="1")
        t0 = time.monotonic()
        out = subprocess.run([str(REPO / "e2e" / "cluster.sh"), "up", self.name], env=env, check=True,
                             capture_output=True, text=True)
        self.kubeconfig = out.stdout.strip().splitlines()[-1]
        toolchain = subprocess.run([str(REPO / "e2e" / "cluster.sh"), "bin"], check=True, capture_output=True,
                                   text=True).stdout.strip().splitlines()[-1]
        self.kubectl = str(Path(toolchain) / "kubectl")
        crd = Path(self.module_dir()) / "config" / "crd" / "bases" / "inference.networking.k8s.io_inferencepools.yaml"
        self.run("apply", "-f", str(crd))
        self.run("wait", "--for=condition=Established", "crd/inferencepools.inference.networking.k8s.io",
                 "--timeout=60s")
        progress(f"kwok control plane {self.name} with the InferencePool CRD up in {time.monotonic() - t0:.0f} s")
        return self

    def __exit__(self, *exc) -> None:
        subprocess.run([str(REPO / "e2e" / "cluster.sh"), "down", self.name], capture_output=True)

    @staticmethod
    def module_dir() -> str:
        out = subprocess.run(["go", "mod", "download", "-json", "sigs.k8s.io/gateway-api-inference-extension@v1.6.0"],
                             env=dict(os.environ, GOWORK="off", GOFLAGS="-mod=mod"), capture_output=True, text=True,
                             check=True, cwd=tempfile.gettempdir())
        return json.loads(out.stdout)["Dir"]

    def run(self, *args: str, stdin: Optional[str] = None) -> str:
        return subprocess.run([self.kubectl, "--kubeconfig", self.kubeconfig, *args], input=stdin, text=True,
                              check=True, capture_output=True).stdout

    def declare(self, ports: list[int], grpc_port: int) -> None:
        """The pool over `ports` (one pod per replica, all at 127.0.0.1) and its pods, Ready."""
        self.run("delete", "pods", "-n", NAMESPACE, "-l", f"app={POD_LABEL}", "--grace-period=0", "--force",
                 "--ignore-not-found")
        docs = [pool_manifest(ports, grpc_port)] + [pod_manifest(i, p) for i, p in enumerate(ports)]
        self.run("apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
        for i in range(len(ports)):  # nothing schedules them (schedulerName nobody serves): their status is ours
            self.run("patch", "pod", f"replica-{i}", "-n", NAMESPACE, "--subresource=status", "--type=merge",
                     "-p", json.dumps({"status": READY_STATUS}))


READY_STATUS = {"phase": "Running", "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}],
                "conditions": [{"type": "Ready", "status": "True"}]}


def pool_manifest(ports: list[int], grpc_port: int) -> dict:
    if not 1 <= len(ports) <= 8:
        raise ValueError(f"an InferencePool takes 1..8 targetPorts, got {len(ports)} replicas")
    return {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": POOL, "namespace": NAMESPACE},
            "spec": {"selector": {"matchLabels": {"app": POD_LABEL}},
                     "targetPorts": [{"number": p} for p in ports],
                     "endpointPickerRef": {"name": "lwepp", "port": {"number": grpc_port}}}}


def pod_manifest(i: int, port: int) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"replica-{i}", "namespace": NAMESPACE, "labels": {"app": POD_LABEL},
                         "annotations": {ACTIVE_PORTS: str(port)}},
            "spec": {"schedulerName": "warmfleet-bench-nobody", "containers": [{"name": "serve", "image": "none"}]}}


# --- fronts -----------------------------------------------------------------------------------------
def start_logged(cmd: list[str], cwd: str, name: str, env: Optional[dict] = None) -> subprocess.Popen:
    with (Path(cwd) / f"{name}.log").open("ab") as log:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)


BUFFER = "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer"


def http_filters(boot: dict) -> list[dict]:
    """The HTTP filter list of a bootstrap's first listener."""
    return boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]


def for_lwepp(boot: dict) -> dict:
    """`boot` changed so that lwepp v1.6.0 can answer (in place; returned).

    lwepp holds its headers answer until the body's end, then acks every body message with an empty body
    response. Envoy's BUFFERED body waits for that headers answer before sending the body (deadlock: 504 at
    message_timeout); FULL_DUPLEX_STREAMED forwards only the body the processor sends back (none: the model
    server gets an empty body); STREAMED with send_body_without_waiting_for_header_response works provided
    the body comes in one message, while Envoy's HTTP/1 codec ends a body with a separate empty chunk (lwepp
    acks the first before its headers answer: "Spurious response message", 500). So a buffer filter runs first
    and hands ext_proc the whole body with end_of_stream, and the response body is not sent to lwepp at all.
    """
    filters = http_filters(boot)
    ext_proc = next(f for f in filters if f["name"] == "envoy.filters.http.ext_proc")["typed_config"]
    ext_proc["processing_mode"].update(request_body_mode="STREAMED", response_body_mode="NONE",
                                       request_trailer_mode="SKIP", response_trailer_mode="SKIP")
    ext_proc["send_body_without_waiting_for_header_response"] = True
    filters.insert(0, {"name": "envoy.filters.http.buffer",
                       "typed_config": {"@type": BUFFER, "max_request_bytes": 16 * 2**20}})
    return boot


def for_gateway_proxy(boot: dict) -> None:
    """`boot` without the picker (in place): no ext_proc filter and no `epp` cluster, so Envoy forwards every
    request to the pool's endpoints by round robin (override-host's fallback): here the one router."""
    filters = http_filters(boot)
    filters[:] = [f for f in filters if f["name"] != "envoy.filters.http.ext_proc"]
    statics = boot["static_resources"]
    statics["clusters"] = [c for c in statics["clusters"] if c["name"] != "epp"]


def start_envoy(envoy: str, epp_port: int, endpoints: list[str], cwd: str) -> tuple[str, subprocess.Popen]:
    """lwepp's Envoy: the product generator's bootstrap (as routing_fleet.start_gateway builds it for `warmfleet epp`)
    with `for_lwepp`'s changes, the pool `endpoints`; Envoy started with the same flags as there."""
    from warmfleet.server.router.epp.envoy_bootstrap import GatewayConfig

    proc = Envoy(envoy, GatewayConfig(epp=f"127.0.0.1:{epp_port}", endpoints=endpoints), Path(cwd),
                 name=f"envoy-lwepp-{epp_port}", edit=for_lwepp).start()
    proc.wait_ready()
    return proc.url, proc.popen


def probe(base: str, fleet, want_replicas: int, timeout_s: float = 60) -> None:
    """Salted requests through the front until `want_replicas` replicas have answered (the EPP knows them);
    the salt is one no workload request uses, so nothing they cache can hit."""
    body = {"model": "bench", "messages": [{"role": "user", "content": "probe"}], "max_tokens": 1,
            "cache_salt": "bench-gateway-probe"}
    seen: set = set()
    last = "no answer"
    deadline = time.monotonic() + timeout_s
    while len(seen) < want_replicas:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{base}: only {sorted(seen)} of {want_replicas} replicas answered in {timeout_s} s; "
                               f"last: {last}")
        try:
            r = httpx.post(base + "/v1/chat/completions", json=body, timeout=10)
            last = f"HTTP {r.status_code} {r.text[:200]}"
            if r.status_code == 200:
                seen.add(r.headers.get("x-warmfleet-replica"))
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.05)


class Front:
    """One routing tier in front of a fleet: its base URL and the processes (by role) whose CPU it costs."""

    def __init__(self, base: str, procs: dict[str, subprocess.Popen]):
        self.base, self.procs = base, procs

    def cpu_s(self) -> Optional[dict[str, float]]:
        """CPU seconds so far per role (each process with its descendants); None for a front of no process."""
        return harness.cpu_seconds({role: p.pid for role, p in self.procs.items()}) if self.procs else None

    def stop(self) -> None:
        for p in self.procs.values():
            harness.stop(p)


def start_front(kind: str, fleet, cwd: str, tools: dict, kube: Optional[KubePool]) -> Front:
    if kind == "proxy":
        base, p = routing_fleet.start_router("warmfleet", fleet, cwd)
        return Front(base, {"router": p})
    if kind in routing_report.PEERS:
        base, p = routing_fleet.start_router(kind, fleet, cwd)
        return Front(base, {"router": p} if p is not None else {})
    if kind == "gateway-proxy":
        from warmfleet.server.router.epp.envoy_bootstrap import GatewayConfig

        router_base, p = routing_fleet.start_router("warmfleet", fleet, cwd)
        try:
            envoy = Envoy(tools["envoy"], GatewayConfig(endpoints=[router_base.removeprefix("http://")]), Path(cwd),
                          name=f"envoy-proxy-{free_port()}", edit=for_gateway_proxy).start()
            envoy.wait_ready()
        except BaseException:
            harness.stop(p)
            raise
        return Front(envoy.url, {"envoy": envoy.popen, "router": p})
    if kind == "epp":  # routing.py's front: `warmfleet epp` (route's flags) behind Envoy from the generator
        base, gw = routing_fleet.start_router("epp", fleet, cwd)
        front = Front(base, {"envoy": gw.envoy, "epp": gw.epp})
    elif kind == "lwepp":
        assert kube is not None
        grpc = free_port()
        kube.declare([int(u.rsplit(":", 1)[1]) for u, _, _ in fleet.replicas], grpc)
        cmd = [tools["lwepp"], "--pool-name", POOL, "--pool-namespace", NAMESPACE, "--grpc-port", str(grpc),
               "--grpc-health-port", str(free_port()), "--metrics-port", str(free_port()), "--secure-serving=false",
               "--health-checking", "--zap-log-level=error"]  # health: Envoy checks the ext_proc port (generator)
        picker = start_logged(cmd, cwd, f"lwepp-{grpc}", env=dict(os.environ, KUBECONFIG=kube.kubeconfig))
        try:
            base, envoy = start_envoy(tools["envoy"], grpc, [u.removeprefix("http://") for u, _, _ in fleet.replicas],
                                      cwd)
        except BaseException:
            harness.stop(picker)
            raise
        front = Front(base, {"envoy": envoy, "lwepp": picker})
    else:
        raise ValueError(f"unknown front {kind!r}")
    try:
        probe(base, fleet, len(fleet.replicas) if kind == "lwepp" else 1)
    except BaseException:
        front.stop()
        raise
    return front


# --- runs -------------------------------------------------------------------------------------------
def run(model: Path, fronts: list[str], n: int, gpu_blocks: int, rates: list[float], seeds: list[int], nreq: int,
        cwd: str, tools: dict, kube: Optional[KubePool], idle_s: float = 5.0) -> dict:
    """Every front on fresh replicas per (rate, seed), fronts interleaved; each front's idle CPU is measured
    for `idle_s` before its run, so `cpu_s_per_1000_requests_net_of_idle` is the marginal cost of requests."""
    traces = {seed: routing_workload.workload(seed, nreq) for seed in seeds}
    oracles = {seed: routing_workload.oracle_hits(model, traces[seed]) for seed in seeds}
    oracle = statistics.mean(sum(c for c, _ in o) / sum(t for _, t in o) for o in oracles.values())
    runs: dict = {k: [] for k in fronts}
    for rate in rates:
        for seed in seeds:
            for kind in fronts:
                t_start = time.monotonic()
                with routing_fleet.Fleet(model, n, gpu_blocks, cwd) as fleet:
                    fleet.warm_up(routing_workload.workload(10_000 + seed, 1)[0])
                    front = start_front(kind, fleet, cwd, tools, kube)
                    progress(f"{kind}: {n} replicas and the front up in {time.monotonic() - t_start:.0f} s")
                    try:
                        idle = front.cpu_s()
                        if idle is not None:  # the tier's own background work (health checks, metrics, events)
                            time.sleep(idle_s)
                            idle = total(front.cpu_s()) - total(idle)
                        cpu0, t0 = front.cpu_s(), time.monotonic()
                        rec = asyncio.run(routing_runners.drive([front.base] if front.base else
                                                        [u for u, _, _ in fleet.replicas], traces[seed], rate, seed))
                        cpu1, run_s = front.cpu_s(), time.monotonic() - t0
                        summ = routing_report.summarize(rec, n, oracles[seed])
                        summ.pop("reasons", None)
                        by_role = None if cpu0 is None else {k: round(cpu1[k] - cpu0[k], 3) for k in cpu0}
                        cpu = None if by_role is None else sum(by_role.values())
                        summ.update(cpu_s=None if cpu is None else round(cpu, 3),
                                    cpu_s_per_1000_requests=per_1000(cpu, len(rec)),
                                    idle_cpu_s_per_s=None if idle is None else round(idle / idle_s, 4),
                                    cpu_s_per_1000_requests_net_of_idle=per_1000(
                                        net_of_idle(cpu, idle, idle_s, run_s), len(rec)),
                                    rate=rate, seed=seed, cpu_s_by_process=by_role)
                        runs[kind].append(summ)
                        progress(f"{kind}: rate {rate}/s seed {seed} ({time.monotonic() - t0:.0f} s): {summ}")
                    finally:
                        front.stop()
    res = {k: summary(v) for k, v in runs.items() if v}
    return {"model": str(model), "block_size": routing_workload.BLOCK, "gpu_blocks_per_replica": gpu_blocks,
            "requests": nreq, "rates": rates, "seeds": seeds, "oracle_cached_ratio": round(oracle, 4),
            "fronts": res, "runs": runs, "targets": verdict(res)}


# --- the tier at a gateway's rates (--sim-rates) -------------------------------------------------------
class SimFleet:
    """bench/simfleet.py's replicas (zero time model) in routing_fleet.Fleet's shape, as start_front uses it."""

    engine, block = "warmfleet", routing_workload.BLOCK

    def __init__(self, model: Path, n: int, cwd: str):
        self.model, self.n, self.cwd = model, n, cwd
        self.replicas: list[tuple[str, str, None]] = []
        self.proc: Optional[subprocess.Popen] = None

    def route_flag(self, i: int) -> str:
        url, events, _ = self.replicas[i]
        return f"{url},events={events}"

    def __enter__(self) -> "SimFleet":
        ready = Path(self.cwd) / "sim.json"
        self.proc = start_logged([sys.executable, "-P", str(harness.BENCH / "simfleet.py"), "--model", str(self.model),
                                  "--replicas", str(self.n), "--block-size", str(self.block), "--time-model", "zero",
                                  "--gpu-blocks", "4096", "--ready-file", str(ready)], self.cwd, "simfleet")
        deadline = time.monotonic() + 60
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                harness.stop(self.proc)
                raise RuntimeError(f"simfleet did not come up; see {self.cwd}/simfleet.log")
            time.sleep(0.2)
        self.replicas = [(r["url"], r["events"], None) for r in json.loads(ready.read_text())["replicas"]]
        return self

    def __exit__(self, *exc) -> None:
        harness.stop(self.proc)


def sim_bodies(model: Path) -> list[bytes]:
    """router_throughput.py's chat bodies (shared system prompt, a conversation each), streamed with usage."""
    from warmfleet.server.tokenizer import Tokenizer

    words = harness.sibling("replay_workload").Words(Tokenizer(str(model)), routing_workload.BLOCK)
    out = []
    for b in harness.sibling("router_throughput").chat_bodies_for(words, 96, 4):
        body = dict(json.loads(b), max_tokens=4, stream=True, stream_options={"include_usage": True})
        out.append(json.dumps(body).encode())
    return out


def run_sim(model: Path, fronts: list[str], n: int, rates: list[float], rounds: int, duration_s: float, cwd: str,
            tools: dict, kube: Optional[KubePool], idle_s: float = 5.0, procs: int = 8) -> dict:
    """Every front once in front of one simulated fleet; per round and rate each front in turn (warm-up, then
    `duration_s` of hey); the round with the median tier CPU per request stands for (front, rate)."""
    run_hey = harness.sibling("router_throughput").run_hey
    bodies = sim_bodies(model)
    cores = ",".join(str(c) for c in range(os.cpu_count() or 1))
    runs: dict = {k: {str(r): [] for r in rates} for k in fronts}
    idle: dict = {}
    with SimFleet(model, n, cwd) as fleet:
        started: dict[str, Front] = {}
        try:
            for kind in fronts:
                started[kind] = start_front(kind, fleet, cwd, tools, kube)
            for kind, front in started.items():
                c0 = total(front.cpu_s())
                time.sleep(idle_s)
                idle[kind] = round((total(front.cpu_s()) - c0) / idle_s, 4)
            for rnd in range(rounds):
                for rate in rates:
                    for kind, front in started.items():
                        url = front.base + "/v1/chat/completions"
                        run_hey(url, bodies, rate, 1.5, cores, procs)  # warm: connections, memoised segments
                        c0 = front.cpu_s()
                        r = run_hey(url, bodies, rate, duration_s, cores, procs)
                        c1 = front.cpu_s()
                        k = max(1, r["requests"])
                        by = {role: round((c1[role] - c0[role]) / k * 1e3, 3) for role in c0}
                        r.update(round=rnd, cpu_ms_per_request=round(sum(by.values()), 3),
                                 cpu_ms_per_request_by_process=by)
                        runs[kind][str(rate)].append(r)
                        progress(f"sim {kind} @ {rate:g}/s round {rnd + 1}/{rounds}: {r}")
        finally:
            for front in started.values():
                front.stop()
    res = {}
    for kind, per_rate in runs.items():
        res[kind] = {"idle_cpu_s_per_s": idle.get(kind), "rates": {}}
        for rate, rs in per_rate.items():
            ranked = sorted(rs, key=lambda r: r["cpu_ms_per_request"])
            res[kind]["rates"][rate] = dict(ranked[(len(ranked) - 1) // 2],
                                            cpu_ms_per_request_rounds=[r["cpu_ms_per_request"] for r in rs])
    return {"model": str(model), "replicas": n, "rates": rates, "rounds": rounds, "duration_s": duration_s,
            "load": f"{procs} hey processes of one worker each (router_throughput.run_hey), streamed chat, "
                    "max_tokens 4", "fronts": res, "targets": sim_verdict(res)}


def sim_verdict(res: Mapping[str, Mapping]) -> dict:
    """The CPU target at each simulated rate: the EPP front below the proxy, and Envoy's share of it alone."""
    epp, proxy = res.get("epp"), res.get("proxy")
    if not epp or not proxy:
        return {}
    rates = [r for r in epp["rates"] if r in proxy["rates"]]
    tier = {r: round(epp["rates"][r]["cpu_ms_per_request"] / proxy["rates"][r]["cpu_ms_per_request"], 3)
            for r in rates}
    envoy = {r: round(epp["rates"][r]["cpu_ms_per_request_by_process"]["envoy"]
                      / proxy["rates"][r]["cpu_ms_per_request"], 3) for r in rates}
    return {"sim_epp_cpu_vs_proxy": tier, "sim_epp_cpu_below_proxy": all(v < 1 for v in tier.values()),
            "sim_envoy_alone_vs_proxy": envoy, "sim_envoy_alone_below_proxy": all(v < 1 for v in envoy.values())}


def sim_chart(results: dict, path: Path) -> None:
    """Tier CPU per request by process (stacked) and client latency p50/p99, per front and rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = results["sim"]["fronts"]
    rates = [str(r) for r in results["sim"]["rates"]]
    fig, ax = plt.subplots(1, 2, figsize=(13, 4))
    width = 0.8 / max(1, len(res))
    shades = {"router": COLORS["proxy"], "envoy": "#aaaaaa", "epp": COLORS["epp"], "lwepp": COLORS["lwepp"]}
    for j, (kind, fr) in enumerate(res.items()):
        xs = [i + j * width for i in range(len(rates))]
        bottom = [0.0] * len(rates)
        roles = list(next(iter(fr["rates"].values()))["cpu_ms_per_request_by_process"])
        for role in roles:
            vals = [fr["rates"][r]["cpu_ms_per_request_by_process"][role] for r in rates]
            ax[0].bar(xs, vals, width, bottom=bottom, color=shades.get(role), edgecolor="k", lw=0.5, label=role)
            bottom = [b + v for b, v in zip(bottom, vals)]
        for x, b in zip(xs, bottom):
            ax[0].text(x, b, kind, rotation=90, fontsize=7, ha="center", va="bottom")
        ax[1].plot(rates, [fr["rates"][r]["p50_ms"] for r in rates], marker="o", label=f"{kind} p50")
        ax[1].plot(rates, [fr["rates"][r]["p99_ms"] for r in rates], marker="x", ls="--", label=f"{kind} p99")
    ax[0].set_xticks([i + width * (len(res) - 1) / 2 for i in range(len(rates))], [f"{r}/s" for r in rates])
    handles, labels = ax[0].get_legend_handles_labels()
    seen = dict(zip(labels, handles))  # one entry per process role
    ax[0].legend(seen.values(), seen.keys(), fontsize=8)
    ax[0].set_title("routing-tier CPU ms per request, by process", fontsize=9)
    ax[1].set_title("client latency (ms), streamed chat, max_tokens 4", fontsize=9)
    ax[1].legend(fontsize=7)
    fig.suptitle(f"gateway tier in front of {results['sim']['replicas']} simulated replicas (zero time model)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary(runs: list[dict]) -> dict:
    """routing_report.mean_of over one front's runs, plus the mean CPU seconds per process role."""
    out = routing_report.mean_of([{k: v for k, v in r.items() if k != "cpu_s_by_process"} for r in runs])
    roles = [r["cpu_s_by_process"] for r in runs if r.get("cpu_s_by_process")]
    if roles:
        out["cpu_s_by_process"] = {k: round(statistics.mean(r[k] for r in roles), 3) for k in roles[0]}
    return out


def chart(results: dict, path: Path) -> None:
    """Cached-token ratio (oracle dashed), TTFT p50/p90, spread, routing-tier CPU per 1,000 requests."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = results["text"]["fronts"]
    names = list(res)
    c = [COLORS.get(n) or harness.router_colors([n])[0] for n in names]
    fig, ax = plt.subplots(1, 4, figsize=(17, 3.8))
    ax[0].bar(names, [res[n]["cached_ratio"] or 0 for n in names], color=c)
    ax[0].axhline(results["text"]["oracle_cached_ratio"], ls="--", color="k", lw=1, label="oracle")
    ax[0].set_title("cached-token ratio", fontsize=9)
    ax[0].legend(fontsize=8)
    harness.ttft_panel(ax[1], res, names, c, "TTFT to the first token (s)")
    harness.spread_panel(ax[2], res, names, c, "requests")
    ax[3].bar(names, [res[n].get("cpu_s_per_1000_requests") or 0 for n in names], color=c)
    ax[3].set_title("routing-tier CPU s per 1,000 requests (rr: none)", fontsize=9)
    fig.suptitle(f"warmfleet gateway bench: {results['replicas']} replicas, rates {results['rates']}/s, seeds "
                 f"{results['seeds']} (means over runs)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def usable_fronts(wanted: list[str], args: argparse.Namespace) -> tuple[list[str], dict, dict]:
    """The fronts that can run here, the tools they need, and why each other one is skipped."""
    fronts, skipped = harness.present_routers(wanted)
    tools: dict = {}
    if any(f in ENVOY_FRONTS for f in fronts):
        try:
            tools["envoy"] = envoy_binary(args.envoy)
        except (subprocess.CalledProcessError, OSError) as exc:
            skipped.update({f: f"no Envoy ({exc})" for f in fronts if f in ENVOY_FRONTS})
    if "epp" in fronts and "epp" not in skipped and not (installed(EPP_MAIN) and installed(BOOTSTRAP)):
        skipped["epp"] = "`warmfleet epp` or its Envoy bootstrap generator is not installed"
    if "lwepp" in fronts and "lwepp" not in skipped:
        try:
            tools["lwepp"] = lwepp_binary(args.lwepp)
        except (subprocess.CalledProcessError, OSError) as exc:
            skipped["lwepp"] = f"no lwepp ({exc})"
    if "lwepp" in fronts and "lwepp" not in skipped and not installed(BOOTSTRAP):
        skipped["lwepp"] = "the Envoy bootstrap generator (server/router/epp/envoy_bootstrap.py) is not installed"
    return [f for f in fronts if f not in skipped], tools, skipped


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="Tiny checkpoint, 2 replicas, 60 requests, one rate and seed.")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--fronts", default=",".join(FRONTS))
    ap.add_argument("--model", default=None)
    ap.add_argument("--replicas", type=int, default=None)
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--rates", default=None, help="Comma-separated arrival rates, requests/s (default 2,6; quick 4).")
    ap.add_argument("--seeds", default=None, help="Comma-separated seeds (default 0,1,2; quick 0).")
    ap.add_argument("--gpu-blocks", type=int, default=None, help="KV blocks per replica (default 160; quick 48).")
    ap.add_argument("--envoy", default=None, help="Envoy binary (default: $WARMFLEET_ENVOY or scripts/envoy-env.sh).")
    ap.add_argument("--lwepp", default=None, help="lwepp binary (default: $WARMFLEET_LWEPP or scripts/lwepp.sh).")
    ap.add_argument("--out", default="bench/results", help="Directory for gateway.json and gateway.png.")
    ap.add_argument("--logs", default=None, help="Keep replica, router, EPP and Envoy logs here.")
    ap.add_argument("--sim-rates", default=None,
                    help="Comma-separated rates: measure the tier's CPU against simulated replicas instead (see above).")
    ap.add_argument("--sim-rounds", type=int, default=3)
    ap.add_argument("--sim-duration", type=float, default=8.0, help="Seconds per measured run.")
    args = ap.parse_args()
    # SIGTERM unwinds like Ctrl-C: replicas, fronts and the kwok control plane are stopped on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    n = args.replicas or (2 if args.quick else 4)
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else ([0] if args.quick else [0, 1, 2])
    rates = [float(x) for x in args.rates.split(",")] if args.rates else ([4.0] if args.quick else [2.0, 6.0])
    nreq = args.requests or (60 if args.quick else 120)
    gpu_blocks = args.gpu_blocks or (48 if args.quick else 160)
    fronts, tools, skipped = usable_fronts(args.fronts.split(","), args)
    for f, why in skipped.items():
        progress(f"skipping front {f}: {why}")
    if args.logs:
        Path(args.logs).mkdir(parents=True, exist_ok=True)
    cwd = tempfile.mkdtemp(prefix="wf-gateway-", dir=args.logs)
    results: dict = {"command": " ".join([Path(sys.executable).name] + sys.argv), "replicas": n, "rates": rates,
                     "seeds": seeds, "load_average_1_5_15_min": {"before": os.getloadavg()}, "targets_text": TARGETS,
                     "skipped_fronts": skipped, "tools": tools,
                     "envoy_flags": "--disable-hot-restart (default --concurrency: one worker per core)",
                     "cpu_note": "routing tier = router process, or Envoy + EPP processes (descendants included); "
                                 "lwepp's kwok control plane is not counted"}
    model = routing_fleet.model_dir(args.model, args.quick)
    if args.sim_rates:
        return main_sim(args, fronts, n, model, cwd, tools, results)
    if "lwepp" in fronts:
        with KubePool() as kube:
            results["text"] = run(model, fronts, n, gpu_blocks, rates, seeds, nreq, cwd, tools, kube)
    else:
        results["text"] = run(model, fronts, n, gpu_blocks, rates, seeds, nreq, cwd, tools, None)
    results["load_average_1_5_15_min"]["after"] = os.getloadavg()  # the machine is shared: was it busy?
    results["targets"] = results["text"]["targets"]
    if not args.logs:
        shutil.rmtree(cwd, ignore_errors=True)
    harness.write_results(Path(args.out), "gateway", results, chart, progress)
    slim = dict(results, text={k: v for k, v in results["text"].items() if k != "runs"})
    if args.json:
        print(json.dumps(slim))
    else:
        for k, v in slim.items():
            print(f"{k}: {v}")
    return 0


def main_sim(args, fronts: list[str], n: int, model: Path, cwd: str, tools: dict, results: dict) -> int:
    """--sim-rates: the tier's CPU at a gateway's rates (gateway_sim.json and .png)."""
    fronts = [f for f in fronts if f not in routing_report.PEERS]  # rr has no tier; peers: router_throughput.py's business
    rates = [float(x) for x in args.sim_rates.split(",")]
    for k in ("rates", "seeds"):
        results.pop(k)
    if "lwepp" in fronts:
        with KubePool() as kube:
            results["sim"] = run_sim(model, fronts, n, rates, args.sim_rounds, args.sim_duration, cwd, tools, kube)
    else:
        results["sim"] = run_sim(model, fronts, n, rates, args.sim_rounds, args.sim_duration, cwd, tools, None)
    results["load_average_1_5_15_min"]["after"] = os.getloadavg()
    results["targets"] = results["sim"]["targets"]
    if not args.logs:
        shutil.rmtree(cwd, ignore_errors=True)
    harness.write_results(Path(args.out), "gateway_sim", results, sim_chart, progress)
    print(json.dumps(results) if args.json else json.dumps(results["targets"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
