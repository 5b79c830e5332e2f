"""bench/trace_replay.py --node-tier: the per-replica swap tier against one node tier per node at equal host memory.

For each fleet size, warmfleet's router in front of fresh fleets with the same requests:

* `per_replica`: every replica with its own swap tier of C blocks (`--cpu-blocks C`);
* `node_tier`: no swap tier, one node tier of K x C blocks per K replicas (`--cpu-blocks 0 --node-tier-blocks K*C`),
  the product's store (victims first: what a replica still holds goes first) and the engine's write-through, the
  router pricing a node-tier block from the time model (`--node-tier-copy-s-per-block` = its `swap_s_per_block`,
  `--prefill-s-per-token`);
* with `--node-tier-fixed`, also `node_tier_fixed`: the same fleet, the router at the fixed `--node-tier-weight`;
* with `--node-tier-plain-lru`, also `node_tier_plain_lru`: the priced node tier as a plain LRU (no claims: the
  write-through copies compete with blocks held nowhere else, as the engine's tier did before claims).

Both have the same host memory and the same fleet-sized LRU bound. Targets (issue 41), per node-tier configuration:
cached ratio >= 0.99 x the fleet-sized LRU bound, simulated TTFT p90 <= 0.8 x the per-replica configuration's,
spread <= 1.1, no errors.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # bench/harness.py, after the stdlib
import harness  # noqa: E402

replay_runners = harness.sibling("replay_runners")
replay_workload = harness.sibling("replay_workload")

CONFIG_COLORS = {"per_replica": "#888888", "node_tier": "#1f77b4", "node_tier_fixed": "#9ecae1",
                 "node_tier_plain_lru": "#ff7f0e"}


def priced_flags(args) -> list[str]:
    """The router flags that price a node-tier block from the simulated engine's own copy and prefill costs."""
    tm = harness.sibling("simfleet").TimeModel.load(args.time_model).scaled(args.engine_speedup)
    return ["--node-tier-copy-s-per-block", repr(tm.swap_s_per_block), "--prefill-s-per-token", repr(tm.prefill_s_per_token)]


def configs(args) -> dict[str, tuple[argparse.Namespace, list[str]]]:
    """name -> (the run's args, extra router flags), at equal host memory: C per replica or K x C per node."""
    c = args.cpu_blocks
    base = {**vars(args), "node_tier_lru": False}
    per = argparse.Namespace(**{**base, "cpu_blocks": c, "node_tier_blocks": 0})
    node = argparse.Namespace(**{**base, "cpu_blocks": 0, "node_tier_blocks": args.replicas_per_node * c})
    out = {"per_replica": (per, []), "node_tier": (node, priced_flags(args))}
    if args.node_tier_fixed:
        out["node_tier_fixed"] = (node, [])
    if args.node_tier_plain_lru:
        out["node_tier_plain_lru"] = (argparse.Namespace(**{**vars(node), "node_tier_lru": True}), priced_flags(args))
    return out


def targets(res: dict, lru: float) -> dict:
    """Issue 41's trace targets for each node-tier configuration against the per-replica swap tier."""
    return {name: t for name in res if name != "per_replica" for t in [config_targets(res, name, lru)] if t}


def config_targets(res: dict, name: str, lru: float) -> dict:
    """The targets of configuration `name` (cached ratio, TTFT p90 and its floor, spread, errors)."""
    per, node = res.get("per_replica", {}), res.get(name, {})
    if per.get("cached_ratio") is None or node.get("cached_ratio") is None:
        return {}
    p90, base = node.get("ttft_p90_s"), per.get("ttft_p90_s")
    return {"ratio_vs_fleet_lru": round(node["cached_ratio"] / lru, 3) if lru else None,
            "per_replica_ratio_vs_fleet_lru": round(per["cached_ratio"] / lru, 3) if lru else None,
            "ttft_p90_vs_per_replica": round(p90 / base, 3) if p90 and base else None,
            # the same with every continued request's TTFT 0 (new conversations are cold for any cache): the least
            # any placement could reach on this trace and load
            "ttft_p90_floor_vs_per_replica": (round(node["ttft_p90_floor_s"] / base, 3)
                                              if base and node.get("ttft_p90_floor_s") is not None else None),
            # continued conversations only: the requests a cache can speed up at all
            "ttft_p90_continued_vs_per_replica": _ratio(_continued_p90(node), _continued_p90(per)),
            "ratio_ge_0.99_fleet_lru": bool(lru and node["cached_ratio"] >= 0.99 * lru),
            "ttft_p90_le_0.8x_per_replica": bool(p90 and base and p90 <= 0.8 * base),
            "spread_le_1.1": node.get("spread") is not None and node["spread"] <= 1.1,
            "errors_ok": node.get("errors") == 0 and per.get("errors") == 0}


def _continued_p90(res: dict):
    return (res.get("ttft_by_kind") or {}).get("continued", {}).get("p90_s")


def _ratio(a, b):
    return round(a / b, 3) if a and b else None


def compare(n: int, args, reqs: list[dict], hashes: list, fp: str, oracle: float, oracle_per: list, model: Path,
            cwd: str) -> dict:
    """Every configuration in front of a fresh fleet of `n` replicas, the fleet-sized LRU bound and the targets."""
    cap = n * (args.gpu_blocks + args.cpu_blocks)  # the same host memory either way: n x C = nodes x K x C
    lru = replay_workload.ratio(replay_workload.bound_hits(reqs, args.block_size, fp, cap, hashes))
    fleet = {"replicas": n, "oracle_cached_ratio": oracle, "fleet_lru_cached_ratio": lru,
             "fleet_lru_capacity_blocks": cap, "configs": {}, "router_flags": {}}
    for name, (cargs, extra) in configs(args).items():
        fleet["router_flags"][name] = extra
        try:
            res = replay_runners.run_one("warmfleet", n, reqs, model, cargs, cwd, extra, oracle_per)
        except Exception as exc:  # one configuration failing must not lose the others' figures
            res = {"failed": repr(exc), "cached_ratio": None, "ttft_p50_s": None, "ttft_p90_s": None,
                   "spread": None, "errors": None}
        fleet["configs"][name] = res
        replay_workload.progress(f"{name} x {n}: { {k: v for k, v in res.items() if k not in ('reasons', 'node_tier')} }")
    fleet["targets"] = targets(fleet["configs"], lru)
    replay_workload.progress(f"{n} replicas node-tier targets: {fleet['targets']}")
    return fleet


def chart(results: dict, path: Path) -> None:
    """Per fleet size: cached ratio against the bound, simulated TTFT p50/p90, spread; one bar per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(results["fleets"])
    fig, axes = plt.subplots(len(sizes), 3, figsize=(14, 3.8 * len(sizes)), squeeze=False)
    for row, n in zip(axes, sizes):
        f = results["fleets"][n]
        res = f["configs"]
        names = list(res)
        c = [CONFIG_COLORS.get(k, "#555555") for k in names]
        row[0].bar(names, [res[k]["cached_ratio"] or 0 for k in names], color=c)
        row[0].axhline(f["fleet_lru_cached_ratio"], ls="-.", color="#7a3b9e", lw=1, label="one LRU of the fleet's size")
        row[0].axhline(0.99 * f["fleet_lru_cached_ratio"], ls=":", color="#7a3b9e", lw=1, label="0.99 x that")
        row[0].set_ylim(0.8 * f["fleet_lru_cached_ratio"], 1.05 * f["fleet_lru_cached_ratio"])
        row[0].set_title(f"{n} replicas: cached-token ratio", fontsize=9)
        row[0].legend(fontsize=7)
        harness.ttft_panel(row[1], res, names, c, f"{n}: simulated TTFT (s)")
        base = res.get("per_replica", {}).get("ttft_p90_s")
        if base:
            row[1].axhline(0.8 * base, ls="--", color="k", lw=1, label="0.8 x per-replica p90")
            row[1].legend(fontsize=7)
        harness.spread_panel(row[2], res, names, c, str(n), target=1.1)
    fig.suptitle(f"node tier vs per-replica swap tier at equal host memory: {results['trace_name']} "
                 f"({results['requests']} requests, time model {results['time_model']}, "
                 f"{results['replicas_per_node']} replicas per node)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
