"""Trace replay: a production trace (Mooncake) through each router into a simulated fleet of 16-128 replicas.

    python -P bench/trace_replay.py [--trace FILE] [--replicas 16,64] [--time-scale X] [--requests N]
                             [--routers rr,sglang,vllm,warmfleet] [--gpu-blocks 512] [--cpu-blocks 512]
                             [--engine-speedup S] [--prompt-format text|tokens] [--spread-arrivals] [--quick] [--json]
                             [--out DIR]

The replicas are `bench/simfleet.py` (one process, N replicas, the engine's real scheduler and
block pool, a time model calibrated on the real engine, real KV events), the routers are the
real processes: `warmfleet route` unchanged, SGLang's and vllm-router's `cache_aware`, and
round-robin (the client cycles over the replicas, no router process). Every router gets a fresh
fleet (empty caches), the same requests and the same arrival times.

Requests. Trace line i arrives at `timestamp / X` seconds (X = --time-scale). Each 512-token
block id becomes a fixed pseudo-random run of B words (B = the engine block size, 16), each word
one token of the tiny checkpoint's vocabulary with its leading space, so the prompt's text
tokenizes to exactly the planned ids and two requests sharing k block ids share k engine blocks
(verified on the first requests). The prompt is ceil(input_length x B / 512) tokens long (the
trace scaled by B/512 = 1/32: one engine block per trace block), the output
ceil(output_length x B / 512) tokens (--output-scale). Requests go as streamed /v1/completions with
a *text* prompt: sglang-router 0.3.2 refuses token-id prompts (422, its CompletionRequest takes
strings only), so text is the one form every router accepts; every router therefore pays its
own tokenization (warmfleet: the checkpoint's tokenizer; vllm-router: its own with
VLLM_ROUTER_TOKENIZER; SGLang routes on characters). `--prompt-format tokens` sends token ids
(peers that refuse them count errors).

Reported per fleet size and router: cached-token ratio (the simulator's `cached_tokens`, GPU and
CPU tier, over prompt tokens), simulated TTFT p50/p90 (the model's: arrival at the replica to the
step that produced the first token, queueing included), client TTFT p50/p90 (wall clock, router
and machine included), spread (max / mean requests per replica over all N replicas), router CPU
seconds per 1,000 requests (utime + stime of the router's process tree from /proc, over the
replay; its idle rate before the replay separately), errors; for warmfleet its decision reasons.
Bounds as bench/routing.py computes them: the oracle (one unbounded cache that saw every
earlier request) and one LRU cache as large as the whole fleet (N x (gpu + cpu blocks), no
prefix held twice); and, not a bound on every router but what per-replica caches give a router that
never moves a prefix for load, per-replica LRUs with pure affinity (`affinity_hits`). Warmfleet
routers run with WARMFLEET_HEALTH (below). Targets (booleans): warmfleet >= 0.95 x the fleet-sized LRU bound (and
>= 0.97 x, issue 26's); ahead of every other router on cached ratio and on simulated TTFT p90; spread <= 1.25.

Active-active: `warmfleet@K` runs K router processes in front of the same fleet, each given all K
URLs with --peers (they share in-flight load and client limits), `warmfleet@K-nopeers` the same
without; the client spreads requests over them round-robin as a plain L4 balancer would
(`--active-active K` adds both). Router CPU is then the sum over the K processes. Targets: K routers'
cached ratio within 0.02 of one router's (and within 0.01), their simulated TTFT p90 at most 1.1x one
router's. Mooncake's conversation trace rounds its timestamps to 3 s, so 4-16 requests arrive in the
same instant and K routers place them before any could learn of the others' picks; `--spread-arrivals`
spreads each such group evenly up to the next timestamp (order kept).

--node-tier (bench/replay_node.py): warmfleet only, per-replica `--cpu-blocks C` against one node tier of K x C
blocks per K replicas (`--replicas-per-node K`), the router pricing node-tier blocks from the time model; issue
41's targets under `targets`, written to trace_node_tier.json and trace_node_tier.png.

--quick: the committed 600-request excerpt (bench/traces/), 16 replicas, time scale 10, under 5
minutes. Writes trace.json and trace.png to --out; progress on stderr; with --json the last
stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # bench/harness.py, after the stdlib
import harness  # noqa: E402

replay_fleet = harness.sibling("replay_fleet")
replay_node = harness.sibling("replay_node")
replay_report = harness.sibling("replay_report")
replay_runners = harness.sibling("replay_runners")
replay_workload = harness.sibling("replay_workload")


progress = replay_workload.progress


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=None,
                    help=f"Mooncake-format JSONL (default: the excerpt {replay_workload.EXCERPT.name}).")
    ap.add_argument("--replicas", default=None, help="Fleet sizes, comma-separated (default 16,64; quick 16).")
    ap.add_argument("--time-scale", type=float, default=None, help="Replay X times faster than recorded (default 10).")
    ap.add_argument("--requests", type=int, default=None, help="Only the first N requests (quick: 600).")
    ap.add_argument("--routers", default="rr,sglang,vllm,warmfleet",
                    help="Comma-separated: rr, sglang, vllm, warmfleet, warmfleet:VARIANT; warmfleet[:VARIANT]@K runs K "
                         "router processes sharing load (--peers), @K-nopeers K that do not; requests go round-robin.")
    ap.add_argument("--active-active", type=int, default=None, metavar="K",
                    help="Also run warmfleet@K and warmfleet@K-nopeers (K routers, with and without shared load).")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                    help="A warmfleet variant run as router 'warmfleet:NAME' with these extra flags.")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--gpu-blocks", type=int, default=512, help="Primary KV pool per simulated replica (blocks).")
    ap.add_argument("--cpu-blocks", type=int, default=512, help="CPU tier per simulated replica (blocks).")
    ap.add_argument("--time-model", default="calibrated",
                    help="'calibrated' (bench/sim_calibration.json), 'h200' (bench/sim_h200.json), 'zero', or a file.")
    ap.add_argument("--replicas-per-node", type=int, default=8, help="Simulated replicas per node (with the node tier).")
    ap.add_argument("--node-tier-lru", action="store_true",
                    help="With --node-tier-blocks: the node tier as a plain LRU (no claims; the product evicts victims last).")
    ap.add_argument("--node-tier-blocks", type=int, default=0,
                    help="One shared host-memory KV tier of this many blocks per node (needs --cpu-blocks 0; equal host "
                         "memory to --cpu-blocks C is K x C).")
    ap.add_argument("--node-tier", action="store_true",
                    help="Compare warmfleet with per-replica --cpu-blocks C against --cpu-blocks 0 --node-tier-blocks "
                         "K*C (equal host memory; bench/replay_node.py): issue 41's targets, trace_node_tier.{json,png}.")
    ap.add_argument("--node-tier-fixed", action="store_true",
                    help="With --node-tier: also the node tier with the router's fixed --node-tier-weight (unpriced).")
    ap.add_argument("--node-tier-plain-lru", action="store_true",
                    help="With --node-tier: also the node tier as a plain LRU (write-through copies evicted in turn).")
    ap.add_argument("--slow-pool", type=replay_fleet.slow_pool, default=None, metavar="FRAC:F",
                    help="A fraction FRAC of the replicas F times slower (two node pools, e.g. 0.5:3).")
    ap.add_argument("--engine-speedup", type=float, default=10.0,
                    help="Simulated engine this many times faster than the calibration (default 10).")
    ap.add_argument("--output-scale", type=float, default=None,
                    help="Output tokens per trace output token (default: the prompt's, block / 512).")
    ap.add_argument("--prompt-format", choices=("text", "tokens"), default="text")
    ap.add_argument("--spread-arrivals", action="store_true",
                    help="Spread requests that share a timestamp evenly up to the next one (the trace rounds to 3 s).")
    ap.add_argument("--idle-s", type=float, default=3.0, help="Seconds of router idle CPU measured before a replay.")
    ap.add_argument("--quick", action="store_true", help="The committed excerpt, 16 replicas, 600 requests.")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--logs", default=None, help="Keep simulator and router logs here.")
    args = ap.parse_args()
    if args.replicas_per_node < 1:
        ap.error("--replicas-per-node must be at least 1")
    if args.node_tier_blocks < 0 or (args.node_tier_blocks and args.cpu_blocks):
        ap.error("--node-tier-blocks takes the place of the per-replica swap tier: give it with --cpu-blocks 0")
    if args.node_tier and (args.node_tier_blocks or args.cpu_blocks < 1):
        ap.error("--node-tier sizes the node tier itself (K x --cpu-blocks): give --cpu-blocks C >= 1, no --node-tier-blocks")
    return args


def header(args, trace_path: Path, reqs: list[dict], oracle: float, routers: list[str], variants: dict) -> dict:
    """The run's settings and the oracle bound: the results' head, before any fleet."""
    sim_mod = harness.sibling("simfleet")
    tm = sim_mod.TimeModel.load(args.time_model)
    return {
        "command": " ".join([Path(sys.executable).name] + sys.argv), "trace": str(trace_path),
        "trace_name": trace_path.name, "requests": len(reqs), "trace_span_s": round(reqs[-1]["t"] - reqs[0]["t"], 1),
        "time_scale": args.time_scale, "replay_span_s": round((reqs[-1]["t"] - reqs[0]["t"]) / args.time_scale, 1),
        "prompt_format": args.prompt_format, "block_size": args.block_size, "spread_arrivals": args.spread_arrivals,
        "scaling": f"one engine block of {args.block_size} tokens per 512-token trace block (x{args.block_size}/512); "
                   f"output x{args.output_scale or args.block_size / replay_workload.TRACE_BLOCK:g}",
        "mean_prompt_tokens": round(statistics.mean(len(r["ids"]) for r in reqs), 1),
        "mean_output_tokens": round(statistics.mean(r["max_tokens"] for r in reqs), 1),
        "gpu_blocks_per_replica": args.gpu_blocks, "cpu_blocks_per_replica": args.cpu_blocks,
        "replicas_per_node": args.replicas_per_node, "node_tier_blocks_per_node": args.node_tier_blocks,
        "node_tier_lru": args.node_tier_lru, "node_tier_compare": args.node_tier,
        "time_model": args.time_model,
        "time_model_calibrated": vars(tm) if hasattr(tm, "__dict__") else None,
        "engine_speedup": args.engine_speedup,
        "slow_pool": args.slow_pool,
        "time_model_effective": vars(tm.scaled(args.engine_speedup)),
        "calibration": json.loads(sim_mod.CALIBRATION.read_text()) if sim_mod.CALIBRATION.exists() else None,
        "oracle_cached_ratio": oracle, "routers": routers, "variants": variants,
        "warmfleet_health_flags": replay_fleet.WARMFLEET_HEALTH,
        "cores": len(os.sched_getaffinity(0)), "loadavg_start": os.getloadavg(), "fleets": {}}


def run_fleet(n: int, args, reqs: list[dict], hashes: list, fp: str, oracle: float, oracle_per: list, model: Path,
              routers: list[str], variants: dict, cwd: str) -> dict:
    """Every router in front of a fresh fleet of `n` replicas, with the fleet's bounds and targets."""
    nodes = -(-n // args.replicas_per_node) if args.node_tier_blocks else 0
    cap = n * (args.gpu_blocks + args.cpu_blocks) + nodes * args.node_tier_blocks  # every block of the fleet
    lru = replay_workload.ratio(replay_workload.bound_hits(reqs, args.block_size, fp, cap, hashes))
    aff, aff_spread = replay_workload.affinity_hits(reqs, args.block_size, n, cap // n, hashes)
    fleet = {"replicas": n, "oracle_cached_ratio": oracle, "fleet_lru_cached_ratio": lru,
             "fleet_lru_capacity_blocks": cap, "affinity_lru_cached_ratio": replay_workload.ratio(aff),
             "affinity_lru_spread": aff_spread, "routers": {}}
    progress(f"{n} replicas: fleet-sized LRU bound {lru} ({cap} blocks); per-replica LRUs with pure affinity "
             f"{fleet['affinity_lru_cached_ratio']} at spread {aff_spread}")
    for kind in routers:
        try:
            res = replay_runners.run_one(kind, n, reqs, model, args, cwd,
                                         variants.get(replay_fleet.parse_kind(kind)[0], []), oracle_per)
        except Exception as exc:  # one router failing to start must not lose the others' figures
            progress(f"{kind} x {n} failed: {exc!r}")
            res = {"failed": repr(exc), "cached_ratio": None, "ttft_p50_s": None, "ttft_p90_s": None,
                   "spread": None, "errors": None}
        fleet["routers"][kind] = res
        progress(f"{kind} x {n}: { {k: v for k, v in res.items() if k != 'reasons'} }")
    fleet["targets"] = replay_report.verdict(fleet["routers"], lru)
    progress(f"{n} replicas targets: {fleet['targets']}")
    return fleet


def main() -> int:
    args = parse_args()
    trace_path = Path(args.trace) if args.trace else replay_workload.EXCERPT
    sizes = [int(x) for x in (args.replicas or ("16" if args.quick else "16,64")).split(",")]
    args.time_scale = args.time_scale or 10.0
    limit = args.requests or (600 if args.quick else None)
    routers = ["warmfleet"] if args.node_tier else args.routers.split(",")
    if args.active_active and args.active_active > 1:
        routers += [f"warmfleet@{args.active_active}", f"warmfleet@{args.active_active}-nopeers"]
    for kind in routers:
        replay_fleet.parse_kind(kind)  # a typo fails here, not an hour into the run
    variants = harness.variants(args.variant)

    from warmfleet.server.hashing import block_hashes, model_fingerprint
    from warmfleet.server.tokenizer import Tokenizer

    model = replay_workload.tiny_model()
    tok = Tokenizer(str(model))
    words = replay_workload.Words(tok, args.block_size)
    trace = replay_workload.read_trace(trace_path, limit)
    reqs = replay_workload.build_requests(trace, words, args.block_size, args.output_scale)
    if args.spread_arrivals:
        replay_workload.spread_arrivals(reqs)
    if args.prompt_format == "text":
        replay_workload.check_tokenization(tok, reqs)
    fp = model_fingerprint(model)
    hashes = [block_hashes(r["ids"], [], args.block_size, fp) for r in reqs]
    oracle_per = replay_workload.bound_hits(reqs, args.block_size, fp, None, hashes)
    oracle = replay_workload.ratio(oracle_per)
    results = header(args, trace_path, reqs, oracle, routers, variants)
    progress(f"{len(reqs)} requests over {results['trace_span_s']} s of trace, replayed in "
             f"{results['replay_span_s']} s; oracle {oracle}")
    if args.logs:
        Path(args.logs).mkdir(parents=True, exist_ok=True)
    cwd = tempfile.mkdtemp(prefix="wf-trace-", dir=args.logs)
    for n in sizes:
        results["fleets"][n] = (replay_node.compare(n, args, reqs, hashes, fp, oracle, oracle_per, model, cwd)
                                if args.node_tier else
                                run_fleet(n, args, reqs, hashes, fp, oracle, oracle_per, model, routers, variants, cwd))
    results["loadavg_end"] = os.getloadavg()
    results["targets"] = {str(n): f["targets"] for n, f in results["fleets"].items()}
    if not args.logs:
        shutil.rmtree(cwd, ignore_errors=True)
    stem, chart = ("trace_node_tier", replay_node.chart) if args.node_tier else ("trace", replay_report.chart)
    harness.write_results(Path(args.out), stem, results, chart, progress)
    if args.json:
        print(json.dumps(results))
    else:
        for n, f in results["fleets"].items():
            print(f"{n} replicas (oracle {f['oracle_cached_ratio']}, fleet LRU {f['fleet_lru_cached_ratio']})")
            for k, v in f.get("routers", f.get("configs", {})).items():
                print(f"  {k:12s} {v}")
            print(f"  targets {f['targets']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
