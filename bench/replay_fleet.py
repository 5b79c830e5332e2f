"""bench/trace_replay.py's processes: the simulated fleet and the routers in front of it (one, or K active-active), started and waited for."""

from __future__ import annotations

import argparse
import functools
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

from warmfleet.localprocs import free_port

sys.path.append(str(Path(__file__).resolve().parent))  # bench/harness.py, after the stdlib
import harness  # noqa: E402

replay_workload = harness.sibling("replay_workload")


EXE = harness.EXE
# One simulator process hosts every replica, so one host stall (seen here at load average 10-14 on 2 cores) times
# out the health checks of the whole fleet at once and the router's defaults (0.5 s, 2 in a row) take every replica
# out: 503s and a wrecked run that measure the machine, not routing. The same stall makes the replicas' accept
# queues overflow and requests' connects time out (1 s default), which also takes a replica out and purges its
# index. The peers' checks are far slower to give up.
WARMFLEET_HEALTH = ["--health-timeout-s", "2", "--health-failures", "4", "--connect-timeout-s", "5"]
PEERS = ("rr", "sglang", "vllm")


# --- processes --------------------------------------------------------------------------------
def slow_pool(spec: str) -> tuple[float, float]:
    """--slow-pool FRAC:F (argparse type)."""
    try:
        frac, factor = (float(x) for x in spec.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"want FRAC:F, e.g. 0.5:3, got {spec!r}")
    if not 0 <= frac <= 1 or factor <= 0:
        raise argparse.ArgumentTypeError("FRAC must be in [0, 1] and F > 0")
    return frac, factor


def start_sim(model: Path, n: int, args, cwd: str, time_model: str) -> tuple[subprocess.Popen, dict]:
    flags = ["--replicas", str(n), "--block-size", str(args.block_size), "--gpu-blocks", str(args.gpu_blocks),
             "--cpu-blocks", str(args.cpu_blocks), "--time-model", time_model,
             "--engine-speedup", str(args.engine_speedup)]
    if getattr(args, "node_tier_blocks", 0):  # one shared host tier per node of K replicas
        flags += ["--replicas-per-node", str(args.replicas_per_node), "--node-tier-blocks", str(args.node_tier_blocks)]
        if getattr(args, "node_tier_lru", False):
            flags.append("--node-tier-lru")
    if getattr(args, "slow_pool", None):  # other benches start the fleet with their own flags
        frac, factor = args.slow_pool
        flags += ["--slow-replicas", f"{round(frac * n)}:{factor}"]
    return harness.start_simfleet(model, cwd, flags)


def router_command(kind: str, model: Path, sim: dict, port: int, block: int, extra: list[str] = ()) -> tuple[list, dict]:
    """Router `kind` in front of the simulated fleet `sim`: warmfleet with WARMFLEET_HEALTH, a peer `cache_aware`."""
    if kind.startswith("warmfleet"):
        replicas = [f"{r['url']},events={r['events']}" for r in sim["replicas"]]
        nodes = [x for t in sim.get("node_tiers", []) if t.get("events")  # the node tiers' own events (issue 41)
                 for x in ("--node-tier-events", t["events"].removeprefix("tcp://"))]
        return (harness.route_command(model, port, block, replicas, [*WARMFLEET_HEALTH, *nodes, *extra]),
                dict(os.environ))
    cmd = harness.peer_command(kind, [r["url"] for r in sim["replicas"]], port, listen_port(),
                               ["--policy", "cache_aware"], extra)
    return cmd, dict(os.environ, VLLM_ROUTER_TOKENIZER=str(model)) if kind == "vllm" else dict(os.environ)


def listen_port() -> int:
    """A free loopback port for a router to listen on, below the kernel's ephemeral range when there is room.

    `free_port` hands out a port of the ephemeral range and releases it; vllm-router binds its port only after
    checking every worker, i.e. after opening one outgoing connection per replica (64 at 64 replicas), and any
    outgoing connection on the host (the bench's own, other processes') may take that port in the meantime. A
    taken port (its --port or its --prometheus-port) makes vllm-router exit with 1 and sglang-router panic.
    Ports below the ephemeral range are never given to outgoing connections."""
    try:
        lo = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return free_port()
    if lo - 10_000 < 1024:
        return free_port()
    for _ in range(200):
        port = random.randrange(lo - 10_000, lo)
        if port in _LISTEN_PORTS:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _LISTEN_PORTS.add(port)
        return port
    return free_port()


_LISTEN_PORTS: set[int] = set()


def start_router(kind: str, model: Path, sim: dict, block: int, cwd: str, extra: list[str] = (),
                 taskset: str | None = None, port: int | None = None, attempts: int = 3) -> tuple[str, subprocess.Popen]:
    """Start one router in front of `sim` and wait until it is in sync and forwards; a router that exits during
    start-up is started again (fresh ports unless `port` is fixed) up to `attempts` times."""
    from warmfleet.livefleet import ProcessExited

    synced = functools.partial(harness.in_sync, count=len(sim["replicas"])) if kind.startswith("warmfleet") else None
    for attempt in range(1, attempts + 1):
        listen = port or listen_port()
        cmd, env = router_command(kind, model, sim, listen, block, extra)
        try:
            # one request shorter than a block (caches nothing) proves the router forwards
            return harness.start_router(kind, cmd, listen, cwd, env=env, taskset=taskset, synced=synced,
                                        probe={"model": "bench", "prompt": " hello", "max_tokens": 1})
        except ProcessExited as exc:
            replay_workload.progress(f"router {kind} exited during start-up (attempt {attempt} of {attempts}): {exc}")
            if attempt == attempts:
                raise
    raise AssertionError("unreachable")


def parse_kind(kind: str) -> tuple[str, int, bool]:
    """'warmfleet[:VARIANT]@K[-nopeers]' -> (router kind, K router processes, share load with --peers)."""
    base, _, many = kind.partition("@")
    if not many:
        return kind, 1, False
    count, _, flag = many.partition("-")
    if not base.startswith("warmfleet") or not count.isdigit() or int(count) < 1 or flag not in ("", "nopeers"):
        raise ValueError(f"router {kind!r}: active-active is warmfleet[:VARIANT]@K or warmfleet[:VARIANT]@K-nopeers")
    return base, int(count), flag != "nopeers"


def start_routers(kind: str, model: Path, sim: dict, args, cwd: str, extra: list[str]) -> tuple[list, list]:
    """One router process, or K active-active ones (each given every router's URL with --peers unless -nopeers)."""
    base_kind, count, peers = parse_kind(kind)
    if count == 1:
        base, proc = start_router(base_kind, model, sim, args.block_size, cwd, extra)
        return [base], [proc]
    ports = [listen_port() for _ in range(count)]
    flags = ["--peers", ",".join(f"http://127.0.0.1:{p}" for p in ports)] if peers else []
    bases, procs = [], []
    try:
        for port in ports:
            base, proc = start_router(base_kind, model, sim, args.block_size, cwd, [*extra, *flags], port=port)
            bases.append(base)
            procs.append(proc)
    except BaseException:
        for p in procs:
            harness.stop(p)
        raise
    return bases, procs
