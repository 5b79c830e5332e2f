"""Cache-aware autoscaling policy: the routers' metrics → desired replicas per pool (`decide`), pod-deletion costs
and the warm-up summary; pure (the scrape and the writes are autoscale_pass.py), no kopf, no Kubernetes client.

The operator's timer (handlers.py → autoscale_pass.py) scrapes every router of a service each interval into a
`Sample`, keeps the samples of the last window and calls `decide`, which works like the HPA's
algorithm on the routers' own figures and adds what an HPA cannot know:

    queued  = mean over the window of the uncached prompt tokens waiting for a first token (all routers)
    rec_q   = ceil(queued / targetQueuedPrefillTokens)                 (replicas that keep each one at target)
    rec_t   = ceil(current * ttft_p90 / targetTtftP90Seconds)          (streamed requests of the window)
    rec     = max(rec_q, rec_t); a ratio within 10% of target keeps `current`
    rec     = min(rec, max(2 * current, current + 4))                  (scale-out step, as the HPA's default)
    desired = lowest rec of the scale-up window if rec > current, highest of the scale-down window if rec < current
    no scale-in while the cached-token ratio of the window's second half is below its first half by > hitRatioDrop
    desired within [minReplicas (or the pools' minima), maxReplicas (or what the pools can host)]
    per pool: sizing.assign_replicas(desired, capacities, per-pool minima) (monotone)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence
from urllib.parse import urlsplit

from prometheus_client.parser import text_string_to_metric_families

from warmfleet.operator.planning.sizing import assign_replicas
from warmfleet.operator.spec.inference_service import Autoscaling, WarmupStatus

TOLERANCE = 0.1  # a metric within 10% of its target changes nothing (the HPA's default)
SCALE_UP_FACTOR, SCALE_UP_PODS = 2, 4  # one decision at most doubles the fleet or adds 4, whichever is more
DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
INT32_MAX = 2**31 - 1

P = "warmfleet_router_"
QUEUED = P + "replica_queued_tokens"
HEALTHY = P + "replica_healthy"
CACHED = P + "actual_cached_tokens_total"
USAGE_PROMPT = P + "usage_prompt_tokens_total"
TTFT_BUCKET = P + "ttft_seconds_bucket"


@dataclass(frozen=True)
class Sample:
    """One scrape of every router of a service, summed over routers."""

    t: float  # monotonic seconds of the scrape
    sources: frozenset[str]  # routers that answered: counters are compared only between samples of the same routers
    queued_tokens: float  # uncached prompt tokens awaiting their first token, all replicas, all routers
    cached_tokens: float  # counter: prompt tokens replicas reported as cached
    usage_prompt_tokens: float  # counter: prompt tokens of the requests that reported usage
    ttft_buckets: tuple[tuple[float, float], ...] = ()  # cumulative (upper bound s, count) of the TTFT histogram


@dataclass(frozen=True)
class Decision:
    """What the autoscaler wants, and why."""

    total: int  # replicas across pools (spec.replicas)
    pools: dict[str, int]  # their split over pools
    reason: str  # CamelCase: ScaleOut, ScaleIn, Stabilizing, HitRatioFalling, WithinTarget, NoMetrics, BelowMin, AboveMax
    message: str  # the figures it came from
    recommendation: int  # the metrics' own recommendation (clamped) before stabilisation: kept for the windows


@dataclass
class History:
    """Per-service memory of the autoscaler: samples and recommendations of the recent past (trimmed by `keep`)."""

    samples: list[Sample] = field(default_factory=list)
    recommendations: list[tuple[float, int]] = field(default_factory=list)
    last: tuple[int, str] | None = None  # (total, reason) last written to status
    costs: dict[str, int] = field(default_factory=dict)  # pod name → deletion cost last written
    costs_forbidden: bool = False  # the API refused the pod patch (RBAC): said once, not retried
    failure: str | None = None  # why no router answered, as last logged

    def keep(self, now: float, seconds: float) -> None:
        """Forget what is older than `seconds` (one sample before the window is kept as its start)."""
        old = [i for i, s in enumerate(self.samples) if s.t < now - seconds]
        if old:
            del self.samples[:old[-1]]
        self.recommendations = [(t, r) for t, r in self.recommendations if t >= now - seconds]


# ---- metrics -------------------------------------------------------------------------------

def parse_metrics(text: str) -> dict[str, Any]:
    """The figures the autoscaler reads from one router's Prometheus text."""
    out: dict[str, Any] = {"queued": 0.0, "cached": 0.0, "usage_prompt": 0.0, "buckets": {}, "healthy": 0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == QUEUED:
                out["queued"] += max(0.0, s.value)
            elif s.name == CACHED:
                out["cached"] += s.value
            elif s.name == USAGE_PROMPT:
                out["usage_prompt"] += s.value
            elif s.name == TTFT_BUCKET:
                le = float(s.labels["le"])
                out["buckets"][le] = out["buckets"].get(le, 0.0) + s.value
            elif s.name == HEALTHY:
                out["healthy"] += int(s.value > 0)
    return out


def make_sample(t: float, per_router: Mapping[str, Mapping[str, Any]]) -> Sample | None:
    """Sum the parsed figures of every router that answered; None when none did."""
    if not per_router:
        return None
    buckets: dict[float, float] = {}
    for m in per_router.values():
        for le, n in m["buckets"].items():
            buckets[le] = buckets.get(le, 0.0) + n
    return Sample(t=t, sources=frozenset(per_router), queued_tokens=sum(m["queued"] for m in per_router.values()),
                  cached_tokens=sum(m["cached"] for m in per_router.values()),
                  usage_prompt_tokens=sum(m["usage_prompt"] for m in per_router.values()),
                  ttft_buckets=tuple(sorted(buckets.items())))


def quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """The q-quantile of a cumulative histogram by linear interpolation within its bucket (Prometheus' rule)."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    prev_le, prev_n = 0.0, 0.0
    for le, n in buckets:
        if n >= rank:
            if math.isinf(le):
                return prev_le  # beyond the last finite bound: its bound is the best estimate
            return prev_le + (le - prev_le) * ((rank - prev_n) / (n - prev_n) if n > prev_n else 1.0)
        prev_le, prev_n = le, n
    return prev_le


def _delta_buckets(a: Sample, b: Sample) -> list[tuple[float, float]] | None:
    if a.sources != b.sources:
        return None
    before = dict(a.ttft_buckets)
    out = [(le, n - before.get(le, 0.0)) for le, n in b.ttft_buckets]
    return None if any(n < 0 for _, n in out) else out  # a router restarted: its counters began again


def _ratio(a: Sample, b: Sample) -> float | None:
    """Cached-token ratio of the requests between two samples (None: different routers, a reset, or no usage)."""
    if a.sources != b.sources:
        return None
    prompt, cached = b.usage_prompt_tokens - a.usage_prompt_tokens, b.cached_tokens - a.cached_tokens
    if prompt <= 0 or cached < 0:
        return None
    return cached / prompt


def hit_ratio_trend(samples: Sequence[Sample]) -> tuple[float, float] | None:
    """(ratio of the window's first half, ratio of its second half), when both are known."""
    if len(samples) < 3:
        return None
    mid = len(samples) // 2
    first, second = _ratio(samples[0], samples[mid]), _ratio(samples[mid], samples[-1])
    if first is None or second is None:
        return None
    return first, second


# ---- the decision --------------------------------------------------------------------------

def _proportional(current: int, value: float, target: float) -> int:
    """Replicas that bring a per-fleet figure proportional to load back to target; `current` within tolerance."""
    if current == 0:
        return 1 if value > 0 else 0
    ratio = value / target
    if abs(ratio - 1.0) <= TOLERANCE:
        return current
    return math.ceil(current * ratio - 1e-9)


def replica_range(capacities: Mapping[str, int], floors: Mapping[str, int] | None,
                  cfg: Autoscaling) -> tuple[list[int], int, int]:
    """Per-pool minima (at most each pool's capacity) and the fleet's bounds: (minima, lo, hi)."""
    low = [min((floors or {}).get(n, 0), capacities[n]) for n in capacities]
    lo = max(cfg.min_replicas, sum(low))
    return low, lo, max(lo, min(cfg.max_replicas, sum(capacities.values())))


def queued_recommendation(window: Sequence[Sample], cur: int, target: float) -> tuple[str, int]:
    """Replicas that keep the window's mean queued prefill tokens per replica at `target`; its figure first."""
    queued = sum(s.queued_tokens for s in window) / len(window)
    per = queued / cur if cur else queued
    figure = f"queued prefill tokens per replica {per:.0f} (target {target})"
    if cur and abs(per / target - 1.0) <= TOLERANCE:
        return figure, cur
    return figure, math.ceil(queued / target - 1e-9)


def ttft_recommendation(span: Sequence[Sample], cur: int, target: float) -> tuple[str, int | None]:
    """Replicas that bring the TTFT p90 between the span's ends to `target` (None: nothing streamed); figure first."""
    delta = _delta_buckets(span[0], span[-1]) if len(span) >= 2 else None
    p90 = quantile(0.9, delta) if delta else None
    if p90 is None:
        return "TTFT p90 unknown (no streamed request in the window)", None
    return f"TTFT p90 {p90:.3f} s (target {target:g} s)", _proportional(cur, p90, target)


def metric_recommendations(start: list[Sample], window: list[Sample], cur: int,
                           cfg: Autoscaling) -> tuple[list[str], list[tuple[int, str]]]:
    """The figures of each target set in `cfg`, and the (replicas, metric) each one recommends."""
    figures: list[str] = []
    recs: list[tuple[int, str]] = []
    if cfg.target_queued_prefill_tokens is not None:
        figure, rec = queued_recommendation(window, cur, cfg.target_queued_prefill_tokens)
        figures.append(figure)
        recs.append((rec, "queued prefill tokens"))
    if cfg.target_ttft_p90_seconds is not None:
        figure, ttft_rec = ttft_recommendation(start + window, cur, cfg.target_ttft_p90_seconds)
        figures.append(figure)
        if ttft_rec is not None:
            recs.append((ttft_rec, "TTFT p90"))
    return figures, recs


def bounded_recommendation(recs: Sequence[tuple[int, str]], cur: int, lo: int, hi: int) -> tuple[int, str]:
    """The largest recommendation, at most one scale-out step above `cur`, within [lo, hi]; and the metric asking."""
    raw, why = max(recs)
    raw = min(raw, max(SCALE_UP_FACTOR * cur, cur + SCALE_UP_PODS))
    return min(max(raw, lo), hi), why


def scale_up(rec: int, cur: int, seen: Sequence[tuple[float, int]], now: float, cfg: Autoscaling,
             why: str, message: str) -> tuple[int, str, str]:
    """The lowest recommendation of the scale-up window: (total, ScaleOut or Stabilizing, message)."""
    up = [r for t, r in seen if t >= now - cfg.scale_up_stabilization_seconds]
    desired = max(cur, min(up))
    if desired == cur:
        return cur, "Stabilizing", f"{why} asks {rec}, held by the scale-up window; {message}"
    return desired, "ScaleOut", f"{why}: {cur} -> {desired}; {message}"


def scale_down(rec: int, cur: int, recommendations: Sequence[tuple[float, int]], now: float, cfg: Autoscaling,
               trend_samples: Sequence[Sample], message: str) -> tuple[int, str, str]:
    """The scale-down window's highest recommendation, unless unwatched or the hit ratio falls: (total, reason, msg)."""
    window_s = cfg.scale_down_stabilization_seconds
    down = [r for t, r in [*recommendations, (now, rec)] if t >= now - window_s]
    desired = min(cur, max(down))
    # a window the operator has not watched whole (it just started) may have held a higher recommendation
    covered = window_s == 0 or any(t <= now - window_s for t, _ in recommendations)
    if desired == cur or not covered:
        why_held = "the scale-down window" if covered else "the scale-down window (not yet watched whole)"
        return cur, "Stabilizing", f"metrics ask {rec}, held by {why_held}; {message}"
    trend = hit_ratio_trend(trend_samples) if cfg.protect_hit_ratio else None
    if trend is not None and trend[1] < trend[0] - cfg.hit_ratio_drop:
        return cur, "HitRatioFalling", (f"metrics ask {desired}, but the cached-token ratio fell "
                                        f"{trend[0]:.2f} -> {trend[1]:.2f}; {message}")
    return desired, "ScaleIn", f"{cur} -> {desired}; {message}"


def decide(*, current: Mapping[str, int], capacities: Mapping[str, int], floors: Mapping[str, int] | None = None,
           cfg: Autoscaling, samples: Sequence[Sample], recommendations: Sequence[tuple[float, int]],
           now: float) -> Decision:
    """Desired replicas per pool from the routers' samples of the last `cfg.metrics_window_seconds`.

    `current`: replicas per pool now; `capacities`: most each pool may run (nodes, per-pool maxima);
    `floors`: per-pool minima; `recommendations`: earlier results' `recommendation` with their times
    (the stabilisation windows read them; the caller appends this one's).
    """
    low, lo, hi = replica_range(capacities, floors, cfg)
    cur = sum(current.values())

    def result(total: int, reason: str, message: str, rec: int) -> Decision:
        split = assign_replicas(total, list(capacities.values()), low)
        return Decision(total, dict(zip(capacities, split)), reason, message, rec)

    window = [s for s in samples if s.t >= now - cfg.metrics_window_seconds]
    start = [s for s in samples if s.t < now - cfg.metrics_window_seconds][-1:]  # the rate's left edge
    figures, recs = metric_recommendations(start, window, cur, cfg) if window else ([], [])
    if not recs:
        held = min(max(cur, lo), hi)
        if window:
            return result(held, "NoMetrics", "; ".join(figures) or "no target set", held)
        reason = "BelowMin" if cur < lo else "AboveMax" if cur > hi else "NoMetrics"
        return result(held, reason, "no router answered within the metrics window; replicas held within the bounds",
                      held)
    rec, why = bounded_recommendation(recs, cur, lo, hi)
    message = "; ".join(figures)
    if cur < lo:
        return result(max(rec, lo), "BelowMin", f"below minReplicas {lo}; {message}", rec)
    if cur > hi:
        return result(min(rec, hi), "AboveMax", f"above maxReplicas {hi}; {message}", rec)
    if rec > cur:
        return result(*scale_up(rec, cur, [*recommendations, (now, rec)], now, cfg, why, message), rec)
    if rec < cur:
        return result(*scale_down(rec, cur, recommendations, now, cfg, start + window, message), rec)
    return result(cur, "WithinTarget", message, rec)


# ---- pod-deletion cost and warm-up summary -------------------------------------------------

def _host(replica_id: str) -> str:
    return urlsplit(replica_id).hostname or ""


def deletion_costs(views: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Pod name → pod-deletion-cost: the cached blocks (GPU + CPU tier) the routers index for it, at 2 significant digits.

    The ReplicaSet controller removes the pod of lowest cost first on scale-in, so the replica whose
    loss costs the fleet the fewest cached tokens goes. Several routers index the same replica: the
    largest count wins. Pods the routers do not know are left out (their annotation is not touched).
    """
    blocks: dict[str, int] = {}
    for view in views:
        for r in view.get("replicas") or []:
            host = _host(str(r.get("id", "")))
            blocks[host] = max(blocks.get(host, 0), int(r.get("gpu_blocks") or 0) + int(r.get("cpu_blocks") or 0))
    out = {}
    for pod in pods:
        ip = (pod.get("status") or {}).get("podIP")
        if ip and ip in blocks:
            out[pod["metadata"]["name"]] = min(INT32_MAX, _round2(blocks[ip]))
    return out


def _round2(n: int) -> int:
    """Two significant digits: the order between replicas survives, small moves do not rewrite the annotation."""
    if n < 100:
        return n
    scale = 10 ** (len(str(n)) - 2)
    return n // scale * scale


def warmup_summary(views: Iterable[Mapping[str, Any]]) -> WarmupStatus:
    """The routers' replica states merged per replica (warming if any router warms it, else ready if any routes
    to it, else down) and the figures of each replica's last warm-up (the largest a router reports)."""
    state: dict[str, str] = {}
    last: dict[str, Mapping[str, Any]] = {}
    rank = {"down": 0, "ready": 1, "warming": 2}
    for view in views:
        for r in view.get("replicas") or []:
            rid, st = str(r.get("id")), str(r.get("state", "down"))
            st = st if st in rank else "down"
            if rank[st] >= rank.get(state.get(rid, "down"), 0):
                state[rid] = st
            w = r.get("last_warmup")
            if w and int(w.get("tokens") or 0) >= int((last.get(rid) or {}).get("tokens") or -1):
                last[rid] = w
    states = list(state.values())
    return WarmupStatus(
        warming=states.count("warming"), warm=states.count("ready"), down=states.count("down"),
        warmed_replicas=len(last), replayed_prefixes=sum(int(w.get("prefixes") or 0) for w in last.values()),
        replayed_tokens=sum(int(w.get("tokens") or 0) for w in last.values()),
        longest_seconds=max((float(w.get("seconds") or 0.0) for w in last.values()), default=0.0),
    )
