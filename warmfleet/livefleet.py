"""Real `warmfleet serve` / `route` / `epp` processes (and an Envoy in front of an EPP) on loopback, for the demo, tests
and benches: start, wait, kill, restart.

Every process runs with `python -P` and a cwd outside the repo (the repo's warmfleet/ folder is only
part of the package) and logs to a file there, which a failing wait quotes.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import httpx

from warmfleet.localprocs import free_port

EXE = [sys.executable, "-P", "-m", "warmfleet.cli"]
MODEL_NAME = "tiny"
BLOCK = 16
STARTUP_S = 180.0  # a replica's start (paddle import, tiny checkpoint) on a shared 2-core host


def tree_pids(pid: int) -> list[int]:
    """`pid` and its live descendants (a replica may run helper processes)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


def memory_mib(pid: int) -> dict:
    """Process tree of `pid`: {"pid:role": {"rss": MiB, "peak": MiB (VmHWM)}} (roles: api, engine-core, processor-cache)."""
    out = {}
    for p in tree_pids(pid):
        try:
            status = dict(line.split(":", 1) for line in open(f"/proc/{p}/status").read().splitlines() if ":" in line)
            cmd = open(f"/proc/{p}/cmdline", "rb").read()
        except OSError:
            continue
        role = ("engine-core" if b"core_proc" in cmd else "processor-cache" if b"processor_cache" in cmd
                else "api" if p == pid else "other")
        out[role] = {"rss": int(status["VmRSS"].split()[0]) // 1024, "peak": int(status["VmHWM"].split()[0]) // 1024}
    return out


@dataclass
class Proc:
    """One process (`warmfleet` + args unless `exe` says which program); `start()` again after `kill()` restarts it
    with the same arguments (same ports)."""

    name: str
    args: list[str]
    cwd: Path
    env: Optional[dict] = None
    console: bool = False  # log to this process's console instead of the file
    popen: Optional[subprocess.Popen] = None
    starts: int = 0
    exe: Optional[list[str]] = None  # the program (and a prefix such as taskset) before args; None: warmfleet

    @property
    def log_path(self) -> Path:
        return self.cwd / f"{self.name}.log"

    def start(self) -> "Proc":
        assert not self.alive(), f"{self.name} is already running"
        self.starts += 1
        cmd = (self.exe or EXE) + self.args
        if self.console:
            self.popen = subprocess.Popen(cmd, cwd=self.cwd, env=self.env, start_new_session=True)
            return self
        with open(self.log_path, "ab") as log:
            log.write(f"--- start {self.starts} ---\n".encode())
            log.flush()
            # a session of its own: a kill reaches its helper processes, never the caller's
            self.popen = subprocess.Popen(cmd, cwd=self.cwd, env=self.env, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def kill(self) -> float:
        """SIGKILL the process group (the process and all it started), then reap; returns the kill's monotonic time."""
        if self.popen is None:
            return time.monotonic()
        pids = tree_pids(self.popen.pid)  # children too, even one that left the process group
        t_kill = time.monotonic()
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.popen.wait(timeout=30)
        return t_kill

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`."""
        if not self.alive():
            return
        try:
            os.killpg(self.popen.pid, signal.SIGTERM)
            self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
        except ProcessLookupError:
            pass

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


class Replica(Proc):
    def __init__(self, name: str, model: Path, cwd: Path, extra: tuple[str, ...] = ()):
        self.port, self.events_port = free_port(), free_port()
        super().__init__(name, ["serve", "--model", str(model), "--served-model-name", MODEL_NAME,
                                "--port", str(self.port), "--kv-events-port", str(self.events_port),
                                "--replica-id", name, "--block-size", str(BLOCK), "--log-level", "warning",
                                *extra], cwd)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"

    def wait_ready(self, timeout_s: float = STARTUP_S) -> None:
        wait_http(self.url + "/ready", f"{self.name} ready", [self], timeout_s)


class NodeTier(Proc):
    """`warmfleet node-tier` on loopback: the replicas' --node-tier address and the router's --node-tier-events."""

    def __init__(self, cwd: Path, node_name: str = "node-a", capacity_bytes: int = 256 << 20,
                 extra: tuple[str, ...] = ()):
        self.port, self.events_port, self.node_name = free_port(), free_port(), node_name
        super().__init__(f"node-tier-{node_name}", ["node-tier", "--capacity-bytes", str(capacity_bytes), "--host",
                                                    "127.0.0.1", "--port", str(self.port), "--events-port",
                                                    str(self.events_port), "--node-name", node_name,
                                                    "--log-level", "warning", *extra], cwd)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def events(self) -> str:
        return f"127.0.0.1:{self.events_port}"

    def replica_args(self) -> tuple[str, ...]:
        return ("--node-tier", self.address, "--node-name", self.node_name)

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        import socket

        def up() -> bool:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return True
            except OSError:
                return False

        wait_for(up, f"{self.name} listening", [self], timeout_s)


class Router(Proc):
    """`warmfleet route` in front of real replicas (their KV events included); `url` serves the status routes."""

    name, command = "router", "route"

    def __init__(self, model: Path, replicas: list[Replica], cwd: Path, extra: tuple[str, ...] = ()):
        self.port = free_port()
        args = [self.command, "--model", str(model), *self.port_flags(), "--block-size", str(BLOCK),
                "--log-level", "warning", *extra]
        for r in replicas:
            args += ["--replica", f"{r.url},events={r.events}"]
        super().__init__(self.name, args, cwd)

    def port_flags(self) -> list[str]:
        return ["--port", str(self.port)]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def view(self) -> dict:
        """GET /v1/router/replicas: {"replicas": [...], "index_blocks": N, ...}."""
        return httpx.get(self.url + "/v1/router/replicas", timeout=5).json()

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=5).text

    def wait_synced(self, timeout_s: float = 60.0) -> None:
        wait_for(lambda: all(r["healthy"] and r["synced"] for r in self.view()["replicas"]),
                 "router healthy and synced with every replica", [self], timeout_s)


class Epp(Router):
    """`warmfleet epp` with the same flags: ext_proc gRPC on `address`, the status routes on `url` (--http-port)."""

    name, command = "epp", "epp"

    def port_flags(self) -> list[str]:
        self.grpc_port = free_port()
        return ["--port", str(self.grpc_port), "--http-port", str(self.port)]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"


class Envoy(Proc):
    """A real Envoy on the bootstrap `warmfleet envoy-bootstrap` builds (server/router/epp/envoy_bootstrap.py) from
    `cfg` on loopback ports of its own, `edit`ed in place if given: the gateway on `url`, the admin on `admin_port`."""

    def __init__(self, binary: str, cfg, cwd: Path, name: str = "envoy", edit: Optional[Callable[[dict], None]] = None,
                 pin: tuple[str, ...] = ()):
        from warmfleet.server.router.epp.envoy_bootstrap import bootstrap

        self.port, self.admin_port = free_port(), free_port()
        self.cfg = replace(cfg, listen_host="127.0.0.1", listen_port=self.port, admin_port=self.admin_port)
        boot = bootstrap(self.cfg)
        if edit is not None:
            edit(boot)
        self.config_path = Path(cwd) / f"{name}.json"
        self.config_path.write_text(json.dumps(boot, indent=2))
        # --disable-hot-restart: no shared-memory base id to collide with other Envoys on the host
        super().__init__(name, ["-c", str(self.config_path), "--disable-hot-restart", "--log-level", "warning"],
                         Path(cwd), exe=[*pin, binary])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 60.0, others: tuple = ()) -> None:
        wait_http(f"http://127.0.0.1:{self.admin_port}/ready", f"{self.name} ready", [self, *others], timeout_s)


class ProcessExited(RuntimeError):
    """A process ended while something waited for it."""


def wait_for(pred: Callable[[], bool], what: str, procs: list, timeout_s: float = 120.0, poll_s: float = 0.05) -> float:
    """Poll `pred` until true (an HTTP error, a bad answer or a missing key counts as not yet); returns the seconds
    it took. ProcessExited as soon as one of `procs` (Proc objects or plain Popen) exits, TimeoutError after
    `timeout_s`; both quote the logs of the Procs."""
    t0 = time.monotonic()
    while True:
        for p in procs:
            popen = getattr(p, "popen", p)
            if popen is not None and popen.poll() is not None:
                tail = f":\n{p.log_tail()}" if hasattr(p, "log_tail") else ""
                raise ProcessExited(f"{getattr(p, 'name', 'a process')} exited with {popen.returncode} "
                                    f"while waiting for {what}{tail}")
        try:
            if pred():
                return time.monotonic() - t0
        except (httpx.HTTPError, ValueError, LookupError, StopIteration):
            pass
        if time.monotonic() - t0 > timeout_s:
            tails = "\n".join(f"[{p.name}]\n{p.log_tail(15)}" for p in procs if hasattr(p, "log_tail"))
            raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}\n{tails}")
        time.sleep(poll_s)



def wait_http(url: str, what: str, procs: list, timeout_s: float = 120.0, poll_s: float = 0.05) -> float:
    """`wait_for` GET `url` to answer 200."""
    return wait_for(lambda: httpx.get(url, timeout=2).status_code == 200, what, procs, timeout_s, poll_s)

def metric(text: str, name: str, **labels: str) -> Optional[float]:
    """Sum of the Prometheus series `name` whose labels include `labels` (None if no such series)."""
    found = None
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        series, _, rest = head.partition("{")
        if series != name or not all(f'{k}="{v}"' in rest for k, v in labels.items()):
            continue
        found = (found or 0.0) + float(value)
    return found


class LiveFleet:
    """Two replicas and one router; `close()` stops whatever is still running."""

    def __init__(self, model: Path, cwd: Path, n: int = 2, replica_args: tuple[str, ...] = (),
                 router_args: tuple[str, ...] = ()):
        self.replicas = [Replica(f"r{i}", model, cwd, replica_args) for i in range(n)]
        self.router = Router(model, self.replicas, cwd, router_args)

    def start(self) -> "LiveFleet":
        try:
            for r in self.replicas:
                r.start()
            for r in self.replicas:
                r.wait_ready()
            self.router.start()
            self.router.wait_synced()
        except BaseException:
            self.close()
            raise
        return self

    def by_id(self, replica_id: str) -> Replica:
        return next(r for r in self.replicas if r.name == replica_id)

    def restore(self) -> None:
        """Restart any process a test left dead and wait until the router routes to every replica again."""
        for r in self.replicas:
            if not r.alive():
                r.start()
        for r in self.replicas:
            r.wait_ready()
        if not self.router.alive():
            self.router.start()
        self.router.wait_synced()

    def close(self) -> None:
        for p in [self.router, *self.replicas]:
            p.stop()


class _QuietFiles(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # no access log on the caller's stderr
        pass


class MediaServer:
    """A plain HTTP server on loopback serving the files of `root` (images for http(s) image parts); a context manager.

    Replicas fetch from it only if started with `--allowed-media-host 127.0.0.1` (their SSRF rules
    refuse loopback otherwise)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                                      functools.partial(_QuietFiles, directory=str(self.root)))
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def put(self, name: str, data: bytes) -> str:
        """Serve `data` as `name` (replacing what was there); returns its URL."""
        (self.root / name).write_bytes(data)
        return f"{self.url}/{name}"

    def __enter__(self) -> "MediaServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
