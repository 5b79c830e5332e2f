"""Routing benchmark: the same seeded workload through round-robin, SGLang's and vllm-router's cache_aware, and warmfleet.

    python bench/routing.py [--quick] [--json] [--routers rr,sglang,vllm,warmfleet] [--model DIR]
                            [--variant NAME=FLAGS (router warmfleet:NAME)]
                            [--requests N] [--rates 2,6] [--seeds 0,1,2] [--no-images] [--no-warm-up] [--out DIR]

Starts N real `warmfleet serve` replicas on loopback (KV pools small enough that the working
set does not fit one replica), fresh for every run so each router starts with empty caches
(each replica first serves one warm-up request under its own salt; --no-warm-up skips it), and drives an
open-loop workload: tenants with Zipf-popular system prompts, multi-turn conversations with
growing history, and one hot prefix taking half the traffic. A second workload on the VL
checkpoint sends requests that share images but not text (skipped with --no-images, or when
the replicas do not accept images). Runs are interleaved per (rate, seed): every router sees
the same machine load, so ratios between routers are measured side by side.

Reports per router the fleet cached-token ratio (from `usage`), TTFT p50/p90 (to the first
token), request spread (max/mean per replica), errors, and for warmfleet the router-added latency against direct
requests, decision reasons with the tokens each reason lost against the oracle, and a churn
run (one replica killed mid-run and restarted cold). The oracle is the cached-token ratio of
an unbounded cache that saw every earlier request. Writes `routing.json` and `routing.png`
(bar charts per router) to --out. Needs `pip install sglang-router vllm-router`.
Progress goes to stderr; with --json the last stdout line is one JSON object.

Sizes: --quick is the tiny checkpoint, 2 replicas, 60 requests, one rate, one seed. The
default is the issue's shape (bench checkpoint, 4 replicas with 160 KV blocks each, two rates,
three seeds) scaled down so that it finishes in about 25 minutes on 2 shared cores: 120
requests per text run instead of 300, and the image workload (VL bench checkpoint, 40 blocks
per replica, 60 requests) at the lower rate and seed 0 only. `--requests 300 --image-seeds
0,1,2` gives the full length (about an hour here).
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


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A free loopback port not handed out before in this run (the kernel may offer a released one again)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def model_dir(arg: str | None, quick: bool, arch: str = "qwen2") -> Path:
    if arg:
        return Path(arg)
    size = "tiny" if quick else "bench"
    name = f"{size}-{arch.replace('_', '-')}"
    out = Path(os.environ.get("WARMFLEET_CACHE", Path.home() / ".cache" / "warmfleet")) / "models" / name
    if not (out / "config.json").exists():
        progress(f"writing the {size} {arch} checkpoint to {out}")
        subprocess.run(EXE + ["make-tiny-model", str(out), "--arch", arch, "--size", size], check=True,
                       cwd=tempfile.gettempdir(), stdout=subprocess.DEVNULL)
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


def oracle_hits(model: Path, trace: list[list[dict]], capacity: int | None = None) -> list[tuple[int, int]]:
    """Per request (cached, prompt) tokens for one cache that saw every earlier request (contract 1).

    Unbounded by default (the issue's oracle). With `capacity` blocks it is one LRU cache as large as
    the whole fleet's KV pools: what a router could reach if routing cost no cache space at all (no
    prefix held twice); a reference for how much of the gap to the oracle is capacity, not routing.
    """
    from collections import OrderedDict

    from warmfleet.server.hashing import block_hashes, model_fingerprint
    from warmfleet.server.router.policy import cacheable_tokens
    from warmfleet.server.router.prompt import PromptRenderer

    r, fp = PromptRenderer(str(model)), model_fingerprint(model)
    seen: OrderedDict = OrderedDict()
    out = []
    for msgs in trace:
        p = r.chat({"messages": msgs})
        hs = block_hashes(p.token_ids, p.mm_items, BLOCK, fp)
        hit = next((i for i, h in enumerate(hs) if h not in seen), len(hs))
        out.append((min(hit * BLOCK, cacheable_tokens(p.num_tokens, BLOCK)), p.num_tokens))
        for h in hs:
            seen[h] = None
            seen.move_to_end(h)
        while capacity is not None and len(seen) > capacity:
            seen.popitem(last=False)
    return out


def oracle_ratio(model: Path, trace: list[list[dict]]) -> float:
    hits = oracle_hits(model, trace)
    return sum(c for c, _ in hits) / sum(t for _, t in hits)


# --- processes ------------------------------------------------------------------------------
class Fleet:
    def __init__(self, model: Path, n: int, gpu_blocks: int, cwd: str):  # noqa: D107
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
        try:
            for url, _, p in self.replicas:
                wait_http(url + "/ready", p)
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


def start_router(kind: str, fleet: Fleet, cwd: str, extra: list[str] = ()) -> tuple[str, subprocess.Popen | None]:
    if kind == "rr":
        return "", None
    port = free_port()
    urls = [u for u, _, _ in fleet.replicas]
    if kind.startswith("warmfleet"):  # "warmfleet" or a variant "warmfleet:NAME" (--variant NAME=FLAGS)
        args = EXE + ["route", "--model", str(fleet.model), "--port", str(port), "--block-size", str(BLOCK),
                      "--log-level", "warning", *extra]
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
async def one(client: httpx.AsyncClient, base: str, i: int, msgs: list[dict], rec: list) -> None:
    t0 = time.perf_counter()
    body = {"model": "bench", "messages": msgs, "max_tokens": 4, "temperature": 0, "stream": True,
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


async def drive(bases: list[str], trace: list, rate: float, seed: int, on_tick=None) -> list[dict]:
    """Open-loop Poisson arrivals; `bases` cycle per request (one base = a router, several = round-robin)."""
    rng = random.Random(seed)
    rec: list[dict] = []
    cycle = itertools.cycle(bases)
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=None)) as client:
        tasks = []
        for i, msgs in enumerate(trace):
            tasks.append(asyncio.create_task(one(client, next(cycle), i, msgs, rec)))
            if on_tick:
                await on_tick(i)
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    return rec


def summarize(rec: list[dict], oracle: list[tuple[int, int]] | None = None) -> dict:
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
           "spread": round(max(per.values()) / statistics.mean(per.values()), 3) if per else None}
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


def chart(results: dict, path: Path) -> None:
    """One row per workload: cached-token ratio (oracle dashed), TTFT p50/p90, spread."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = [w for w in ("text", "images") if results.get(w)]
    fig, axes = plt.subplots(len(loads), 3, figsize=(13, 3.6 * len(loads)), squeeze=False)
    colors = {"rr": "#999999", "sglang": "#d9822b", "vllm": "#4a7ebb", "warmfleet": "#2e9e5b"}
    for row, w in zip(axes, loads):
        res = results[w]["routers"]
        names = list(res)
        c = [colors.get(n, "#555555") for n in names]
        row[0].bar(names, [res[n]["cached_ratio"] or 0 for n in names], color=c)
        row[0].axhline(results[w]["oracle_cached_ratio"], ls="--", color="k", lw=1, label="oracle")
        row[0].axhline(0.9 * results[w]["oracle_cached_ratio"], ls=":", color="k", lw=1, label="0.9 x oracle")
        if results[w].get("fleet_lru_cached_ratio"):
            row[0].axhline(results[w]["fleet_lru_cached_ratio"], ls="-.", color="#7a3b9e", lw=1,
                           label="one LRU cache of the fleet's size")
        where = f"{w} (rates {results[w]['rates']}/s, seeds {results[w]['seeds']})"
        row[0].set_title(f"{where}: cached-token ratio", fontsize=9)
        row[0].legend(fontsize=8)
        x = range(len(names))
        row[1].bar([i - 0.2 for i in x], [res[n]["ttft_p50_s"] or 0 for n in names], 0.4, color=c, alpha=0.5,
                   label="p50")
        row[1].bar([i + 0.2 for i in x], [res[n]["ttft_p90_s"] or 0 for n in names], 0.4, color=c, label="p90")
        row[1].set_xticks(list(x), names)
        row[1].set_title(f"{w}: TTFT to the first token (s), p50 light / p90 dark", fontsize=9)
        row[2].bar(names, [res[n]["spread"] or 0 for n in names], color=c)
        row[2].axhline(1.25, ls="--", color="k", lw=1)
        row[2].set_title(f"{w}: spread (max/mean requests per replica)", fontsize=9)
    fig.suptitle(f"warmfleet routing bench: {results['replicas']} replicas (means over runs)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_workload(name: str, model: Path, make_trace, routers: list[str], n: int, gpu_blocks: int,
                 rates: list[float], seeds: list[int], nreq: int, cwd: str, wf_args: list[str],
                 extras: bool, results: dict, variants: dict | None = None, warm_up: bool = True) -> dict:
    """Every router on fresh replicas per (rate, seed), routers interleaved so they share the machine's load."""
    traces = {seed: make_trace(seed, nreq) for seed in seeds}
    oracles = {seed: oracle_hits(model, traces[seed]) for seed in seeds}
    oracle = statistics.mean(sum(c for c, _ in o) / sum(t for _, t in o) for o in oracles.values())
    lru = statistics.mean(sum(c for c, _ in o) / sum(t for _, t in o)
                          for o in (oracle_hits(model, traces[seed], n * gpu_blocks) for seed in seeds))
    runs: dict = {k: [] for k in routers}
    variants = variants or {}
    for rate in rates:
        for seed in seeds:
            for kind in routers:
                with Fleet(model, n, gpu_blocks, cwd) as fleet:
                    if warm_up:
                        fleet.warm_up(make_trace(10_000 + seed, 1)[0])
                    base, proc = start_router(kind, fleet, cwd, wf_args + variants.get(kind, []))
                    try:
                        bases = [base] if base else [u for u, _, _ in fleet.replicas]
                        t0 = time.monotonic()
                        rec = asyncio.run(drive(bases, traces[seed], rate, seed))
                        summ = summarize(rec, oracles[seed])
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
                            stop(proc)
    res = {k: mean_of(v) for k, v in runs.items() if v}
    return {"model": str(model), "gpu_blocks_per_replica": gpu_blocks, "requests": nreq, "rates": rates, "seeds": seeds,
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
    ap.add_argument("--warmfleet-args", default="", help="Extra `warmfleet route` flags, e.g. '--load-weight 16'.")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                    help="A warmfleet variant run as router 'warmfleet:NAME' with these extra flags (after "
                         "--warmfleet-args), e.g. --routers warmfleet,warmfleet:old --variant "
                         "'old=--share-slack-tokens 0': before and after, interleaved on the same seeds.")
    ap.add_argument("--no-warm-up", action="store_true",
                    help="Skip the one salted request per fresh replica before each run (measures cold replicas).")
    ap.add_argument("--out", default="bench/results", help="Directory for routing.json and routing.png.")
    args = ap.parse_args()
    n = args.replicas or (2 if args.quick else 4)
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else ([0] if args.quick else [0, 1, 2])
    rates = [float(x) for x in args.rates.split(",")] if args.rates else ([4.0] if args.quick else [2.0, 6.0])
    nreq = args.requests or (60 if args.quick else 120)
    nimg = args.image_requests or (40 if args.quick else 60)
    image_seeds = [int(x) for x in args.image_seeds.split(",")]
    gpu_blocks = args.gpu_blocks or (48 if args.quick else 160)  # the working set does not fit one replica
    routers = args.routers.split(",")
    wf_args = args.warmfleet_args.split()
    variants = {"warmfleet:" + v.split("=", 1)[0]: v.split("=", 1)[1].split() for v in args.variant}
    cwd = tempfile.mkdtemp(prefix="wf-bench-")
    results: dict = {"command": " ".join([Path(sys.executable).name] + sys.argv), "replicas": n, "rates": rates,
                     "seeds": seeds, "image_seeds": image_seeds, "targets_text": TARGETS, "warmfleet_args": wf_args,
                     "variants": variants}
    if not args.no_text:
        model = model_dir(args.model, args.quick)
        results["text"] = run_workload("text", model, workload, routers, n, gpu_blocks, rates, seeds, nreq, cwd,
                                       wf_args, True, results, variants, not args.no_warm_up)
        for kind, v in results["text"]["routers"].items():
            progress(f"text {kind}: { {k: x for k, x in v.items() if k != 'reasons'} }")
    if not args.no_images:
        vl = model_dir(args.vl_model, args.quick, "qwen2_vl")
        if accepts_images(vl, cwd):
            # the lower rate only: images are the slow part of a CPU replica
            results["images"] = run_workload("images", vl, image_workload, routers, n, 40, rates[:1], image_seeds,
                                             nimg, cwd, wf_args, False, results, variants, not args.no_warm_up)
            for kind, v in results["images"]["routers"].items():
                progress(f"images {kind}: { {k: x for k, x in v.items() if k != 'reasons'} }")
        else:
            results["images"] = None
            progress("replicas do not accept images yet: image workload skipped")
    shutil.rmtree(cwd, ignore_errors=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "routing.json").write_text(json.dumps(results, indent=1))
    chart(results, out / "routing.png")
    progress(f"wrote {out / 'routing.json'} and {out / 'routing.png'}")
    slim = {k: v for k, v in results.items() if k not in ("text", "images")}
    for w in ("text", "images"):
        if results.get(w):
            slim[w] = {k: v for k, v in results[w].items() if k != "runs"}
    if args.json:
        print(json.dumps(slim))
    else:
        for k, v in slim.items():
            print(f"{k}: {v}")
    return 0


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
