"""bench/gateway.py's fronts: the routing tiers it compares, the tools they need, lwepp's kwok pool, the simulated fleet."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import httpx

sys.path.append(str(Path(__file__).resolve().parent))  # bench/harness.py, after the stdlib
import harness  # noqa: E402
from warmfleet.livefleet import Envoy  # noqa: E402
from warmfleet.localprocs import free_port  # noqa: E402

routing_fleet = harness.sibling("routing_fleet")
routing_report = harness.sibling("routing_report")
routing_workload = harness.sibling("routing_workload")
progress = harness.reporter("gateway")

REPO = harness.BENCH.parent
EPP_FRONTS = ("epp", "lwepp")  # pickers behind Envoy
ENVOY_FRONTS = (*EPP_FRONTS, "gateway-proxy")  # fronts that need the Envoy binary
FRONTS = ("proxy", *EPP_FRONTS, "gateway-proxy", *routing_report.PEERS)
POOL, NAMESPACE, POD_LABEL = "bench", "default", "warmfleet-bench-replica"
ACTIVE_PORTS = "inference.networking.k8s.io/active-ports"


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
               "--grpc-health-port", str(free_port()), "--metrics-port", str(free_port()),
               "--health-checking", "--zap-log-level=error"]  # health: Envoy checks the ext_proc port (generator)
        # TLS (lwepp's --secure-serving default, self-signed) as `warmfleet epp` serves it: the generator's bootstrap
        # speaks TLS to both pickers, so their CPU is compared as each ships
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
        self.proc, desc = harness.start_simfleet(self.model, self.cwd, ["--replicas", str(self.n), "--block-size",
                                                                     str(self.block), "--time-model", "zero",
                                                                     "--gpu-blocks", "4096"], timeout_s=60)
        self.replicas = [(r["url"], r["events"], None) for r in desc["replicas"]]
        return self

    def __exit__(self, *exc) -> None:
        harness.stop(self.proc)

