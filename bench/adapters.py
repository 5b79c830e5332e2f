"""LoRA routing benchmark: N adapters of Zipf popularity, shared prompts per adapter, through warmfleet, round-robin and peers.

    python bench/adapters.py [--quick] [--json] [--adapters N] [--max-loras K] [--routers rr,sglang,vllm,warmfleet]
                             [--replicas R] [--requests M] [--rate X] [--seed S] [--zipf A] [--out DIR]
                             [--variant NAME=FLAGS (router warmfleet:NAME)]

Starts R real `warmfleet serve` replicas on loopback (bench/routing.py's Fleet, fresh for every router), each
serving the same N tiny PEFT adapters (server/tiny_checkpoints/lora.py: random q/v LoRAs on the checkpoint) with
`--max-loras K` device slots, N > K, and a KV pool too small for every adapter's prompts on one replica. The
workload: request i names adapter a ~ Zipf(A) over the N adapters, one of that adapter's P system prompts (shared
by its requests; the same texts under another adapter are other blocks) and a fresh question; open-loop Poisson
arrivals at X/s (bench/routing.py's drive).

Reports per router: the fleet cached-token ratio (from `usage`), TTFT p50/p90, spread (max / mean requests per
replica over all replicas, from x-warmfleet-replica), and adapter loads per 1,000 requests: the replicas' own
`warmfleet:lora_device_loads_total` (adapters copied into a device slot) after the run over the requests sent.
`targets` (booleans): warmfleet ahead of every peer router present (sglang, vllm) on cached ratio and TTFT p90,
adapter loads per 1,000 at most half round-robin's, spread at most 1.25. Writes `adapters.json` and `adapters.png`
to --out. --quick: tiny checkpoint, 2 replicas, 5 adapters, 2 slots, 80 requests.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.append(str(Path(__file__).resolve().parent))  # bench/harness.py, after the stdlib
import harness  # noqa: E402

routing_fleet = harness.sibling("routing_fleet")
routing_report = harness.sibling("routing_report")
routing_runners = harness.sibling("routing_runners")
progress = harness.reporter("adapters")
LOADS = re.compile(r"^warmfleet:lora_device_loads_total\{[^}]*\} ([0-9.eE+-]+)$", re.M)
WORDS = ("cache", "adapter", "router", "replica", "block", "prefix", "tenant", "slot", "rank", "batch", "token",
         "queue", "spill", "load", "home", "warm", "cold", "engine", "fleet", "event")


def make_adapters(model: Path, n: int, out: Path) -> dict[str, Path]:
    """N tiny PEFT adapters for `model` (random q/v LoRAs, one seed each), named lora-0 .. lora-(N-1)."""
    from warmfleet.server.tiny_checkpoints.lora import make_tiny_adapter

    return {f"lora-{i}": make_tiny_adapter(model, out / f"lora-{i}", seed=i) for i in range(n)}


def zipf_weights(n: int, a: float) -> list[float]:
    return [1.0 / (k + 1) ** a for k in range(n)]


def workload(seed: int, nreq: int, adapters: list[str], prompts: int, zipf: float) -> tuple[list[str], list[list]]:
    """(model per request, messages per request): Zipf-popular adapters, `prompts` shared system prompts each."""
    rng = random.Random(seed)
    order = list(adapters)
    rng.shuffle(order)  # popularity does not follow the names (nor their rendezvous order)
    systems = {a: [f"You are the {a} assistant, persona {p}. " + " ".join(rng.choice(WORDS) for _ in range(90))
                   for p in range(prompts)] for a in adapters}
    models, trace = [], []
    for _ in range(nreq):
        a = rng.choices(order, weights=zipf_weights(len(order), zipf))[0]
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(4, 12))) + "?"
        models.append(a)
        trace.append([{"role": "system", "content": rng.choice(systems[a])}, {"role": "user", "content": question}])
    return models, trace


def device_loads(urls: list[str]) -> float:
    """Adapters copied into device slots so far, summed over the replicas (their /metrics)."""
    total = 0.0
    for u in urls:
        m = LOADS.search(httpx.get(u + "/metrics", timeout=10).text)
        total += float(m.group(1)) if m else 0.0
    return total


def modeled_loads(rec: list[dict], models: list[str], max_loras: int) -> dict:
    """Loads a `max_loras`-slot LRU per replica would make for these requests in arrival order, by the router's
    decision reason (x-warmfleet-route; "none" for routers that send none): where the real loads come from."""
    slots: dict[str, list[str]] = {}
    out: dict[str, dict] = {}
    for r in sorted((r for r in rec if r["replica"]), key=lambda r: r["t"]):
        lru, a = slots.setdefault(r["replica"], []), models[r["i"]]
        reason = (r["route"] or "none").split(";")[0]
        row = out.setdefault(reason, {"requests": 0, "loads": 0})
        row["requests"] += 1
        if a in lru:
            lru.remove(a)
        else:
            row["loads"] += 1
            if len(lru) >= max_loras:
                lru.pop(0)
        lru.append(a)
    return out


def run_router(kind: str, make_fleet, model: Path, n: int, gpu_blocks: int, cwd: str, models: list[str],
               trace: list, rate: float, seed: int, max_loras: int, extra: list[str]) -> dict:
    """One router on fresh replicas: the workload's summary plus adapter loads per 1,000 requests."""
    t_start = time.monotonic()
    with make_fleet(model, n, gpu_blocks, cwd) as fleet:
        progress(f"{kind}: {n} replicas up in {time.monotonic() - t_start:.0f} s")
        urls = [u for u, _, _ in fleet.replicas]
        base, proc = routing_fleet.start_router(kind, fleet, cwd, extra)
        try:
            before = device_loads(urls)
            rec = asyncio.run(routing_runners.drive([base] if base else urls, trace, rate, seed, models=models))
            loads = device_loads(urls) - before
        finally:
            if proc is not None:
                harness.stop(proc)
    summ = routing_report.summarize(rec, n)
    summ["adapter_loads_per_1000"] = round(1000.0 * loads / len(rec), 1)
    summ["modeled_loads_by_reason"] = modeled_loads(rec, models, max_loras)
    return summ


def verdict(res: dict) -> dict:
    """The issue's adapter-bench targets for warmfleet (peers present in `res` only)."""
    wf = res.get("warmfleet")
    if not wf:
        return {}
    peers = {k: res[k] for k in ("sglang", "vllm") if k in res}
    out = {"spread_ok": wf["spread"] is not None and wf["spread"] <= 1.25}
    if "rr" in res:
        out["adapter_loads_le_half_rr"] = wf["adapter_loads_per_1000"] <= 0.5 * res["rr"]["adapter_loads_per_1000"]
    if peers:
        out["cached_ratio_ahead_of_every_peer"] = all(wf["cached_ratio"] > p["cached_ratio"] for p in peers.values())
        out["ttft_p90_ahead_of_every_peer"] = all(wf["ttft_p90_s"] < p["ttft_p90_s"] for p in peers.values())
    return out


def chart(results: dict, path: Path) -> None:
    """Cached-token ratio, TTFT p50/p90, adapter loads per 1,000 requests and spread per router."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = results["routers"]
    names = list(res)
    c = harness.router_colors(names)
    fig, ax = plt.subplots(1, 4, figsize=(19, 3.8))
    ax[0].bar(names, [res[k]["cached_ratio"] or 0 for k in names], color=c)
    ax[0].set_title("cached-token ratio", fontsize=9)
    harness.ttft_panel(ax[1], res, names, c, "TTFT to the first token (s)")
    ax[2].bar(names, [res[k]["adapter_loads_per_1000"] for k in names], color=c)
    if "rr" in res:
        ax[2].axhline(0.5 * res["rr"]["adapter_loads_per_1000"], ls="--", color="k", lw=1, label="half of rr")
        ax[2].legend(fontsize=8)
    ax[2].set_title("adapter loads into a device slot per 1,000 requests", fontsize=9)
    harness.spread_panel(ax[3], res, names, c, "fleet")
    fig.suptitle(f"LoRA routing bench: {results['replicas']} replicas, {results['adapters']} adapters "
                 f"(Zipf {results['zipf']}), --max-loras {results['max_loras']}, {results['requests']} requests "
                 f"at {results['rate']}/s", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="Tiny checkpoint, 2 replicas, 5 adapters, 80 requests.")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--model", default=None)
    ap.add_argument("--routers", default="rr,sglang,vllm,warmfleet")
    ap.add_argument("--replicas", type=int, default=None)
    ap.add_argument("--adapters", type=int, default=None, help="Adapters served by every replica (default 12; quick 5).")
    ap.add_argument("--max-loras", type=int, default=2, help="Device adapter slots per replica (default 2).")
    ap.add_argument("--prompts", type=int, default=2, help="Shared system prompts per adapter (default 2).")
    ap.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of adapter popularity (default 1.1).")
    ap.add_argument("--requests", type=int, default=None, help="Requests per run (default 240; quick 80).")
    ap.add_argument("--rate", type=float, default=None, help="Arrival rate, requests/s (default 4).")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gpu-blocks", type=int, default=None,
                    help="KV blocks per replica (default: about two thirds of every adapter's prompts).")
    ap.add_argument("--out", default="bench/results", help="Directory for adapters.json and adapters.png.")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                    help="A warmfleet variant run as router 'warmfleet:NAME' with these extra `warmfleet route` flags, "
                         "e.g. --routers rr,warmfleet,warmfleet:w256 --variant 'w256=--adapter-weight 256'.")
    args = ap.parse_args()
    n = args.replicas or (2 if args.quick else 4)
    num_adapters = args.adapters or (5 if args.quick else 12)
    if num_adapters <= args.max_loras:
        ap.error(f"--adapters {num_adapters} must be more than --max-loras {args.max_loras}")
    nreq = args.requests or (80 if args.quick else 240)
    rate = args.rate or 4.0
    # every adapter prompt is ~240 tokens (15 blocks of 16): one replica holds about two thirds of them all
    gpu_blocks = args.gpu_blocks or max(48, int(15 * args.prompts * num_adapters * 2 / 3))
    routers, skipped = harness.present_routers(args.routers.split(","))
    for r, why in skipped.items():
        progress(f"skipping router {r}: {why}")
    cwd = tempfile.mkdtemp(prefix="wf-bench-adapters-")
    model = routing_fleet.model_dir(args.model, args.quick)
    adapters = make_adapters(model, num_adapters, Path(cwd) / "adapters")
    serve_args = ["--lora-modules", *(f"{k}={v}" for k, v in adapters.items()), "--max-loras", str(args.max_loras),
                  "--max-cpu-loras", str(num_adapters)]
    models, trace = workload(args.seed, nreq, list(adapters), args.prompts, args.zipf)
    results: dict = {"command": " ".join([Path(sys.executable).name] + sys.argv), "replicas": n,
                     "adapters": num_adapters, "max_loras": args.max_loras, "prompts_per_adapter": args.prompts,
                     "zipf": args.zipf, "requests": nreq, "rate": rate, "seed": args.seed,
                     "gpu_blocks_per_replica": gpu_blocks, "model": str(model), "skipped_routers": skipped,
                     "requests_per_adapter": {a: models.count(a) for a in adapters},
                     "load_average_1_5_15_min": {"before": os.getloadavg()}}
    variants = harness.variants(args.variant)
    results["variants"] = variants
    make_fleet = routing_fleet.fleet_with(*serve_args)
    res = {}
    try:
        for kind in routers:
            res[kind] = run_router(kind, make_fleet, model, n, gpu_blocks, cwd, models, trace, rate, args.seed,
                                   args.max_loras, variants.get(kind, []))
            progress(f"{kind}: {res[kind]}")
    finally:
        shutil.rmtree(cwd, ignore_errors=True)
    results["load_average_1_5_15_min"]["after"] = os.getloadavg()
    results["routers"] = res
    results["targets"] = verdict(res)
    harness.write_results(Path(args.out), "adapters", results, chart, progress)
    harness.print_results(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
