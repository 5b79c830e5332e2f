"""Gateway benchmark (issue 24): warmfleet's proxy vs Envoy + warmfleet's EPP vs Envoy + GIE's lwepp, and routing.py's peers.

    python -P bench/gateway.py [--quick] [--json] [--fronts proxy,epp,lwepp,rr,sglang,vllm] [--model DIR]
                               [--replicas N] [--requests N] [--rates 4] [--seeds 0] [--gpu-blocks N]
                               [--envoy PATH] [--lwepp PATH] [--out DIR] [--logs DIR]

The same seeded text workload as bench/routing.py (its `workload`, replicas, client and summary are imported
from it, not copied), through each front on fresh `warmfleet serve` replicas per (rate, seed), fronts
interleaved so that they share the machine's load:

- `proxy`: `warmfleet route` (the HTTP proxy, as bench/routing.py runs it);
- `epp`: Envoy in front of `warmfleet epp` as bench/routing.py's `epp` router starts them (ext_proc; headers
  SEND, bodies FULL_DUPLEX_STREAMED, as GIE's gateways configure it; the bootstrap from the product's
  generator, server/router/epp/envoy_bootstrap.py);
- `lwepp`: the same generator's bootstrap in front of GIE v1.6.0's reference round-robin EPP `lwepp`
  (scripts/lwepp.sh builds it), changed only where lwepp needs it (`for_lwepp`: a buffer filter, then a
  STREAMED request body sent without waiting for the headers answer; no response body). lwepp has no static endpoint
  list: it watches an InferencePool and its pods through a Kubernetes API, so this bench brings up a kwok
  control plane (e2e/cluster.sh, one fake node, torn down at the end), installs the InferencePool CRD from
  the module, and declares one pod per replica (podIP 127.0.0.1, Ready, the annotation
  `inference.networking.k8s.io/active-ports` naming its port: lwepp's endpoints are pods x targetPorts);
  the control plane's CPU is not counted in the routing tier (a cluster runs it for everything);
- `gateway-proxy`: proxy mode behind a gateway, the case a cluster that already runs one is in: the same
  generator's bootstrap without ext_proc (`for_gateway_proxy`), Envoy forwarding everything to one
  `warmfleet route` (as an HTTPRoute to the router's Service would), which routes to the replicas;
- `rr`, `sglang`, `vllm`: bench/routing.py's peers (client-side round-robin; the two cache_aware routers).

Reports per front the cached-token ratio (from `usage`), TTFT p50/p90, spread (max / mean requests per
replica, from the replicas' x-warmfleet-replica header, which Envoy passes through), errors, and the routing
tier's CPU seconds per 1,000 requests: utime + stime of its processes (router; or Envoy + EPP) and of all
their descendants, reaped children included (/proc/PID/stat fields 14-17), from just before the first request
to just after the last answer; and the same net of the tier's idle burn (health checks, metric polls, KV
events: measured for 5 s with no traffic before each run), the marginal cost of requests. Targets (booleans under "targets"): the EPP's cached ratio within 0.02 of the
proxy's and ahead of lwepp and every peer; its TTFT p90 <= the proxy's; its CPU per request below the
proxy's (and, reported beside it, below gateway-proxy's: Envoy + proxy). A front that could not run is skipped, said up front and recorded under "skipped_fronts".

--sim-rates R1,R2,...: the tier's CPU at a gateway's rates, where a real engine here cannot go and where the
tier's per-wakeup costs no longer dominate (Envoy without ext_proc: ~2.5 ms per request at 4-16 requests/s,
0.4 at 400): the fronts (rr and the peers left out) in front of bench/simfleet.py's replicas with the zero time model
(real scheduler, block pool and KV events; answers at once), all started once and measured in turn per rate and
round (`--sim-rounds`, interleaved; the median round counts), offered by router_throughput.py's `hey` processes
(streamed chat bodies, `max_tokens` 4, usage included: ~6 response chunks). Reported under "sim": CPU ms per
request of the tier and of each of its processes, client latency p50/p99, errors; targets
`sim_epp_cpu_below_proxy` (every rate) and `sim_envoy_alone_below_proxy` (Envoy's own share of the EPP front
against the whole proxy: false means no endpoint picker, however cheap, can bring the tier below the proxy).

Both Envoys start alike (routing.py's flags: default --concurrency, one worker per core).
Writes gateway.json and gateway.png to --out; progress on stderr; with --json the last stdout line is one
JSON object. Sizes: --quick is routing.py's quick shape (tiny checkpoint, 2 replicas with 48 KV blocks,
60 requests, one rate, one seed: a few minutes); the default is its text shape (bench checkpoint,
4 replicas with 160 blocks, 120 requests, rates 2 and 6, seeds 0-2).

This file is the command line; the rest is in gateway_fronts.py (the routing tiers, their tools, lwepp's kwok
control plane, the simulated fleet), gateway_runners.py (runs) and gateway_report.py (CPU, targets, charts).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # bench/harness.py, after the stdlib
import harness  # noqa: E402

gateway_fronts = harness.sibling("gateway_fronts")
gateway_report = harness.sibling("gateway_report")
gateway_runners = harness.sibling("gateway_runners")
routing_fleet = harness.sibling("routing_fleet")
routing_report = harness.sibling("routing_report")
progress = harness.reporter("gateway")


def usable_fronts(wanted: list[str], args: argparse.Namespace) -> tuple[list[str], dict, dict]:
    """The fronts that can run here, the tools they need, and why each other one is skipped."""
    f = gateway_fronts
    fronts, skipped = harness.present_routers(wanted)
    tools: dict = {}
    if any(x in f.ENVOY_FRONTS for x in fronts):
        try:
            tools["envoy"] = f.envoy_binary(args.envoy)
        except (subprocess.CalledProcessError, OSError) as exc:
            skipped.update({x: f"no Envoy ({exc})" for x in fronts if x in f.ENVOY_FRONTS})
    if "epp" in fronts and "epp" not in skipped and not (f.installed(f.EPP_MAIN) and f.installed(f.BOOTSTRAP)):
        skipped["epp"] = "`warmfleet epp` or its Envoy bootstrap generator is not installed"
    if "lwepp" in fronts and "lwepp" not in skipped:
        try:
            tools["lwepp"] = f.lwepp_binary(args.lwepp)
        except (subprocess.CalledProcessError, OSError) as exc:
            skipped["lwepp"] = f"no lwepp ({exc})"
    if "lwepp" in fronts and "lwepp" not in skipped and not f.installed(f.BOOTSTRAP):
        skipped["lwepp"] = "the Envoy bootstrap generator (server/router/epp/envoy_bootstrap.py) is not installed"
    return [x for x in fronts if x not in skipped], tools, skipped


def kube_for(fronts: list[str]):
    """lwepp's kwok control plane (a context manager) when lwepp runs, else nothing (None)."""
    return gateway_fronts.KubePool() if "lwepp" in fronts else contextlib.nullcontext()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="Tiny checkpoint, 2 replicas, 60 requests, one rate and seed.")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--fronts", default=",".join(gateway_fronts.FRONTS))
    ap.add_argument("--model", default=None)
    ap.add_argument("--replicas", type=int, default=None)
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--rates", default=None, help="Comma-separated arrival rates, requests/s (default 2,6; quick 4).")
    ap.add_argument("--seeds", default=None, help="Comma-separated seeds (default 0,1,2; quick 0).")
    ap.add_argument("--gpu-blocks", type=int, default=None, help="KV blocks per replica (default 160; quick 48).")
    ap.add_argument("--envoy", default=None, help="Envoy binary (default: $WARMFLEET_ENVOY or scripts/envoy-env.sh).")
    ap.add_argument("--lwepp", default=None, help="lwepp binary (default: $WARMFLEET_LWEPP or scripts/lwepp.sh).")
    ap.add_argument("--out", default="bench/results", help="Directory for gateway.json and gateway.png.")
    ap.add_argument("--logs", default=None, help="Keep replica, router, EPP and Envoy logs here.")
    ap.add_argument("--sim-rates", default=None,
                    help="Comma-separated rates: measure the tier's CPU against simulated replicas instead (see above).")
    ap.add_argument("--sim-rounds", type=int, default=3)
    ap.add_argument("--sim-duration", type=float, default=8.0, help="Seconds per measured run.")
    return ap


def main() -> int:
    args = parser().parse_args()
    # SIGTERM unwinds like Ctrl-C: replicas, fronts and the kwok control plane are stopped on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    n = args.replicas or (2 if args.quick else 4)
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else ([0] if args.quick else [0, 1, 2])
    rates = [float(x) for x in args.rates.split(",")] if args.rates else ([4.0] if args.quick else [2.0, 6.0])
    nreq = args.requests or (60 if args.quick else 120)
    gpu_blocks = args.gpu_blocks or (48 if args.quick else 160)
    fronts, tools, skipped = usable_fronts(args.fronts.split(","), args)
    for f, why in skipped.items():
        progress(f"skipping front {f}: {why}")
    if args.logs:
        Path(args.logs).mkdir(parents=True, exist_ok=True)
    cwd = tempfile.mkdtemp(prefix="wf-gateway-", dir=args.logs)
    results: dict = {"command": " ".join([Path(sys.executable).name] + sys.argv), "replicas": n, "rates": rates,
                     "seeds": seeds, "load_average_1_5_15_min": {"before": os.getloadavg()},
                     "targets_text": gateway_report.TARGETS, "skipped_fronts": skipped, "tools": tools,
                     "envoy_flags": "--disable-hot-restart (default --concurrency: one worker per core)",
                     "cpu_note": "routing tier = router process, or Envoy + EPP processes (descendants included); "
                                 "lwepp's kwok control plane is not counted"}
    model = routing_fleet.model_dir(args.model, args.quick)
    if args.sim_rates:
        return main_sim(args, fronts, n, model, cwd, tools, results)
    with kube_for(fronts) as kube:
        results["text"] = gateway_runners.run(model, fronts, n, gpu_blocks, rates, seeds, nreq, cwd, tools, kube)
    results["load_average_1_5_15_min"]["after"] = os.getloadavg()  # the machine is shared: was it busy?
    results["targets"] = results["text"]["targets"]
    if not args.logs:
        shutil.rmtree(cwd, ignore_errors=True)
    harness.write_results(Path(args.out), "gateway", results, gateway_report.chart, progress)
    harness.print_results(dict(results, text={k: v for k, v in results["text"].items() if k != "runs"}), args.json)
    return 0


def main_sim(args, fronts: list[str], n: int, model: Path, cwd: str, tools: dict, results: dict) -> int:
    """--sim-rates: the tier's CPU at a gateway's rates (gateway_sim.json and .png)."""
    fronts = [f for f in fronts if f not in routing_report.PEERS]  # rr has no tier; peers: router_throughput.py's business
    rates = [float(x) for x in args.sim_rates.split(",")]
    for k in ("rates", "seeds"):
        results.pop(k)
    with kube_for(fronts) as kube:
        results["sim"] = gateway_runners.run_sim(model, fronts, n, rates, args.sim_rounds, args.sim_duration, cwd,
                                                 tools, kube)
    results["load_average_1_5_15_min"]["after"] = os.getloadavg()
    results["targets"] = results["sim"]["targets"]
    if not args.logs:
        shutil.rmtree(cwd, ignore_errors=True)
    harness.write_results(Path(args.out), "gateway_sim", results, gateway_report.sim_chart, progress)
    print(json.dumps(results) if args.json else json.dumps(results["targets"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
