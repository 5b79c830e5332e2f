"""bench/gateway.py's figures: the routing tier's CPU per request, the means over runs, the targets and the charts."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Mapping, Optional

sys.path.append(str(Path(__file__).resolve().parent))  # bench/harness.py, after the stdlib
import harness  # noqa: E402

routing_report = harness.sibling("routing_report")

COLORS = {"proxy": harness.ROUTER_COLORS["warmfleet"], "epp": "#1b6b3a", "lwepp": "#8c564b"}
TARGETS = ("EPP cached ratio within 0.02 of the proxy's and ahead of lwepp and every peer; "
           "EPP TTFT p90 <= the proxy's; EPP routing-tier CPU per request < the proxy's")


def total(by_role: Optional[Mapping[str, float]]) -> float:
    return sum(by_role.values()) if by_role else 0.0


def net_of_idle(cpu_s: Optional[float], idle_cpu_s: Optional[float], idle_s: float, run_s: float) -> Optional[float]:
    """CPU of a run less what the tier burns idle over as long (measured for `idle_s` before it); never < 0."""
    if cpu_s is None or idle_cpu_s is None or idle_s <= 0:
        return None
    return max(0.0, cpu_s - idle_cpu_s / idle_s * run_s)


def per_1000(cpu_s: Optional[float], num_requests: int) -> Optional[float]:
    return round(cpu_s * 1000 / num_requests, 3) if cpu_s is not None and num_requests else None


# --- targets ----------------------------------------------------------------------------------------
def verdict(res: Mapping[str, Mapping]) -> dict:
    """The issue's targets for the EPP over the fronts measured (each a mean_of summary with
    cpu_s_per_1000_requests); empty without both the EPP and the proxy."""
    epp, proxy = res.get("epp"), res.get("proxy")
    if not epp or not proxy or epp.get("cached_ratio") is None or proxy.get("cached_ratio") is None:
        return {}
    others = {k: v["cached_ratio"] for k, v in res.items()  # gateway-proxy is warmfleet's proxy too: not a rival
              if k not in ("epp", "proxy", "gateway-proxy") and v.get("cached_ratio") is not None}
    out = {"epp_minus_proxy_ratio": round(epp["cached_ratio"] - proxy["cached_ratio"], 4),
           "epp_ratio_within_0.02_of_proxy": abs(epp["cached_ratio"] - proxy["cached_ratio"]) <= 0.02}
    if others:
        out["epp_minus_best_other_ratio"] = round(epp["cached_ratio"] - max(others.values()), 4)
        out["epp_ratio_ahead_of_lwepp_and_peers"] = all(epp["cached_ratio"] > r for r in others.values())
    if "lwepp" not in others:
        out["lwepp_measured"] = False  # "ahead of lwepp" then says nothing about lwepp
    if epp.get("ttft_p90_s") is not None and proxy.get("ttft_p90_s") is not None:
        out["epp_ttft_p90_vs_proxy"] = round(epp["ttft_p90_s"] / proxy["ttft_p90_s"], 3)
        out["epp_ttft_p90_le_proxy"] = epp["ttft_p90_s"] <= proxy["ttft_p90_s"]
    e_cpu, p_cpu = epp.get("cpu_s_per_1000_requests"), proxy.get("cpu_s_per_1000_requests")
    if e_cpu is not None and p_cpu:
        out["epp_cpu_vs_proxy"] = round(e_cpu / p_cpu, 3)
        out["epp_cpu_per_request_below_proxy"] = e_cpu < p_cpu
    g_cpu = (res.get("gateway-proxy") or {}).get("cpu_s_per_1000_requests")
    if e_cpu is not None and g_cpu:  # beside the target: against proxy mode behind the same gateway
        out["epp_cpu_vs_gateway_proxy"] = round(e_cpu / g_cpu, 3)
        out["epp_cpu_per_request_below_gateway_proxy"] = e_cpu < g_cpu
    return out



def sim_verdict(res: Mapping[str, Mapping]) -> dict:
    """The CPU target at each simulated rate: the EPP front below the proxy, and Envoy's share of it alone."""
    epp, proxy = res.get("epp"), res.get("proxy")
    if not epp or not proxy:
        return {}
    rates = [r for r in epp["rates"] if r in proxy["rates"]]
    tier = {r: round(epp["rates"][r]["cpu_ms_per_request"] / proxy["rates"][r]["cpu_ms_per_request"], 3)
            for r in rates}
    envoy = {r: round(epp["rates"][r]["cpu_ms_per_request_by_process"]["envoy"]
                      / proxy["rates"][r]["cpu_ms_per_request"], 3) for r in rates}
    return {"sim_epp_cpu_vs_proxy": tier, "sim_epp_cpu_below_proxy": all(v < 1 for v in tier.values()),
            "sim_envoy_alone_vs_proxy": envoy, "sim_envoy_alone_below_proxy": all(v < 1 for v in envoy.values())}


def sim_chart(results: dict, path: Path) -> None:
    """Tier CPU per request by process (stacked) and client latency p50/p99, per front and rate."""
    res = results["sim"]["fronts"]
    rates = [str(r) for r in results["sim"]["rates"]]
    fig, ax = harness.subplots(2, (13, 4))
    width = 0.8 / max(1, len(res))
    shades = {"router": COLORS["proxy"], "envoy": "#aaaaaa", "epp": COLORS["epp"], "lwepp": COLORS["lwepp"]}
    for j, (kind, fr) in enumerate(res.items()):
        xs = [i + j * width for i in range(len(rates))]
        bottom = [0.0] * len(rates)
        roles = list(next(iter(fr["rates"].values()))["cpu_ms_per_request_by_process"])
        for role in roles:
            vals = [fr["rates"][r]["cpu_ms_per_request_by_process"][role] for r in rates]
            ax[0].bar(xs, vals, width, bottom=bottom, color=shades.get(role), edgecolor="k", lw=0.5, label=role)
            bottom = [b + v for b, v in zip(bottom, vals)]
        for x, b in zip(xs, bottom):
            ax[0].text(x, b, kind, rotation=90, fontsize=7, ha="center", va="bottom")
        ax[1].plot(rates, [fr["rates"][r]["p50_ms"] for r in rates], marker="o", label=f"{kind} p50")
        ax[1].plot(rates, [fr["rates"][r]["p99_ms"] for r in rates], marker="x", ls="--", label=f"{kind} p99")
    ax[0].set_xticks([i + width * (len(res) - 1) / 2 for i in range(len(rates))], [f"{r}/s" for r in rates])
    handles, labels = ax[0].get_legend_handles_labels()
    seen = dict(zip(labels, handles))  # one entry per process role
    ax[0].legend(seen.values(), seen.keys(), fontsize=8)
    ax[0].set_title("routing-tier CPU ms per request, by process", fontsize=9)
    ax[1].set_title("client latency (ms), streamed chat, max_tokens 4", fontsize=9)
    ax[1].legend(fontsize=7)
    harness.save_figure(fig, path, f"gateway tier in front of {results['sim']['replicas']} simulated replicas "
                                   "(zero time model)")


def summary(runs: list[dict]) -> dict:
    """routing_report.mean_of over one front's runs, plus the mean CPU seconds per process role."""
    out = routing_report.mean_of([{k: v for k, v in r.items() if k != "cpu_s_by_process"} for r in runs])
    roles = [r["cpu_s_by_process"] for r in runs if r.get("cpu_s_by_process")]
    if roles:
        out["cpu_s_by_process"] = {k: round(statistics.mean(r[k] for r in roles), 3) for k in roles[0]}
    return out


def chart(results: dict, path: Path) -> None:
    """Cached-token ratio (oracle dashed), TTFT p50/p90, spread, routing-tier CPU per 1,000 requests."""
    res = results["text"]["fronts"]
    names = list(res)
    c = [COLORS.get(n) or harness.router_colors([n])[0] for n in names]
    fig, ax = harness.subplots(4, (17, 3.8))
    ax[0].bar(names, [res[n]["cached_ratio"] or 0 for n in names], color=c)
    ax[0].axhline(results["text"]["oracle_cached_ratio"], ls="--", color="k", lw=1, label="oracle")
    ax[0].set_title("cached-token ratio", fontsize=9)
    ax[0].legend(fontsize=8)
    harness.ttft_panel(ax[1], res, names, c, "TTFT to the first token (s)")
    harness.spread_panel(ax[2], res, names, c, "requests")
    ax[3].bar(names, [res[n].get("cpu_s_per_1000_requests") or 0 for n in names], color=c)
    ax[3].set_title("routing-tier CPU s per 1,000 requests (rr: none)", fontsize=9)
    harness.save_figure(fig, path, f"warmfleet gateway bench: {results['replicas']} replicas, rates "
                                   f"{results['rates']}/s, seeds {results['seeds']} (means over runs)")

