"""bench/trace_replay.py's runs: the requests streamed at their arrival times through one router set into a fresh simulated fleet, and what the fleet says of them."""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # bench/harness.py, after the stdlib
import harness  # noqa: E402

replay_fleet = harness.sibling("replay_fleet")
replay_report = harness.sibling("replay_report")
replay_workload = harness.sibling("replay_workload")


# --- driving ------------------------------------------------------------------------------------
async def stream_completion(session, url: str, body: dict) -> dict:
    """POST one streamed completion; its client TTFT, usage, replica/route headers and error (None if it went well)."""
    import aiohttp

    t0 = time.perf_counter()
    out = {"ttft_client_s": None, "cached": None, "prompt": None, "replica": None, "route": None, "error": None}
    try:
        async with session.post(url, json=body) as resp:
            out["replica"] = resp.headers.get("x-warmfleet-replica")
            out["route"] = resp.headers.get("x-warmfleet-route")
            if resp.status != 200:
                out["error"] = f"HTTP {resp.status}"
                await resp.read()
                return out
            buf = b""
            async for chunk in resp.content.iter_any():
                if out["ttft_client_s"] is None:
                    out["ttft_client_s"] = time.perf_counter() - t0
                buf += chunk
            for line in buf.split(b"\n"):
                if line.startswith(b"data: {"):
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        out["error"] = "stream error"
                    if ev.get("usage"):
                        out["prompt"] = ev["usage"].get("prompt_tokens")
                        out["cached"] = (ev["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        out["error"] = type(exc).__name__
    return out


async def one(session, base: str, r: dict, fmt: str, rec: list, t_start: float) -> None:
    body = {"model": "bench", "prompt": r["text"] if fmt == "text" else r["ids"], "max_tokens": r["max_tokens"],
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "user": f"r{r['i']}"}
    t0 = time.perf_counter()
    res = await stream_completion(session, base + "/v1/completions", body)
    rec.append({"i": r["i"], "sent": round(t0 - t_start, 4), **res})


async def drive(bases: list[str], reqs: list[dict], time_scale: float, fmt: str) -> list[dict]:
    """Open loop: request i at trace time / time_scale; several bases = round-robin over them."""
    import aiohttp

    rec: list[dict] = []
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        t_start = time.perf_counter()
        tasks = []
        t0_trace = reqs[0]["t"] if reqs else 0.0
        for k, r in enumerate(reqs):
            delay = (r["t"] - t0_trace) / time_scale - (time.perf_counter() - t_start)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(session, bases[k % len(bases)], r, fmt, rec, t_start)))
        await asyncio.gather(*tasks)
    return rec


def run_one(kind: str, n: int, reqs: list[dict], model: Path, args, cwd: str, extra: list[str],
            oracle: list[tuple[int, int]] | None = None) -> dict:
    import httpx

    t0 = time.monotonic()
    sim_proc, sim = replay_fleet.start_sim(model, n, args, cwd, args.time_model)
    procs: list = []
    try:
        if kind == "rr":
            bases = [r["url"] for r in sim["replicas"]]
        else:  # several routers: the client spreads requests over them round-robin, as a plain L4 balancer
            bases, procs = replay_fleet.start_routers(kind, model, sim, args, cwd, extra)

        def routers_cpu() -> float:
            return sum(harness.tree_cpu_s(p.pid) for p in procs)

        idle = None
        if procs:
            c0 = routers_cpu()
            time.sleep(args.idle_s)
            idle = round((routers_cpu() - c0) / args.idle_s, 4)
        replay_workload.progress(f"{kind} x {n}: fleet and {len(procs)} router(s) up in {time.monotonic() - t0:.0f} s; "
                 f"replaying {len(reqs)} requests")
        c0 = routers_cpu() if procs else None
        sim_c0 = harness.tree_cpu_s(sim_proc.pid)
        w0 = time.monotonic()
        rec = asyncio.run(drive(bases, reqs, args.time_scale, args.prompt_format))
        wall = time.monotonic() - w0
        cpu = routers_cpu() - c0 if procs else None
        sim_cpu = harness.tree_cpu_s(sim_proc.pid) - sim_c0
        stats = httpx.get(sim["control"] + "/sim/stats", timeout=60).json()
        simlog = httpx.get(sim["control"] + "/sim/log", timeout=60).json()
        out = replay_report.summarize(rec, simlog, n, cpu, wall, oracle, {r["id"]: r.get("slowdown", 1.0) for r in sim["replicas"]})
        busy = [r["busy_model_s"] for r in stats["per_replica"]]
        out.update(router_processes=len(procs), router_idle_cpu_s_per_s=idle, sim_cpu_s=round(sim_cpu, 1),
                   sim_busy_mean=round(statistics.mean(busy) / wall, 3), sim_busy_max=round(max(busy) / wall, 3),
                   sim_max_loop_lag_s=max(r["max_loop_lag_s"] for r in stats["per_replica"]),
                   preemptions=sum(r["preemptions"] for r in stats["per_replica"]))
        if stats.get("per_node"):
            out["node_tier"] = node_tier_hits(stats)
        if kind.startswith("warmfleet"):  # the first router's fitted TTFT models (--ttft-model-samples), if any
            view = httpx.get(bases[0] + "/v1/router/replicas", timeout=30).json()["replicas"]
            slow = {r["url"]: r.get("slowdown", 1.0) for r in sim["replicas"]}
            models = {r["id"]: dict(r["ttft_model"], sim_slowdown=slow.get(r["id"])) for r in view if r.get("ttft_model")}
            if models:
                out["ttft_models"] = models
        errs = [r["error"] for r in rec if r["error"]]
        if errs:
            out["error_kinds"] = {e: errs.count(e) for e in set(errs)}
        return out
    finally:
        for p in procs:
            harness.stop(p)
        harness.stop(sim_proc)


def node_tier_hits(stats: dict) -> dict:
    """The node tiers' hits (blocks and tokens served from them) over the fleet, per node and per replica."""
    nodes = stats["per_node"]
    return {"hit_blocks": sum(x["hit_blocks"] for x in nodes), "hit_tokens": sum(x["hit_tokens"] for x in nodes),
            "per_node": nodes,
            "per_replica": [{k: r[k] for k in ("id", "node", "node_hit_blocks", "node_hit_tokens", "cached_tokens_node",
                                                "node_stored_blocks")} for r in stats["per_replica"] if "node" in r]}
