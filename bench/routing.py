"""Routing benchmark: the same seeded workload through round-robin, SGLang's and vllm-router's cache_aware, and warmfleet.

    python bench/routing.py [--quick] [--json] [--routers rr,sglang,vllm,warmfleet] [--model DIR]

Starts N real `warmfleet serve` replicas on loopback (KV pools small enough that the working
set does not fit one replica), fresh for every router so each starts cold, and drives an
open-loop workload: tenants with Zipf-popular system prompts, multi-turn conversations with
growing history, and one hot prefix taking half the traffic. Reports per router the fleet
cached-token ratio (from `usage`), TTFT p50/p90, request spread (max/mean per replica),
errors, and for warmfleet the router-added latency against direct requests and a churn run
(one replica killed mid-run and restarted cold). The oracle is the cached-token ratio of an
unbounded cache that saw every earlier request. Needs `pip install sglang-router vllm-router`.
Progress goes to stderr; with --json the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

BLOCK = 16
EXE = [sys.executable, "-P", "-m", "warmfleet.cli"]


def progress(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_dir(arg: str | None, quick: bool) -> Path:
    if arg:
        return Path(arg)
    from warmfleet.server.models.tiny import make_tiny_model

    size = "tiny" if quick else "bench"
    out = Path(os.environ.get("WARMFLEET_CACHE", Path.home() / ".cache" / "warmfleet")) / "models" / f"{size}-qwen2"
    if not (out / "config.json").exists():
        progress(f"writing the {size} checkpoint to {out}")
        make_tiny_model(out, arch="qwen2", size=size, seed=0)
    return out


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


def oracle_ratio(model: Path, trace: list[list[dict]]) -> float:
    """Cached tokens with one unbounded cache that saw every earlier request (contract-1 hashes)."""
    from warmfleet.server.hashing import block_hashes, model_fingerprint
    from warmfleet.server.router.policy import cacheable_tokens
    from warmfleet.server.router.prompt import PromptRenderer

    r, fp = PromptRenderer(str(model)), model_fingerprint(model)
    seen: set = set()
    cached = total = 0
    for msgs in trace:
        ids = r.chat({"messages": msgs}).token_ids
        hs = block_hashes(ids, [], BLOCK, fp)
        hit = next((i for i, h in enumerate(hs) if h not in seen), len(hs))
        cached += min(hit * BLOCK, cacheable_tokens(len(ids), BLOCK))
        total += len(ids)
        seen.update(hs)
    return cached / total


# --- processes ------------------------------------------------------------------------------
class Fleet:
    def __init__(self, model: Path, n: int, gpu_blocks: int, cwd: str):
        self.model, self.n, self.gpu_blocks, self.cwd = model, n, gpu_blocks, cwd
        self.replicas: list[tuple[str, str, subprocess.Popen]] = []

    def start_replica(self, i: int, port: int | None = None, eport: int | None = None) -> tuple:
        port, eport = port or free_port(), eport or free_port()
        p = subprocess.Popen(EXE + ["serve", "--model", str(self.model), "--served-model-name", "bench",
                                    "--port", str(port), "--kv-events-port", str(eport), "--replica-id", f"b{i}",
                                    "--block-size", str(BLOCK), "--num-gpu-blocks", str(self.gpu_blocks),
                                    "--log-level", "warning"], cwd=self.cwd, stdout=subprocess.DEVNULL)
        return f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{eport}", p

    def __enter__(self) -> "Fleet":
        self.replicas = [self.start_replica(i) for i in range(self.n)]
        for url, _, p in self.replicas:
            wait_http(url + "/ready", p)
        return self

    def __exit__(self, *exc) -> None:
        for _, _, p in self.replicas:
            stop(p)


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process for {url} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready after {timeout_s}s")


def stop(p: subprocess.Popen) -> None:
    p.terminate()
    try:
        p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()


def tool(name: str) -> str:
    """A console script of this venv (found next to the interpreter even when the venv is not on PATH)."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    found = shutil.which(name, path=path)
    if found is None:
        raise FileNotFoundError(f"{name} not found: pip install sglang-router vllm-router")
    return found


def start_router(kind: str, fleet: Fleet, cwd: str) -> tuple[str, subprocess.Popen | None]:
    if kind == "rr":
        return "", None
    port = free_port()
    urls = [u for u, _, _ in fleet.replicas]
    if kind == "warmfleet":
        args = EXE + ["route", "--model", str(fleet.model), "--port", str(port), "--block-size", str(BLOCK),
                      "--log-level", "warning"]
        for u, e, _ in fleet.replicas:
            args += ["--replica", f"{u},events={e}"]
    elif kind == "sglang":
        args = [tool("sglang-router"), "launch", "--worker-urls", *urls,
                "--policy", "cache_aware", "--host", "127.0.0.1", "--port", str(port)]
    elif kind == "vllm":
        args = [tool("vllm-router"), "--worker-urls", *urls, "--policy", "cache_aware",
                "--host", "127.0.0.1", "--port", str(port)]
    else:
        raise ValueError(f"unknown router {kind!r}")
    p = subprocess.Popen(args, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_http(f"http://127.0.0.1:{port}/health", p, 60)
    return f"http://127.0.0.1:{port}", p


# --- driving --------------------------------------------------------------------------------
async def one(client: httpx.AsyncClient, base: str, msgs: list[dict], rec: list) -> None:
    t0 = time.perf_counter()
    body = {"model": "bench", "messages": msgs, "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    ttft, cached, prompt, replica, err = None, 0, 0, None, None
    try:
        async with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
            replica = r.headers.get("x-warmfleet-replica")
            if r.status_code != 200:
                err = f"HTTP {r.status_code}"
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    err = "stream error"
                if ttft is None and ev.get("choices"):
                    ttft = time.perf_counter() - t0
                if ev.get("usage"):
                    prompt = ev["usage"]["prompt_tokens"]
                    cached = (ev["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    except httpx.HTTPError as exc:
        err = type(exc).__name__
    rec.append({"t": t0, "ttft": ttft, "cached": cached, "prompt": prompt, "replica": replica, "error": err})


async def drive(bases: list[str], trace: list, rate: float, seed: int, on_tick=None) -> list[dict]:
    """Open-loop Poisson arrivals; `bases` cycle per request (one base = a router, several = round-robin)."""
    rng = random.Random(seed)
    rec: list[dict] = []
    cycle = itertools.cycle(bases)
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=None)) as client:
        tasks = []
        for i, msgs in enumerate(trace):
            tasks.append(asyncio.create_task(one(client, next(cycle), msgs, rec)))
            if on_tick:
                await on_tick(i)
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    return rec


def summarize(rec: list[dict]) -> dict:
    ok = [r for r in rec if not r["error"]]
    ttfts = sorted(r["ttft"] for r in ok if r["ttft"] is not None)
    per = {}
    for r in ok:
        if r["replica"]:
            per[r["replica"]] = per.get(r["replica"], 0) + 1

    def q(p):
        return round(ttfts[min(len(ttfts) - 1, int(p * len(ttfts)))], 4) if ttfts else None

    prompt = sum(r["prompt"] for r in ok)
    return {"cached_ratio": round(sum(r["cached"] for r in ok) / prompt, 4) if prompt else None,
            "ttft_p50_s": q(0.5), "ttft_p90_s": q(0.9), "errors": len(rec) - len(ok),
            "spread": round(max(per.values()) / statistics.mean(per.values()), 3) if per else None}


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
    d.sort()
    r.sort()
    return {"added_p50_ms": round((r[n // 2] - d[n // 2]) * 1e3, 3),
            "added_p99_ms": round((r[int(n * 0.99)] - d[int(n * 0.99)]) * 1e3, 3)}


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
    victim_url, victim_events, victim_proc = fleet.replicas[0]
    state: dict = {}

    async def tick(i: int) -> None:
        if i == len(trace) // 3:
            victim_proc.kill()
            state["killed"] = time.perf_counter()
            state["watch"] = asyncio.create_task(unrouted_after(router, victim_url, state["killed"]))
        if i == 2 * len(trace) // 3:
            port, eport = int(victim_url.rsplit(":", 1)[1]), int(victim_events.rsplit(":", 1)[1])
            fleet.replicas[0] = fleet.start_replica(0, port, eport)

    rec = await drive([router], trace, rate, 7, tick)
    killed = state["killed"]
    to_victim = [r["t"] for r in rec if r["replica"] == "b0" and r["t"] >= killed and not r["error"]]
    return {"client_errors": sum(1 for r in rec if r["error"]),
            "s_until_dead_replica_unrouted": await state["watch"],
            "requests_to_victim_after_kill": len(to_victim)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="Tiny checkpoint, 2 replicas, one rate, one seed.")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--model", default=None)
    ap.add_argument("--routers", default="rr,sglang,vllm,warmfleet")
    ap.add_argument("--replicas", type=int, default=None)
    args = ap.parse_args()
    model = model_dir(args.model, args.quick)
    n = args.replicas or (2 if args.quick else 4)
    seeds, rates, nreq = ([0], [4.0], 60) if args.quick else ([0, 1, 2], [2.0, 6.0], 300)
    gpu_blocks = 48 if args.quick else 160  # the working set does not fit one replica
    cwd = tempfile.mkdtemp(prefix="wf-bench-")
    results: dict = {"replicas": n, "requests": nreq, "rates": rates, "seeds": seeds, "routers": {}}
    results["oracle_cached_ratio"] = round(statistics.mean(oracle_ratio(model, workload(s, nreq)) for s in seeds), 4)
    for kind in args.routers.split(","):
        runs = []
        for rate in rates:
            for seed in seeds:
                with Fleet(model, n, gpu_blocks, cwd) as fleet:
                    base, proc = start_router(kind, fleet, cwd)
                    try:
                        bases = [base] if base else [u for u, _, _ in fleet.replicas]
                        progress(f"{kind}: rate {rate}/s seed {seed}")
                        runs.append(summarize(asyncio.run(drive(bases, workload(seed, nreq), rate, seed))))
                        if kind == "warmfleet" and rate == rates[0] and seed == seeds[0]:
                            results["warmfleet_latency"] = asyncio.run(
                                added_latency(base, fleet.replicas[0][0], 50 if args.quick else 200))
                            results["warmfleet_churn"] = asyncio.run(
                                churn(fleet, base, workload(seed + 100, nreq), rate, cwd))
                    finally:
                        if proc is not None:
                            stop(proc)
        keys = runs[0].keys()
        results["routers"][kind] = {k: (round(statistics.mean(r[k] for r in runs if r[k] is not None), 4)
                                        if any(r[k] is not None for r in runs) else None) for k in keys}
        progress(f"{kind}: {results['routers'][kind]}")
    shutil.rmtree(cwd, ignore_errors=True)
    if args.json:
        print(json.dumps(results))
    else:
        for k, v in results.items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
