"""Prometheus metrics of one router process, on a registry of its own (several routers may share a test process)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client import Counter as _Counter
from prometheus_client import Gauge as _Gauge


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


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "warmfleet_router_"
        self.decisions = Counter(p + "decisions_total", "Routing decisions by reason.", ["reason"], registry=r)
        self.predicted_decisions = Counter(
            p + "predicted_decisions_total", "Decisions made on a predicted index (engines without KV events), "
            "by reason; a subset of decisions_total.", ["reason"], registry=r)
        self.requests = Counter(p + "requests_total", "Requests answered, by HTTP status class.", ["status"], registry=r)
        self.retries = Counter(p + "retries_total", "Attempts moved to the next replica before the first byte.",
                               registry=r)
        self.stream_breaks = Counter(p + "stream_breaks_total", "Streams cut by a replica after the first byte.",
                                     registry=r)
        self.predicted_cached_tokens = Counter(
            p + "predicted_cached_tokens_total", "Prompt tokens the router predicted the target would serve from cache "
            "(counted only for requests whose replica reported usage).", registry=r)
        self.actual_cached_tokens = Counter(
            p + "actual_cached_tokens_total", "Prompt tokens replicas reported as cached (usage.cached_tokens).",
            registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens_total", "Prompt tokens of routed requests (router's count).",
                                     registry=r)
        self.usage_prompt_tokens = Counter(
            p + "usage_prompt_tokens_total", "Prompt tokens (router's count) of the requests whose replica reported "
            "usage: the denominator of actual_cached_tokens_total for the cached-token ratio.", registry=r)
        self.ttft = Histogram(p + "ttft_seconds", "Time from a streamed request's arrival to the replica's first byte "
                              "(the operator's autoscaler reads its p90).",
                              buckets=(0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 3, 5, 7.5, 10, 20, 40), registry=r)
        self.prediction_error = Histogram(
            p + "prediction_error_tokens", "actual - predicted cached tokens per request.",
            buckets=(-4096, -1024, -256, -64, -1, 0, 64, 256, 1024, 4096), registry=r)
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
        self.event_lag = Histogram(p + "event_lag_seconds", "Publish-to-apply delay of KV-event batches.",
                                   buckets=(0.001, 0.005, 0.02, 0.1, 0.5, 2, 10), registry=r)
        self.bad_events = Counter(p + "bad_event_messages_total", "Undecodable KV-event messages skipped.",
                                  ["replica"], registry=r)
        self.index_blocks = Gauge(p + "index_blocks", "Distinct block hashes in the index.", registry=r)
        self.replica_blocks = Gauge(p + "replica_index_blocks", "Blocks indexed per replica and tier.",
                                    ["replica", "tier"], registry=r)
        self.resyncs = Counter(p + "resyncs_total", "Snapshot resyncs by cause.", ["replica", "cause"], registry=r)
        self.replica_warming = Gauge(p + "replica_warming", "1 while hot prefixes are replayed into the replica "
                                     "(it takes no traffic meanwhile).", ["replica"], registry=r)
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
        self.predicted_encoder_hits = Counter(
            p + "predicted_encoder_hits_total", "Images outside the predicted KV prefix whose encoder output the router "
            "predicted cached on the replica it chose (compare with the replicas' warmfleet:encoder_cache_hits).",
            registry=r)
        self.media_urls_learned = Counter(
            p + "media_urls_learned_total", "http(s) image URLs whose mm_hash a replica reported (x-warmfleet-media).",
            registry=r)
        self.route_seconds = Histogram(p + "route_seconds", "Time to render, tokenize, hash and score one request.",
                                       buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05), registry=r)

    def follow_replica(self, rep: Any) -> None:
        """The per-replica load gauges of `rep` (a registry.Replica) read its counters when scraped, so the
        request path sets no gauge (four sets a request were 1-2 % of the router's CPU)."""
        self.replica_in_flight.labels(rep.id).set_function(lambda: rep.in_flight)
        self.replica_queued_tokens.labels(rep.id).set_function(lambda: rep.queued_tokens - rep.replay_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
