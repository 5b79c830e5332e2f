"""bench/routing.py's runs: requests driven at a rate through each router on fresh replicas, added latency, churn and the image variants."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.append(str(Path(__file__).resolve().parent))  # bench/harness.py, after the stdlib
import harness  # noqa: E402

routing_fleet = harness.sibling("routing_fleet")
routing_report = harness.sibling("routing_report")
routing_workload = harness.sibling("routing_workload")


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


async def churn(fleet: routing_fleet.Fleet, router: str, trace: list, rate: float, cwd: str) -> dict:
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


def encoder_hits(fleet: routing_fleet.Fleet, router: str | None) -> dict | None:
    """Encoder-cache hits so far: the replicas' own count and (a warmfleet router) the ones it predicted."""
    if fleet.engine != "warmfleet":
        return None
    out = {"replicas": sum(routing_fleet.metric_sum(u, "warmfleet:encoder_cache_hits_total") for u, _, _ in fleet.replicas)}
    if router:
        out["predicted"] = routing_fleet.metric_sum(router, "warmfleet_router_predicted_encoder_hits_total")
    return out


def encoder_hits_delta(before: dict | None, after: dict | None) -> dict:
    """The run's encoder-cache hits as reported by the replicas, and as the router predicted them (warmfleet)."""
    if not before or not after:
        return {}
    out = {"encoder_hits_reported": int(after["replicas"] - before["replicas"])}
    if "predicted" in before and "predicted" in after and after["predicted"] >= before["predicted"]:
        out["encoder_hits_predicted"] = int(after["predicted"] - before["predicted"])
    return out


def record_vllm_commands(results: dict, fleet, kind: str, proc) -> None:
    """The exact vLLM replica and router commands, once, in `results`."""
    results.setdefault("vllm_thread_binding", fleet.binding())
    results.setdefault("vllm_replica_command", " ".join(fleet.replicas[0][2].args))
    if proc is not None:
        results.setdefault("router_commands", {}).setdefault(kind, " ".join(proc.args))


def run_workload(name: str, model: Path, make_trace, routers: list[str], n: int, gpu_blocks: int,
                 rates: list[float], seeds: list[int], nreq: int, cwd: str, wf_args: list[str],
                 extras: bool, results: dict, variants: dict | None = None, warm_up: bool = True,
                 make_fleet=routing_fleet.Fleet, oracle_trace=None) -> dict:
    """Every router on fresh replicas per (rate, seed), routers interleaved so they share the machine's load.

    `make_fleet(model, n, gpu_blocks, cwd)` starts the replicas: Fleet (`warmfleet serve`) or a VllmFleet.
    `oracle_trace(seed, n)`: the trace the oracle replays when `make_trace`'s cannot be hashed locally (images by URL:
    the same requests with the images inline).
    """
    block = make_fleet.block
    traces = {seed: make_trace(seed, nreq) for seed in seeds}
    hashable = {seed: (oracle_trace or make_trace)(seed, nreq) for seed in seeds}
    oracles = {seed: routing_workload.oracle_hits(model, hashable[seed], block=block) for seed in seeds}
    oracle = statistics.mean(sum(c for c, _ in o) / sum(t for _, t in o) for o in oracles.values())
    lru = statistics.mean(sum(c for c, _ in o) / sum(t for _, t in o)
                          for o in (routing_workload.oracle_hits(model, hashable[seed], n * gpu_blocks, block) for seed in seeds))
    runs: dict = {k: [] for k in routers}
    variants = variants or {}
    for rate in rates:
        for seed in seeds:
            for kind in routers:
                t_start = time.monotonic()
                with make_fleet(model, n, gpu_blocks, cwd) as fleet:
                    routing_fleet.progress(f"{name} {kind}: {n} {fleet.engine} replicas up in {time.monotonic() - t_start:.0f} s")
                    if warm_up:
                        fleet.warm_up(make_trace(10_000 + seed, 1)[0])
                    base, proc = routing_fleet.start_router(kind, fleet, cwd, wf_args + variants.get(kind, []))
                    if fleet.engine == "vllm":
                        record_vllm_commands(results, fleet, kind, proc)
                    try:
                        bases = [base] if base else [u for u, _, _ in fleet.replicas]
                        served = fleet.served() if fleet.engine == "vllm" else None
                        t0 = time.monotonic()
                        pids = routing_fleet.router_pids(proc)
                        s0 = harness.schedstat_ns(pids)
                        wf_base = base if kind.startswith("warmfleet") else None  # its metrics are the router's
                        enc0 = encoder_hits(fleet, wf_base)
                        rec = asyncio.run(drive(bases, traces[seed], rate, seed))
                        s1 = harness.schedstat_ns(pids)
                        summ = routing_report.summarize(rec, len(fleet.replicas), oracles[seed])
                        summ.update(encoder_hits_delta(enc0, encoder_hits(fleet, wf_base)))
                        if pids:  # the router's own CPU and run-queue wait beside its TTFT (starved by the replicas?)
                            summ.update(harness.sched_per_request(s0, s1, len(rec)))
                        if served is not None:  # vLLM names no replica in its answers: count at the replicas
                            summ["spread"] = harness.spread([v - served[u] for u, v in fleet.served().items()], len(fleet.replicas))
                        if hasattr(proc, "metrics_url"):
                            results.setdefault("vllm_router_kv_counters", []).append(
                                {"rate": rate, "seed": seed, **routing_fleet.kv_routing_counters(proc.metrics_url)})
                        summ.update(rate=rate, seed=seed)
                        runs[kind].append(summ)
                        routing_fleet.progress(f"{name} {kind}: rate {rate}/s seed {seed} ({time.monotonic() - t0:.0f} s): "
                                 f"{ {k: v for k, v in summ.items() if k != 'reasons'} }")
                        if extras and kind == "warmfleet" and rate == rates[0] and seed == seeds[0]:
                            results["warmfleet_latency"] = asyncio.run(
                                added_latency(base, fleet.replicas[0][0], 100 if nreq < 100 else 300))
                            routing_fleet.progress(f"added latency: {results['warmfleet_latency']}")
                            results["warmfleet_churn"] = asyncio.run(
                                churn(fleet, base, make_trace(seed + 100, nreq), rate, cwd))
                            routing_fleet.progress(f"churn: {results['warmfleet_churn']}")
                    finally:
                        if proc is not None:
                            harness.stop(proc)
    res = {k: routing_report.mean_of(v) for k, v in runs.items() if v}
    return {"model": str(model), "block_size": block, "gpu_blocks_per_replica": gpu_blocks, "requests": nreq,
            "rates": rates, "seeds": seeds,
            "oracle_cached_ratio": round(oracle, 4), "fleet_lru_cached_ratio": round(lru, 4),
            "routers": res, "runs": runs,
            "targets": routing_report.verdict(res, oracle)}
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
        routing_fleet.progress(f"encode cost: {results['encode_cost']}")
    args = [*wf_args, "--encoder-weight", str(weight)]
    results["image_variants_encoder_weight"] = weight
    # as the KV pools, each replica's encoder cache holds less than the working set: ENCODER_SLOTS of the images
    tokens = results.get("encode_cost", {}).get("image_tokens") or 64
    fleet = routing_fleet.fleet_with("--max-encoder-cache", str(ENCODER_SLOTS * tokens))
    results["image_variants_encoder_cache_tokens"] = ENCODER_SLOTS * tokens
    results["images_recur"] = run_workload("images_recur", vl, routing_workload.recurring_image_workload, routers, n, 40, rates, seeds,
                                           nreq, cwd, args, False, results, variants, warm_up, fleet)
    with MediaServer(Path(tempfile.mkdtemp(prefix="media-", dir=cwd))) as media:
        results["images_url"] = run_workload(
            "images_url", vl, lambda seed, k: routing_workload.by_url(routing_workload.recurring_image_workload(seed, k), media), routers, n, 40, rates,
            seeds, nreq, cwd, args, False, results, variants, warm_up, fleet, oracle_trace=routing_workload.recurring_image_workload)
    for w in ("images", "images_recur", "images_url"):
        if results.get(w):
            results[w]["targets"].update(routing_report.image_verdict(results[w]["routers"]))
    data, url = (results[w]["routers"].get("warmfleet") for w in ("images_recur", "images_url"))
    if data and url:
        results["images_url"]["targets"]["url_ratio_minus_data_ratio"] = round(url["cached_ratio"] - data["cached_ratio"], 4)
        results["images_url"]["targets"]["url_within_0_02_of_data"] = (
            abs(url["cached_ratio"] - data["cached_ratio"]) <= routing_report.URL_RATIO_TOLERANCE)
    for w in ("images_recur", "images_url"):
        for kind, v in results[w]["routers"].items():
            routing_fleet.progress(f"{w} {kind}: { {k: x for k, x in v.items() if k != 'reasons'} }")


def vllm_setup(n: int, gpu_blocks: int) -> dict:
    """How the vLLM replicas run (the exact commands, thread binding and router commands are added per run)."""
    cores = len(routing_fleet.replica_cores())
    return {"python": routing_fleet.vllm_python(), "block_size": routing_fleet.VLLM_BLOCK, "pool_tokens_per_replica": gpu_blocks * routing_fleet.VLLM_BLOCK,
            "env": {"PYTHONHASHSEED": "0",
                    "VLLM_CPU_KVCACHE_SPACE": "1 (GiB; --num-gpu-blocks-override sets the pool)",
                    "VLLM_CPU_OMP_THREADS_BIND": f"replica i: core i mod {cores} ({n} replicas on cores "
                                                 f"{routing_fleet.replica_cores()})"},
            "router_core": routing_fleet.ROUTER_CORE,
            "vllm_router_env": {"VLLM_ROUTER_TOKENIZER": "the checkpoint directory"}}


def accepts_images(model: Path, cwd: str) -> bool:
    """One replica, one image request: does this server's API take images?"""
    with routing_fleet.Fleet(model, 1, 40, cwd) as fleet:
        body = {"model": "bench", "max_tokens": 1, "messages": routing_workload.image_workload(0, 1)[0]}
        try:
            return httpx.post(fleet.replicas[0][0] + "/v1/chat/completions", json=body, timeout=120).status_code == 200
        except httpx.HTTPError:
            return False
