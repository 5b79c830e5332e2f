"""Prometheus metrics of one router process, on a registry of its own (several routers may share a test process)."""

from __future__ import annotations

from bisect import bisect_left
from typing import Any, Iterator, Sequence

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client import Counter as _Counter
from prometheus_client import Gauge as _Gauge
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.utils import floatToGoString


class _KnownLabels:
    """`labels(...)` returns an existing child from one dict lookup, without the checks and lock of the first call.

    The proxy labels a few metrics on every request (~1.2 us each, measured; ~0.1 us here). Children
    are keyed by their label values as strings, as prometheus_client keys them; anything else, a
    keyword call or an unseen child takes the checked path. `remove` and `clear` need no care: they
    drop the child from the same dict.
    """

    def labels(self, *values, **kw):
        known = getattr(self, "_metrics", None)  # only a metric with label names has children
        if known is not None and not kw:
            child = known.get(values)
            if child is not None:
                return child
        return super().labels(*values, **kw)  # type: ignore[misc]


class Counter(_KnownLabels, _Counter):
    pass


class Gauge(_KnownLabels, _Gauge):
    pass


class _Count:
    """One counter's value: `inc` is one attribute update."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class LoopCounter(_Count):
    """A counter bumped on every request, by the event loop's thread only: no lock, no checks, no `_created` series.

    prometheus_client's `inc` is three calls and a lock (~0.5 us); the request path bumps about ten
    counters and histograms, 3-5 % of the router's CPU. The values are read when scraped (`collect`).
    Nothing else may write to it: the media thread only renders.
    """

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (), registry=None):
        super().__init__()
        self.name, self.documentation, self.labelnames = name, documentation, tuple(labelnames)
        self.children: dict[tuple, _Count] = {}
        if registry is not None:
            registry.register(self)

    def labels(self, *values: str) -> _Count:
        child = self.children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {values}")
            child = self.children.setdefault(tuple(str(v) for v in values), _Count())
        return child

    def describe(self) -> list:
        return [CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)]

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        if self.labelnames:
            for values, child in self.children.items():
                family.add_metric(values, child.value)
        else:
            family.add_metric((), self.value)
        yield family


class LoopHistogram:
    """A histogram observed on every request, by the event loop's thread only (LoopCounter's terms): one bisect and
    two additions per observation."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float], registry=None):
        self.name, self.documentation = name, documentation
        self.bounds = sorted(float(b) for b in buckets)
        if self.bounds[-1] != float("inf"):
            self.bounds.append(float("inf"))
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0
        if registry is not None:
            registry.register(self)

    def observe(self, amount: float) -> None:
        self.counts[bisect_left(self.bounds, amount)] += 1  # le: a value equal to a bound is in its bucket
        self.sum += amount

    def describe(self) -> list:
        return [Metric(self.name, self.documentation, "histogram")]

    def collect(self) -> Iterator[Metric]:
        # the samples prometheus_client's Histogram gives: _count always, _sum only without negative buckets
        # (prediction_error has them; HistogramMetricFamily would drop _count as well)
        family, total = Metric(self.name, self.documentation, "histogram"), 0
        for bound, n in zip(self.bounds, self.counts):
            total += n
            family.add_sample(self.name + "_bucket", {"le": floatToGoString(bound)}, total)
        family.add_sample(self.name + "_count", {}, total)
        if self.bounds[0] >= 0:
            family.add_sample(self.name + "_sum", {}, self.sum)
        yield family


class RouterMetrics:
    """Every metric of one router process: the request path's (loop-only, read when scraped), the fleet's and the
    replicas' lifecycle (warm-up, drain, hand-off)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._request_metrics(self.registry, "warmfleet_router_")
        self._replica_metrics(self.registry, "warmfleet_router_")
        self._lifecycle_metrics(self.registry, "warmfleet_router_")
        self._media_metrics(self.registry, "warmfleet_router_")  # last: the order /metrics lists them in

    def _request_metrics(self, r: CollectorRegistry, p: str) -> None:
        """Bumped per request by the event loop: decisions, answers, cached-token accounting, timings."""
        self.decisions = LoopCounter(p + "decisions_total", "Routing decisions by reason.", ["reason"],
                                     registry=r)
        self.predicted_decisions = LoopCounter(
            p + "predicted_decisions_total", "Decisions made on a predicted index (engines without KV events), "
            "by reason; a subset of decisions_total.", ["reason"], registry=r)
        self.requests = LoopCounter(p + "requests_total", "Requests answered, by HTTP status class.", ["status"],
                                    registry=r)
        self.retries = LoopCounter(p + "retries_total", "Attempts moved to the next replica before the first byte.",
                                   registry=r)
        self.stream_breaks = LoopCounter(p + "stream_breaks_total", "Streams cut by a replica after the first byte.",
                                         registry=r)
        self.predicted_cached_tokens = LoopCounter(
            p + "predicted_cached_tokens_total", "Prompt tokens the router predicted the target would serve from cache "
            "(counted only for requests whose replica reported usage).", registry=r)
        self.actual_cached_tokens = LoopCounter(
            p + "actual_cached_tokens_total", "Prompt tokens replicas reported as cached (usage.cached_tokens).",
            registry=r)
        self.prompt_tokens = LoopCounter(p + "prompt_tokens_total",
                                         "Prompt tokens of routed requests (router's count).", registry=r)
        self.usage_prompt_tokens = LoopCounter(
            p + "usage_prompt_tokens_total", "Prompt tokens (router's count) of the requests whose replica reported "
            "usage: the denominator of actual_cached_tokens_total for the cached-token ratio.", registry=r)
        self.ttft = LoopHistogram(p + "ttft_seconds", "Time from a streamed request's arrival to the replica's first "
                                  "byte (the operator's autoscaler reads its p90).",
                                  buckets=(0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 3, 5, 7.5, 10, 20, 40),
                                  registry=r)
        self.prediction_error = LoopHistogram(
            p + "prediction_error_tokens", "actual - predicted cached tokens per request.",
            buckets=(-4096, -1024, -256, -64, -1, 0, 64, 256, 1024, 4096), registry=r)

    def _replica_metrics(self, r: CollectorRegistry, p: str) -> None:
        """Per replica and of the fleet's KV index: load, health, events."""
        self.replica_in_flight = Gauge(p + "replica_in_flight", "Requests this router has open per replica.",
                                       ["replica"], registry=r)
        self.replica_queued_tokens = Gauge(p + "replica_queued_tokens", "Uncached prompt tokens this router sent "
                                           "per replica that await their first token.", ["replica"], registry=r)
        self.replica_engine_queue = Gauge(p + "replica_engine_requests", "Running + waiting requests the replica "
                                          "last reported in its KV events.", ["replica"], registry=r)
        self.health_stall_rounds = Counter(
            p + "health_stall_rounds_total", "Health-check rounds in which every replica timed out, taken as a stall "
            "of the router or its host and not counted against the replicas.", registry=r)
        self.health_probes_skipped = Counter(
            p + "health_probes_skipped_total", "Health checks not sent because the replica had just answered a "
            "routed request (passive health, --health-passive-max-s).", registry=r)
        self.replica_healthy = Gauge(p + "replica_healthy", "1 if the replica is routable.", ["replica"], registry=r)
        self.event_lag = LoopHistogram(p + "event_lag_seconds", "Publish-to-apply delay of KV-event batches.",
                                       buckets=(0.001, 0.005, 0.02, 0.1, 0.5, 2, 10), registry=r)
        self.bad_events = Counter(p + "bad_event_messages_total", "Undecodable KV-event messages skipped.",
                                  ["replica"], registry=r)
        self.index_blocks = Gauge(p + "index_blocks", "Distinct block hashes in the index.", registry=r)
        self.replica_blocks = Gauge(p + "replica_index_blocks", "Blocks indexed per replica and tier.",
                                    ["replica", "tier"], registry=r)
        self.resyncs = Counter(p + "resyncs_total", "Snapshot resyncs by cause.", ["replica", "cause"], registry=r)
        self.node_tier_weight = Gauge(p + "node_tier_weight", "Worth of a block the replica's node tier holds "
                                      "relative to one in its GPU pool, as the policy scores it now: 1 - copy / "
                                      "recompute, measured or from flags, else --node-tier-weight (core/pricing.py).",
                                      registry=r)
        self.replica_warming = Gauge(p + "replica_warming", "1 while hot prefixes are replayed into the replica "
                                     "(it takes no traffic meanwhile).", ["replica"], registry=r)

    def _lifecycle_metrics(self, r: CollectorRegistry, p: str) -> None:
        """Replicas joining (warm-up), going away (drain) and handing their hot prefixes over."""
        self.warmup_seconds = Histogram(p + "warmup_seconds", "Duration of replica warm-ups.",
                                        buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60), registry=r)
        self.warmup_prefixes = Counter(p + "warmup_prefixes_total", "Hot prefixes replayed into joining replicas.",
                                       ["replica"], registry=r)
        self.warmup_tokens = Counter(p + "warmup_tokens_total", "Prompt tokens replayed into joining replicas.",
                                     ["replica"], registry=r)
        self.replica_draining = Gauge(p + "replica_draining", "1 while the replica drains (going away: no new "
                                      "requests, in-flight ones finish).", ["replica"], registry=r)
        self.drains = Counter(p + "drains_total", "Drains begun, by trigger (terminating endpoint or admin call).",
                              ["trigger"], registry=r)
        self.handoff_prefixes = Counter(p + "handoff_prefixes_total", "Hot prefixes of draining replicas replayed "
                                        "into their new owners.", registry=r)
        self.handoff_tokens = Counter(p + "handoff_tokens_total", "Prompt tokens of those hand-off replays.",
                                      registry=r)

    def _media_metrics(self, r: CollectorRegistry, p: str) -> None:
        """What the router predicted of images and learnt of image URLs, and what deciding costs (per request)."""
        self.predicted_encoder_hits = LoopCounter(
            p + "predicted_encoder_hits_total", "Images outside the predicted KV prefix whose encoder output the router "
            "predicted cached on the replica it chose (compare with the replicas' warmfleet:encoder_cache_hits).",
            registry=r)
        self.media_urls_learned = LoopCounter(
            p + "media_urls_learned_total", "http(s) image URLs whose mm_hash a replica reported (x-warmfleet-media).",
            registry=r)
        self.route_seconds = LoopHistogram(p + "route_seconds",
                                           "Time to render, tokenize, hash and score one request.",
                                           buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05), registry=r)

    def follow_replica(self, rep: Any) -> None:
        """The per-replica load gauges of `rep` (a registry.Replica) read its counters when scraped, so the
        request path sets no gauge (four sets a request were 1-2 % of the router's CPU)."""
        self.replica_in_flight.labels(rep.id).set_function(lambda: rep.in_flight)
        self.replica_queued_tokens.labels(rep.id).set_function(lambda: rep.queued_tokens - rep.replay_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
