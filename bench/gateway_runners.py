"""bench/gateway.py's runs: every front on fresh replicas per (rate, seed); the tier at simulated rates (--sim-rates)."""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.append(str(Path(__file__).resolve().parent))  # bench/harness.py, after the stdlib
import harness  # noqa: E402

gateway_fronts = harness.sibling("gateway_fronts")
gateway_report = harness.sibling("gateway_report")
routing_fleet = harness.sibling("routing_fleet")
routing_report = harness.sibling("routing_report")
routing_runners = harness.sibling("routing_runners")
routing_workload = harness.sibling("routing_workload")
progress = harness.reporter("gateway")


# --- runs -------------------------------------------------------------------------------------------
def run(model: Path, fronts: list[str], n: int, gpu_blocks: int, rates: list[float], seeds: list[int], nreq: int,
        cwd: str, tools: dict, kube: Optional[gateway_fronts.KubePool], idle_s: float = 5.0) -> dict:
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
                    front = gateway_fronts.start_front(kind, fleet, cwd, tools, kube)
                    progress(f"{kind}: {n} replicas and the front up in {time.monotonic() - t_start:.0f} s")
                    try:
                        idle = front.cpu_s()
                        if idle is not None:  # the tier's own background work (health checks, metrics, events)
                            time.sleep(idle_s)
                            idle = gateway_report.total(front.cpu_s()) - gateway_report.total(idle)
                        cpu0, t0 = front.cpu_s(), time.monotonic()
                        rec = asyncio.run(routing_runners.drive([front.base] if front.base else
                                                        [u for u, _, _ in fleet.replicas], traces[seed], rate, seed))
                        cpu1, run_s = front.cpu_s(), time.monotonic() - t0
                        summ = routing_report.summarize(rec, n, oracles[seed])
                        summ.pop("reasons", None)
                        by_role = None if cpu0 is None else {k: round(cpu1[k] - cpu0[k], 3) for k in cpu0}
                        cpu = None if by_role is None else sum(by_role.values())
                        summ.update(cpu_s=None if cpu is None else round(cpu, 3),
                                    cpu_s_per_1000_requests=gateway_report.per_1000(cpu, len(rec)),
                                    idle_cpu_s_per_s=None if idle is None else round(idle / idle_s, 4),
                                    cpu_s_per_1000_requests_net_of_idle=gateway_report.per_1000(
                                        gateway_report.net_of_idle(cpu, idle, idle_s, run_s), len(rec)),
                                    rate=rate, seed=seed, cpu_s_by_process=by_role)
                        runs[kind].append(summ)
                        progress(f"{kind}: rate {rate}/s seed {seed} ({time.monotonic() - t0:.0f} s): {summ}")
                    finally:
                        front.stop()
    res = {k: gateway_report.summary(v) for k, v in runs.items() if v}
    return {"model": str(model), "block_size": routing_workload.BLOCK, "gpu_blocks_per_replica": gpu_blocks,
            "requests": nreq, "rates": rates, "seeds": seeds, "oracle_cached_ratio": round(oracle, 4),
            "fronts": res, "runs": runs, "targets": gateway_report.verdict(res)}



# --- the tier at a gateway's rates (--sim-rates) -------------------------------------------------------
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
            tools: dict, kube: Optional[gateway_fronts.KubePool], idle_s: float = 5.0, procs: int = 8) -> dict:
    """Every front once in front of one simulated fleet; per round and rate each front in turn (warm-up, then
    `duration_s` of hey); the round with the median tier CPU per request stands for (front, rate)."""
    run_hey = harness.sibling("router_throughput").run_hey
    bodies = sim_bodies(model)
    cores = ",".join(str(c) for c in range(os.cpu_count() or 1))
    runs: dict = {k: {str(r): [] for r in rates} for k in fronts}
    idle: dict = {}
    with gateway_fronts.SimFleet(model, n, cwd) as fleet:
        started: dict[str, gateway_fronts.Front] = {}
        try:
            for kind in fronts:
                started[kind] = gateway_fronts.start_front(kind, fleet, cwd, tools, kube)
            for kind, front in started.items():
                c0 = gateway_report.total(front.cpu_s())
                time.sleep(idle_s)
                idle[kind] = round((gateway_report.total(front.cpu_s()) - c0) / idle_s, 4)
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
                    "max_tokens 4", "fronts": res, "targets": gateway_report.sim_verdict(res)}

