"""bench/scaleout.py's figures: windows around each fleet event, the joiner, the autoscalers' runs, targets, charts."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # bench/harness.py, after the stdlib
import harness  # noqa: E402

scaleout_workload = harness.sibling("scaleout_workload")
quantile = harness.quantile


def window(rec: list[dict], t0: float, t1: float) -> dict:
    rows = [r for r in rec if t0 <= r["t"] < t1]
    ok = [r for r in rows if not r["error"]]
    prompt = sum(r["prompt"] for r in ok)
    reasons: dict[str, int] = {}  # the router's decision reasons (x-warmfleet-route): spills show as load_spill
    for r in ok:
        if r.get("route"):
            reason = r["route"].split(";")[0]
            reasons[reason] = reasons.get(reason, 0) + 1
    return {"requests": len(rows), "errors": len(rows) - len(ok), "reasons": reasons,
            "error_kinds": sorted({r["error"] for r in rows if r["error"]}),
            "cached_ratio": round(sum(r["cached"] for r in ok) / prompt, 4) if prompt else None,
            "ttft_p90_model_s": quantile([r.get("ttft_model_s") for r in ok], 0.9),
            "ttft_p90_client_s": quantile([r["ttft_client_s"] for r in ok], 0.9),
            "from_s": round(t0, 2), "to_s": round(t1, 2)}


def served(rec: list[dict], t0: float, t1: float) -> list[dict]:
    """The requests that arrived in [t0, t1) and were answered."""
    return [r for r in rec if t0 <= r["t"] < t1 and not r["error"]]


def tail_of(ok: list[dict], p90: float | None, joiner: str) -> dict:
    """A window's answered requests at or over its TTFT p90 (model): how many went to the joiner, their decision
    reasons, and their cached share of the prompt (a cold prefill or a queue behind one)."""
    rows = [r for r in ok if p90 is not None and (r.get("ttft_model_s") or 0) >= p90]
    reasons: dict[str, int] = {}
    for r in rows:
        reason = (r.get("route") or "none").split(";")[0]
        reasons[reason] = reasons.get(reason, 0) + 1
    prompt = sum(r["prompt"] for r in rows)
    return {"requests": len(rows), "on_joiner": sum(1 for r in rows if r["replica"] == joiner), "reasons": reasons,
            "cached_ratio": round(sum(r["cached"] for r in rows) / prompt, 4) if prompt else None,
            "mean_prompt_tokens": round(prompt / len(rows)) if rows else None}


def summarize(run, simlog: list[dict], window_s: float) -> dict:
    """A scaleout_runners.Run's windows, joiner and totals, TTFTs (model) from the simulator's log `simlog`."""
    by_tag = {x["tag"]: x for x in simlog if x["tag"]}
    for r in run.rec:
        x = by_tag.get(r["tag"])
        r["ttft_model_s"] = x["ttft_model_s"] if x else None
    ev = {e["event"]: e["t"] for e in run.events}
    bounds = {"steady": (ev["steady"], ev["scale_out"]), "scale_out": (ev["scale_out"], ev["scale_out"] + window_s),
              "scale_in": (ev["scale_in"], ev["scale_in"] + window_s), "rolling_update": (ev["rolling_update"], ev["end"])}
    wins = {name: window(run.rec, t0, t1) for name, (t0, t1) in bounds.items()}
    ttfts = {}
    for name in ("steady", "scale_out"):  # where each window's TTFT tail is: the requests at or over its p90
        ok = served(run.rec, *bounds[name])
        wins[name]["tail"] = tail_of(ok, wins[name]["ttft_p90_model_s"], run.spare)
        ttfts[name] = [r["ttft_model_s"] for r in ok if r["ttft_model_s"]]
    wins["scale_out"]["ttft_p90_over_steady_ci90"] = harness.quantile_ratio_interval(
        ttfts["steady"], ttfts["scale_out"], 0.9)
    joiner = [r for r in sorted(run.rec, key=lambda r: r["t"]) if r["replica"] == run.spare and not r["error"]][:100]
    jp = sum(r["prompt"] for r in joiner)
    # warm-up gating, from the joiner's own log: normal requests that arrived before its last warm-up
    # replay (replays are untagged; those after the scale-in are hand-offs from the leaving replica)
    mono = {e["event"]: e["monotonic"] for e in run.events}
    jlog = [x for x in simlog if x["replica"] == run.spare and x["gen"] == 0]  # before the rolling update
    replays = [x["arrival"] for x in jlog if not x["tag"] and x["arrival"] < mono["scale_in"]]
    normal = [x["arrival"] for x in jlog if x["tag"]]
    early = sum(1 for a in normal if replays and a < max(replays))
    return {"windows": wins, "events": run.events,
            "joiner": {"replica": run.spare, "first_requests": len(joiner),
                       "cached_ratio_first_100": round(sum(r["cached"] for r in joiner) / jp, 4) if jp else None,
                       "warmup_replays": len(replays), "normal_requests_before_last_replay": early},
            "total_requests": len(run.rec), "total_errors": sum(1 for r in run.rec if r["error"])}


def verdict(res: dict) -> dict:
    wf = res.get("warmfleet")
    if not wf:
        return {}
    w = wf["windows"]
    steady = w["steady"]["cached_ratio"] or 0
    joiner = wf["joiner"]["cached_ratio_first_100"] or 0
    before, after = w["steady"]["ttft_p90_model_s"], w["scale_out"]["ttft_p90_model_s"]
    return {"joiner_first_100_ratio_ge_0.8x_steady": joiner >= 0.8 * steady,
            "ttft_p90_after_scale_out_le_1.1x_before": bool(before and after and after <= 1.1 * before),
            "zero_errors_scale_in": w["scale_in"]["errors"] == 0,
            "zero_errors_rolling_update": w["rolling_update"]["errors"] == 0,
            "joiner_not_routed_before_warm": wf["joiner"]["normal_requests_before_last_replay"] == 0}


def chart(res: dict, path: Path) -> None:
    names = [n for n in res if isinstance(res[n], dict) and "windows" in res[n]]
    wins = ["steady", "scale_out", "scale_in", "rolling_update"]
    colors = {"warmfleet": "#2e9e5b", "nowarm": "#4a7ebb", "rr": "#999999"}
    fig, axes = harness.subplots(3, (14, 3.8))
    width = 0.8 / max(1, len(names))
    for k, n in enumerate(names):
        xs = [i + (k - (len(names) - 1) / 2) * width for i in range(len(wins))]
        w = res[n]["windows"]
        c = colors.get(n, "#555555")
        axes[0].bar(xs, [w[x]["cached_ratio"] or 0 for x in wins], width, color=c, label=n)
        axes[1].bar(xs, [w[x]["ttft_p90_model_s"] or 0 for x in wins], width, color=c, label=n)
        axes[2].bar([k], [res[n]["joiner"]["cached_ratio_first_100"] or 0], 0.6, color=c, label=n)
        axes[2].hlines(0.8 * (w["steady"]["cached_ratio"] or 0), k - 0.3, k + 0.3, colors="k", linestyles="--")
    for ax, title in ((axes[0], "cached-token ratio per window"), (axes[1], "TTFT p90 per window (model s)")):
        ax.set_xticks(range(len(wins)), wins, fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8, loc="lower left")
    axes[2].set_xticks(range(len(names)), names, fontsize=8)
    axes[2].set_title("joiner's first 100 requests: cached ratio (-- 0.8 x steady)", fontsize=9)
    harness.save_figure(fig, path, f"scale-out / scale-in / rolling update under load: {res['replicas']} simulated "
                                   f"replicas, {res['rate']} req/s, windows of {res['window_s']} s")


# --- autoscaling in the loop (--autoscale) ------------------------------------------------------
def replica_seconds(timeline: list[tuple[float, int]], end: float) -> float:
    pts = [*timeline, (end, timeline[-1][1])]
    return round(sum((t1 - t0) * n for (t0, n), (t1, _) in zip(pts, pts[1:]) if t1 > t0), 1)


def summarize_auto(run, simlog: list[dict]) -> dict:
    """A scaleout_runners.AutoRun's phases, scale events, replica-seconds and decisions."""
    by_tag = {x["tag"]: x for x in simlog if x["tag"]}
    for r in run.rec:
        x = by_tag.get(r["tag"])
        r["ttft_model_s"] = x["ttft_model_s"] if x else None
    ev = [e for e in run.events if e["event"] in {p[0] for p in run.phases[1:]} | {"end"}]
    phases = {a["event"]: window(run.rec, a["t"], b["t"]) for a, b in zip(ev, ev[1:])}
    start, end = ev[0]["t"], ev[-1]["t"]  # after the warm-in
    outs = [e for e in run.events if e["event"] == "scale_out"]
    ins = [e for e in run.events if e["event"] == "scale_in"]
    reasons: dict[str, int] = {}
    for d in run.decisions:
        reasons[d["reason"]] = reasons.get(d["reason"], 0) + 1
    timeline = [(max(t, start), n) for t, n in run.timeline]
    return {"all": window(run.rec, start, end + 1e9), "phases": phases,
            "scale_events": len(outs) + len(ins), "scale_outs": len(outs), "scale_ins": len(ins),
            "max_replicas": max(n for _, n in run.timeline), "replica_seconds": replica_seconds(timeline, end),
            "timeline": run.timeline, "decision_reasons": reasons, "decisions": run.decisions,
            "scale_events_at": [{"event": e["event"], "t": e["t"], "replica": e.get("replica")} for e in outs + ins],
            "total_requests": len(run.rec), "total_errors": sum(1 for r in run.rec if r["error"])}



def verdict_auto(auto: dict) -> dict:
    ca, qo = auto.get("cache_aware"), auto.get("queue_only")
    out = {}
    if ca:
        out["autoscale_cache_aware_zero_client_errors"] = ca["total_errors"] == 0
        out["autoscale_cache_aware_scaled_out_and_in"] = ca["scale_outs"] > 0 and ca["scale_ins"] > 0
    if ca and qo:
        out["autoscale_cache_aware_cached_ratio_ge_queue_only"] = (ca["all"]["cached_ratio"] or 0) >= (qo["all"]["cached_ratio"] or 0)
    return out


def chart_auto(res: dict, path: Path) -> None:
    auto = res["autoscale"]
    names = [n for n in scaleout_workload.AUTOSCALERS if n in auto]
    colors = {"cache_aware": "#2e9e5b", "queue_only": "#999999"}
    fig, axes = harness.subplots(3, (14, 3.8))
    for n in names:
        tl = auto[n]["timeline"]
        end = auto[n]["phases"] and max(w["to_s"] for w in auto[n]["phases"].values())
        axes[0].step([t for t, _ in tl] + [end], [c for _, c in tl] + [tl[-1][1]], where="post", color=colors[n], label=n)
    ax2 = axes[0].twinx()
    t, xs, ys = 0.0, [], []
    for _, rate, secs in auto["phases"]:
        xs += [t, t + secs]
        ys += [rate, rate]
        t += secs
    ax2.plot(xs, ys, "k:", label="req/s")
    ax2.set_ylabel("req/s", fontsize=8)
    axes[0].set_title("replicas running (load dotted)", fontsize=9)
    axes[0].legend(fontsize=8, loc="upper left")
    phases = [p[0] for p in auto["phases"][1:]]  # the warm-in is not compared
    width = 0.8 / max(1, len(names))
    for k, n in enumerate(names):
        xs = [i + (k - (len(names) - 1) / 2) * width for i in range(len(phases) + 1)]
        ws = [auto[n]["phases"][p] for p in phases] + [auto[n]["all"]]
        axes[1].bar(xs, [w["cached_ratio"] or 0 for w in ws], width, color=colors[n], label=n)
        axes[2].bar(xs, [w["ttft_p90_model_s"] or 0 for w in ws], width, color=colors[n], label=n)
    for ax, title in ((axes[1], "cached-token ratio"), (axes[2], "TTFT p90 (model s)")):
        ax.set_xticks(range(len(phases) + 1), phases + ["all"], fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8, loc="lower left")
    harness.save_figure(fig, path, "autoscaling in the loop: cache-aware (queued prefill tokens, hit-ratio protection, "
                                   "warm-up) vs queue-length only (in-flight requests, no warm-up)")

