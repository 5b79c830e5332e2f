"""Scale-out, scale-in and rolling update under steady load: warm-up on vs off vs a queue-only policy.

    python -P bench/scaleout.py [--quick] [--json] [--out DIR] [--configs warmfleet,nowarm,rr]
                                [--window-s S] [--rate R] [--replicas N]

A fleet of simulated replicas (bench/simfleet.py: the engine's own scheduler and KV manager, the
calibrated time model run 10x faster, real HTTP and KV events) behind the real `warmfleet route`
takes an open-loop synthetic multi-turn load (token-id prompts: tenants' system prompts, Zipf;
conversations of 3-8 turns that end and are replaced; a hot shared prefix on 30% of requests).
After a warm-in, one run is:

    steady window | scale-out: a spare replica starts cold | window | scale-in: one replica goes
    | window | rolling update: every replica replaced one by one (a fresh, cold one on its address) | window

Scale-in and each rolling step go as in Kubernetes with the router's drain: the router is told
the replica is going (`POST /v1/router/replicas/{id}/drain`, what a terminating EndpointSlice
endpoint does), a preStop-like pause, then the replica gets SIGTERM-like termination (no new
connections, in-flight requests finish); a replaced replica's drain ends when its successor is up.

Configs: `warmfleet` (warm-up and drain), `nowarm` (`--no-warmup`: drain, but joiners take traffic
cold), `rr` (queue-only: client-side round-robin over the live replicas, no cache affinity, no
warm-up; a leaving replica is out of the rotation at once).

Reported per config and window (`--window-s`, 120 s full, 10 s with --quick): cached-token ratio,
TTFT p90 (model seconds from the simulator, and wall-clock through the router), client errors;
the joiner's first 100 requests' cached ratio; for warm-up configs, how many normal requests reached
the joiner before its last warm-up replay (0 = not routable until warm). Targets (warmfleet):
joiner's first 100 >= 0.8 x steady cached ratio; TTFT p90 (model) after scale-out <= 1.1 x before;
zero client errors on scale-in and on the rolling update. Writes scaleout.json and scaleout.png to
--out. Progress goes to stderr; with --json the last stdout line is one JSON object.

`--autoscale` (with --quick about 3 minutes): no fixed events; the load steps low -> high -> low
(--rate-low, --rate-high) and the operator's real autoscaler sets the replicas in the loop: every
scrape interval `autoscale_pass.scrape` of the router, `make_sample`, `decide` (operator/planning/autoscale_policy.py,
unchanged), then /sim/start or drain + terminate. Two autoscalers, each with its own fleet and router:
`cache_aware` (targetQueuedPrefillTokens, hit-ratio protection, warm-up, scale-in of the replica with
the fewest cached blocks, as pod-deletion-cost does) and `queue_only` (HPA-like: the same `decide`
fed in-flight requests instead of queued tokens, so desired = ceil(requests / target); no hit-ratio
protection, `--no-warmup`, the youngest replica goes first). Reported per autoscaler: scale events,
cached-token ratio, TTFT p90 (model s) and client errors per phase and overall, replica-seconds,
the decisions; targets: cache_aware has zero client errors, scaled out and in, and a cached ratio
>= queue_only's. Writes scaleout-autoscale.json and scaleout-autoscale.png to --out.

This file is the command line; the rest is in scaleout_workload.py (the load, the configs and autoscalers
compared), scaleout_runners.py (fleet, router, load, events, the autoscaler in the loop) and scaleout_report.py
(windows, targets, charts).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # bench/harness.py, after the stdlib
import harness  # noqa: E402

HERE = Path(__file__).resolve().parent
progress = harness.reporter("scaleout")
replay_workload = harness.sibling("replay_workload")
scaleout_report = harness.sibling("scaleout_report")
scaleout_runners = harness.sibling("scaleout_runners")
scaleout_workload = harness.sibling("scaleout_workload")
QUEUED_TARGET, IN_FLIGHT_TARGET = 24.0, 1.0


def main_autoscale(args) -> int:
    """--autoscale: each autoscaler in the loop over a load that steps up and down (scaleout-autoscale.json)."""
    # seconds: warm-in, phases, scrape interval, metrics window, scale-up and scale-down stabilisation (3 scrapes
    # and 10 scrapes: one scrape's spike of queued tokens, e.g. a drain's hand-off replays, does not scale out)
    if args.quick:
        secs, interval_s, window_s, up_s, down_s = (10.0, 15.0, 30.0, 30.0), 1.0, 10, 3, 10
    else:
        secs, interval_s, window_s, up_s, down_s = (30.0, 90.0, 180.0, 180.0), 5.0, 30, 15, 60
    phases = [("warm_in", args.rate_low, secs[0]), ("low", args.rate_low, secs[1]), ("high", args.rate_high, secs[2]),
              ("low_again", args.rate_low, secs[3])]
    variants = [v for v in args.autoscalers.split(",") if v]
    unknown = [v for v in variants if v not in scaleout_workload.AUTOSCALERS]
    if unknown:
        raise SystemExit(f"unknown autoscalers {unknown}: choose from {sorted(scaleout_workload.AUTOSCALERS)}")
    if not 1 <= args.min_replicas < args.max_replicas:
        raise SystemExit("--min-replicas must be >= 1 and below --max-replicas")
    model = replay_workload.tiny_model()
    router_extra = ["--warmup-budget-s", "5"] if args.quick else []
    targets = {"cache_aware": args.target_queued_tokens, "queue_only": args.target_in_flight}
    auto: dict = {"phases": phases, "min_replicas": args.min_replicas, "max_replicas": args.max_replicas,
                  "scrape_interval_s": interval_s, "metrics_window_s": window_s, "scale_up_stabilization_s": up_s,
                  "scale_down_stabilization_s": down_s}
    res: dict = {"mode": "autoscale", "router_flags": router_extra, "gpu_blocks": args.gpu_blocks,
                 "engine_speedup": scaleout_workload.SPEEDUP, "prestop_s": scaleout_workload.PRESTOP_S,
                 "loadavg_1m": os.getloadavg()[0], "autoscale": auto}
    with tempfile.TemporaryDirectory(prefix="scaleout-auto-") as cwd:
        for v in variants:
            progress(f"autoscaler {v}")
            auto[v] = scaleout_runners.run_autoscale(v, model, args.min_replicas, args.max_replicas, phases, targets[v],
                                                     window_s, up_s, down_s, interval_s, args.gpu_blocks, cwd,
                                                     router_extra=router_extra)
            r = auto[v]
            progress(f"{v}: scale events {r['scale_events']} (max {r['max_replicas']} replicas), cached "
                     f"{r['all']['cached_ratio']}, p90 {r['all']['ttft_p90_model_s']} s, errors {r['total_errors']}, "
                     f"replica-seconds {r['replica_seconds']}")
    res["targets"] = scaleout_report.verdict_auto(auto)
    harness.write_results(Path(args.out), "scaleout-autoscale", res, scaleout_report.chart_auto, progress)
    progress(f"targets {res['targets']}")
    if args.json:
        slim = json.loads(json.dumps(res))
        for v in variants:
            slim["autoscale"][v].pop("decisions", None)
        print(json.dumps(slim))
    return 0


def main_events(args, ap: argparse.ArgumentParser) -> int:
    """Fixed events (scale-out, scale-in, rolling update) per config (scaleout.json)."""
    window_s = args.window_s or (8.0 if args.quick else 120.0)
    warm_in_s = min(30.0, max(5.0, window_s / 2))
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in scaleout_workload.CONFIG_FLAGS]
    if unknown:
        ap.error(f"unknown configs {unknown}: choose from {sorted(scaleout_workload.CONFIG_FLAGS)}")
    model = replay_workload.tiny_model()
    router_extra = ["--warmup-budget-s", "5"] if args.quick else []
    res: dict = {"router_flags": router_extra, "replicas": args.replicas, "rate": args.rate, "window_s": window_s,
                 "warm_in_s": warm_in_s, "gpu_blocks": args.gpu_blocks, "engine_speedup": scaleout_workload.SPEEDUP,
                 "prestop_s": scaleout_workload.PRESTOP_S, "loadavg_1m": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="scaleout-") as cwd:
        for c in configs:
            progress(f"config {c}")
            res[c] = scaleout_runners.run_config(c, model, args.replicas, args.rate, warm_in_s, window_s,
                                                 args.gpu_blocks, cwd, router_extra=router_extra)
            w = res[c]["windows"]
            progress(f"{c}: " + ", ".join(f"{k} ratio {v['cached_ratio']} p90 {v['ttft_p90_model_s']} err {v['errors']}"
                                          for k, v in w.items()) + f"; joiner {res[c]['joiner']}")
    res["targets"] = scaleout_report.verdict(res)
    harness.write_results(Path(args.out), "scaleout", res, scaleout_report.chart, progress)
    progress(f"targets {res['targets']}")
    if args.json:
        slim = {k: v for k, v in res.items() if not isinstance(v, dict) or "windows" not in v}
        for c in configs:
            slim[c] = {k: v for k, v in res[c].items() if k != "router_replicas"}
        print(json.dumps(slim))
    return 0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 s windows, 5 s warm-up budget (under 4 minutes in all).")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--configs", default="warmfleet,nowarm,rr")
    ap.add_argument("--window-s", type=float, default=None, help="Window after each event (120 s; --quick 10 s).")
    ap.add_argument("--rate", type=float, default=16.0, help="Requests per second (open loop).")
    ap.add_argument("--replicas", type=int, default=4, help="Replicas before the scale-out.")
    ap.add_argument("--gpu-blocks", type=int, default=512, help="KV pool per replica, blocks of 16 tokens.")
    ap.add_argument("--autoscale", action="store_true",
                    help="Instead of fixed events: the operator's autoscaler in the loop (cache-aware vs queue-length only) "
                         "over a load that steps up and down (--quick: about 3 minutes).")
    ap.add_argument("--autoscalers", default="cache_aware,queue_only")
    ap.add_argument("--rate-low", type=float, default=6.0, help="--autoscale: requests per second before and after the step.")
    ap.add_argument("--rate-high", type=float, default=30.0, help="--autoscale: requests per second during the step.")
    ap.add_argument("--min-replicas", type=int, default=2)
    ap.add_argument("--max-replicas", type=int, default=6)
    ap.add_argument("--target-queued-tokens", type=float, default=QUEUED_TARGET,
                    help="cache_aware: targetQueuedPrefillTokens per replica.")
    ap.add_argument("--target-in-flight", type=float, default=IN_FLIGHT_TARGET,
                    help="queue_only: in-flight requests per replica.")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    return main_autoscale(args) if args.autoscale else main_events(args, ap)


if __name__ == "__main__":
    sys.exit(main())
