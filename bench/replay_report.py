"""bench/trace_replay.py's figures: one run's summary, the targets and the chart."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # bench/harness.py, after the stdlib
import harness  # noqa: E402

replay_fleet = harness.sibling("replay_fleet")


quantile = harness.quantile


def summarize(rec: list[dict], simlog: list[dict], n: int, cpu_s: float | None, wall_s: float,
              oracle: list[tuple[int, int]] | None = None, slowdown: dict | None = None) -> dict:
    by_tag = {x["tag"]: x for x in simlog}
    ok = [r for r in rec if not r["error"]]
    sim = [by_tag[f"r{r['i']}"] for r in ok if f"r{r['i']}" in by_tag]
    per: dict[str, int] = {}
    for x in sim:
        per[x["replica"]] = per.get(x["replica"], 0) + 1
    prompt = sum(x["prompt"] for x in sim)
    out = {"requests": len(rec), "errors": len(rec) - len(ok),
           "cached_ratio": round(sum(x["cached"] for x in sim) / prompt, 4) if prompt else None,
           "cpu_tier_share": round(sum(x["cached_cpu"] for x in sim) / max(1, sum(x["cached"] for x in sim)), 4),
           "node_tier_share": round(sum(x.get("cached_node", 0) for x in sim) / max(1, sum(x["cached"] for x in sim)), 4),
           "ttft_p50_s": quantile([x["ttft_model_s"] for x in sim], 0.5),
           "ttft_p90_s": quantile([x["ttft_model_s"] for x in sim], 0.9),
           "ttft_client_p50_s": quantile([r["ttft_client_s"] for r in ok], 0.5),
           "ttft_client_p90_s": quantile([r["ttft_client_s"] for r in ok], 0.9),
           "spread": harness.spread(list(per.values()), n),
           "replicas_used": len(per),
           "router_cpu_s_per_1k": round(cpu_s / len(rec) * 1000, 3) if cpu_s is not None and rec else None,
           "replay_wall_s": round(wall_s, 1)}
    pools = sorted(set((slowdown or {}).values()))
    if len(pools) > 1:  # --slow-pool: requests, cached ratio and simulated TTFT p90 per node pool
        out["by_pool"] = {}
        for f in pools:
            xs = [x for x in sim if slowdown.get(x["replica"]) == f]
            p = sum(x["prompt"] for x in xs)
            out["by_pool"][f"x{f:g} slower" if f != 1 else "fast"] = {
                "requests": len(xs), "cached_ratio": round(sum(x["cached"] for x in xs) / p, 4) if p else None,
                "ttft_p90_s": quantile([x["ttft_model_s"] for x in xs], 0.9)}
    # the simulator's usage and the client's agree (a router that altered answers would show here)
    mism = sum(1 for r in ok if f"r{r['i']}" in by_tag and r["cached"] is not None
               and r["cached"] != by_tag[f"r{r['i']}"]["cached"])
    out["usage_mismatches"] = mism
    if any(r["route"] for r in ok):  # warmfleet: decisions by reason, tokens lost against the oracle, mispredictions
        reasons: dict = {}
        ttfts: dict = {}
        for r in ok:
            reason = (r["route"] or "none").split(";")[0]
            predicted = int((r["route"] or "=0").rsplit("=", 1)[1])
            x = by_tag.get(f"r{r['i']}", {})
            actual = x.get("cached", 0)
            d = reasons.setdefault(reason, {"requests": 0, "lost_vs_oracle": 0, "mispredicted": 0})
            d["requests"] += 1
            d["mispredicted"] += abs(predicted - actual)
            if oracle is not None:
                d["lost_vs_oracle"] += max(0, oracle[r["i"]][0] - actual)
            if x:
                ttfts.setdefault(reason, []).append(x["ttft_model_s"])
        for reason, xs in ttfts.items():  # where simulated TTFT goes: new conversations vs kept prefixes
            reasons[reason].update(ttft_p50_s=quantile(xs, 0.5), ttft_p90_s=quantile(xs, 0.9))
        out["reasons"] = reasons
    if oracle is not None:  # TTFT of new conversations (the oracle holds under 64 tokens of them) and the rest
        kinds: dict = {}
        for r in ok:
            x = by_tag.get(f"r{r['i']}")
            if x:
                kinds.setdefault("new" if oracle[r["i"]][0] < 64 else "continued", []).append(x["ttft_model_s"])
        out["ttft_by_kind"] = {k: {"requests": len(xs), "p50_s": quantile(xs, 0.5), "p90_s": quantile(xs, 0.9)}
                               for k, xs in kinds.items()}
        # the p90 no cache placement can go under: every continued request's TTFT taken as 0, new ones as they were
        out["ttft_p90_floor_s"] = quantile(kinds.get("new", []) + [0.0] * len(kinds.get("continued", [])), 0.9)
    return out


# --- verdict and chart --------------------------------------------------------------------------
def verdict(res: dict, fleet_lru: float) -> dict:
    wf = res.get("warmfleet")
    if not wf or wf.get("cached_ratio") is None:
        return {}
    others = {k: v for k, v in res.items() if not k.startswith("warmfleet") and v.get("cached_ratio") is not None}
    out = {"ratio_vs_fleet_lru": round(wf["cached_ratio"] / fleet_lru, 3) if fleet_lru else None,
           "ratio_ok_fleet_lru": bool(fleet_lru and wf["cached_ratio"] >= 0.95 * fleet_lru),
           "ratio_ge_0.97_fleet_lru": bool(fleet_lru and wf["cached_ratio"] >= 0.97 * fleet_lru),
           "spread_ok": wf["spread"] is not None and wf["spread"] <= 1.25,
           "errors_ok": wf["errors"] == 0}
    if others:
        out["ratio_ahead_of_every_peer"] = all(wf["cached_ratio"] > v["cached_ratio"] for v in others.values())
        out["ttft_p90_ahead_of_every_peer"] = all(
            wf["ttft_p90_s"] is not None and v["ttft_p90_s"] is not None and wf["ttft_p90_s"] < v["ttft_p90_s"]
            for v in others.values())
    for k, v in res.items():  # active-active: K routers sharing load vs one router, same fleet and requests
        base, count, peers = replay_fleet.parse_kind(k)
        if base == "warmfleet" and count > 1 and peers and v.get("cached_ratio") is not None:
            gap = abs(v["cached_ratio"] - wf["cached_ratio"])
            out[f"active_active_{count}_within_0.02"] = gap <= 0.02
            out[f"active_active_{count}_within_0.01"] = gap <= 0.01
            out[f"active_active_{count}_ttft_p90_le_1.1x"] = (
                v["ttft_p90_s"] is not None and wf["ttft_p90_s"] is not None and v["ttft_p90_s"] <= 1.1 * wf["ttft_p90_s"])
            out[f"active_active_{count}_spread_ok"] = v["spread"] is not None and v["spread"] <= 1.25
    return out


def chart(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [s for s in results["fleets"]]
    fig, axes = plt.subplots(len(sizes), 4, figsize=(17, 3.8 * len(sizes)), squeeze=False)
    for row, n in zip(axes, sizes):
        f = results["fleets"][n]
        res = f["routers"]
        names = list(res)
        c = harness.router_colors(names)
        row[0].bar(names, [res[k]["cached_ratio"] or 0 for k in names], color=c)
        row[0].axhline(f["oracle_cached_ratio"], ls="--", color="k", lw=1, label="oracle (unbounded)")
        row[0].axhline(f["fleet_lru_cached_ratio"], ls="-.", color="#7a3b9e", lw=1, label="one LRU of the fleet's size")
        row[0].axhline(0.95 * f["fleet_lru_cached_ratio"], ls=":", color="#7a3b9e", lw=1, label="0.95 x that")
        row[0].set_title(f"{n} replicas: cached-token ratio", fontsize=9)
        row[0].legend(fontsize=7)
        harness.ttft_panel(row[1], res, names, c, f"{n}: simulated TTFT (s)")
        harness.spread_panel(row[2], res, names, c, str(n))
        row[3].bar(names, [res[k].get("router_cpu_s_per_1k") or 0 for k in names], color=c)
        row[3].set_title(f"{n}: router CPU s per 1,000 requests (rr: none)", fontsize=9)
        for ax in row:
            ax.tick_params(axis="x", labelsize=7, labelrotation=20)
    fig.suptitle(f"trace replay: {results['trace_name']} ({results['requests']} requests, time scale "
                 f"{results['time_scale']}), simulated replicas", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
