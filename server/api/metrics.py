"""Prometheus metrics on a private registry: vLLM names where the meaning is the same, `warmfleet:` otherwise.

Request-level series (tokens, latencies, outcomes, images) are observed by the API as requests run;
engine-level series (queues, KV usage, prefix-cache, swap and encoder-cache counters) are read from
`EngineClient.stats()` at scrape time, so they are exactly the engine's own numbers; the processor
cache's series come from the pod's cache process (`ProcessorCacheClient.stats()`) at scrape time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..engine.protocol import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets, so dashboards' heatmaps line up
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_HASH_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_PREPARE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


@dataclass(frozen=True)
class CacheConfigInfo:
    """The engine's KV-cache configuration, exported as `vllm:cache_config_info` labels (GIE's optional
    BlockSize / NumGPUBlocks metrics; the EPP parses `block_size` and `num_gpu_blocks` as integers)."""

    block_size: int  # tokens per KV block, as the engine runs (ModelInfo.block_size)
    enable_prefix_caching: bool


class EngineStatsCollector(Collector):
    """Exposes the last EngineStats read at scrape time as gauges and counters.

    The three gauges GIE's model-server protocol requires keep vLLM's names and meanings, which the
    reference EPP scrapes by default: `vllm:num_requests_waiting` (requests in the scheduler's waiting
    queue, preempted ones included), `vllm:num_requests_running` (requests in the running batch),
    `vllm:kv_cache_usage_perc` (fraction 0..1 of primary KV blocks referenced by requests; idle cached
    blocks count as free, as in vLLM, so it falls back to 0 when the server is idle).
    """

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.stats: Optional[EngineStats] = None
        self.cache_config: Optional[CacheConfigInfo] = None  # set once the engine has loaded

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        if s is None:
            return
        m = self.model_name
        yield _gauge(m, "vllm:num_requests_running", "Requests in the running batch.", s.num_running)
        yield _gauge(m, "vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield _gauge(m, "vllm:kv_cache_usage_perc", "Primary KV pool usage, 1 means 100 percent.", _usage(s.gpu_blocks_total, s.gpu_blocks_free))
        if self.cache_config is not None:
            yield _cache_config_info(self.cache_config, s)
        yield from _kv_tier_series(m, s)
        yield from _encoder_and_lora_series(m, s)


def _gauge(m: str, name: str, doc: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=["model_name"])
    g.add_metric([m], value)
    return g


def _counter(m: str, name: str, doc: str, value: float) -> CounterMetricFamily:
    c = CounterMetricFamily(name, doc, labels=["model_name"])
    c.add_metric([m], value)
    return c


def _kv_tier_series(m: str, s: EngineStats) -> Iterator[Metric]:
    """KV blocks and prefix-cache hits per tier (gpu, cpu swap, node), swap and node-tier traffic, KV events."""
    usage = GaugeMetricFamily("warmfleet:kv_cache_usage_perc", "KV block usage per tier, 1 means 100 percent.", labels=["model_name", "tier"])
    usage.add_metric([m, "gpu"], _usage(s.gpu_blocks_total, s.gpu_blocks_free))
    usage.add_metric([m, "cpu"], _usage(s.cpu_blocks_total, s.cpu_blocks_free))
    yield usage
    blocks = GaugeMetricFamily("warmfleet:kv_blocks", "KV blocks per tier and state.", labels=["model_name", "tier", "state"])
    blocks.add_metric([m, "gpu", "total"], s.gpu_blocks_total)
    blocks.add_metric([m, "gpu", "free"], s.gpu_blocks_free)
    blocks.add_metric([m, "cpu", "total"], s.cpu_blocks_total)
    blocks.add_metric([m, "cpu", "free"], s.cpu_blocks_free)
    yield blocks

    yield _counter(m, "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_queries_tokens)
    yield _counter(
        m, "vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache (all tiers).",
        s.prefix_hits_tokens_gpu + s.prefix_hits_tokens_cpu + s.prefix_hits_tokens_node,
    )
    hits = CounterMetricFamily("warmfleet:prefix_cache_hits", "Prompt tokens served from the prefix cache, per tier.", labels=["model_name", "tier"])
    hits.add_metric([m, "gpu"], s.prefix_hits_tokens_gpu)
    hits.add_metric([m, "cpu"], s.prefix_hits_tokens_cpu)
    hits.add_metric([m, "node"], s.prefix_hits_tokens_node)
    yield hits
    yield _counter(m, "warmfleet:node_tier_in_blocks", "KV blocks loaded from the node tier into the primary pool.",
                   s.node_in_blocks)
    yield _counter(m, "warmfleet:node_tier_out_blocks", "KV blocks handed to the node tier (computed here, or evicted from the primary pool).",
                   s.node_out_blocks)
    yield _counter(m, "warmfleet:node_tier_encoder_hits", "Images whose vision-encoder output the node tier served.",
                   s.node_encoder_hits)
    yield _counter(m, "warmfleet:node_tier_failures", "Node-tier calls that failed or timed out (each a miss: "
                   "recomputed).", s.node_failures)
    yield _counter(m, "vllm:num_preemptions", "Requests preempted for lack of KV blocks.", s.preemptions)
    yield _counter(m, "warmfleet:swap_in_blocks", "KV blocks copied from the CPU tier back to the primary pool.", s.swap_in_blocks)
    yield _counter(m, "warmfleet:swap_out_blocks", "KV blocks moved from the primary pool to the CPU tier.", s.swap_out_blocks)
    yield _counter(m, "warmfleet:kv_events_dropped", "Times a KV-event subscriber fell a full queue behind and "
                   "missed batches (it resyncs from a snapshot).", s.kv_events_dropped)


def _encoder_and_lora_series(m: str, s: EngineStats) -> Iterator[Metric]:
    """The vision-encoder cache and, when LoRA is on, the adapter series."""
    # NOTE: getattr, so a text-only engine (or one without these fields yet) exports zeros.
    def field(name: str) -> float:
        return getattr(s, name, 0) or 0

    yield _counter(m, "warmfleet:encoder_cache_hits", "Image lookups served from the vision-encoder cache.",
                   field("encoder_cache_hits"))
    yield _counter(m, "warmfleet:encoder_cache_misses", "Image lookups that ran the vision encoder.",
                   field("encoder_cache_misses"))
    yield _counter(m, "warmfleet:encoder_cache_evictions", "Entries evicted from the vision-encoder cache.",
                   field("encoder_cache_evictions"))
    yield _gauge(m, "warmfleet:encoder_cache_usage_tokens", "Vision-encoder cache usage, in tokens.",
                 field("encoder_cache_usage_tokens"))
    yield _gauge(m, "warmfleet:encoder_cache_budget_tokens", "Vision-encoder cache budget (--max-encoder-cache), in tokens.",
                 field("encoder_cache_budget_tokens"))
    if field("max_loras"):
        yield lora_requests_info(s)
        yield _counter(m, "warmfleet:lora_device_loads",
                       "LoRA adapters copied into a device slot (resident-set misses).", field("lora_device_loads"))
        yield _counter(m, "warmfleet:lora_disk_loads", "LoRA adapters read from disk (registration included).",
                       field("lora_disk_loads"))


def lora_requests_info(s: EngineStats) -> GaugeMetricFamily:
    """`vllm:lora_requests_info` as the GIE model-server protocol reads it: labels carry the facts
    (comma-separated names), the value is the time they were read (vLLM's convention: the newest series wins)."""
    g = GaugeMetricFamily("vllm:lora_requests_info", "LoRA adapters resident (running) and wanted by waiting requests.",
                          labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
    g.add_metric([str(s.max_loras), ",".join(s.running_lora_adapters), ",".join(s.waiting_lora_adapters)], time.time())
    return g


@dataclass
class ProcessorCacheView:
    """What one scrape knows of the pod's processor cache."""

    stats: Optional[Any]  # processor_cache.CacheStats from the cache process; None when it did not answer
    num_timeouts: int = 0  # this frontend's calls that got no reply in time
    num_unavailable: int = 0  # calls refused at once because no cache process was connected
    num_errors: int = 0  # ERR replies and undecodable hits
    num_restarts: int = 0  # times the cache process was restarted after it exited


class ProcessorCacheCollector(Collector):
    """Exposes the last ProcessorCacheView read at scrape time; nothing when the pod runs no processor cache."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.view: Optional[ProcessorCacheView] = None

    def collect(self) -> Iterator[Metric]:
        v = self.view
        if v is None:
            return
        m = self.model_name
        up = GaugeMetricFamily("warmfleet:processor_cache_up", "1 if the processor-cache process answered this scrape.",
                               labels=["model_name"])
        up.add_metric([m], 1 if v.stats is not None else 0)
        yield up
        failures = CounterMetricFamily("warmfleet:processor_cache_client_failures",
                                       "Processor-cache calls of this frontend that failed (it preprocesses itself then), by cause.",
                                       labels=["model_name", "kind"])
        failures.add_metric([m, "timeout"], v.num_timeouts)
        failures.add_metric([m, "unavailable"], v.num_unavailable)
        failures.add_metric([m, "error"], v.num_errors)
        yield failures
        restarts = CounterMetricFamily("warmfleet:processor_cache_restarts", "Restarts of the processor-cache process.",
                                       labels=["model_name"])
        restarts.add_metric([m], v.num_restarts)
        yield restarts
        s = v.stats
        if s is None:
            return
        for name, doc, value in (
            ("hits", "Processor-cache lookups that found preprocessed pixels (since the cache process started).", s.hits),
            ("misses", "Processor-cache lookups that found nothing (since the cache process started).", s.misses),
            ("evictions", "Entries evicted from the processor cache (since the cache process started).", s.evictions),
        ):
            c = CounterMetricFamily(f"warmfleet:processor_cache_{name}", doc, labels=["model_name"])
            c.add_metric([m], value)
            yield c
        for name, doc, value in (
            ("usage_bytes", "Processor-cache usage, in bytes.", s.usage_bytes),
            ("capacity_bytes", "Processor-cache budget (--max-processor-cache), in bytes.", s.capacity_bytes),
            ("entries", "Images held by the processor cache.", s.entries),
        ):
            g = GaugeMetricFamily(f"warmfleet:processor_cache_{name}", doc, labels=["model_name"])
            g.add_metric([m], value)
            yield g


def _cache_config_info(c: CacheConfigInfo, s: EngineStats) -> GaugeMetricFamily:
    """vLLM's form: an info-style gauge fixed at 1 whose labels are CacheConfig fields as `str(value)`,
    plus `engine` (the engine index; one engine here), and no `model_name`."""
    labels = {
        "block_size": str(c.block_size),
        "num_gpu_blocks": str(s.gpu_blocks_total),  # the pool as sized at start-up, not the flag
        "num_cpu_blocks": str(s.cpu_blocks_total),
        "enable_prefix_caching": str(c.enable_prefix_caching),
        "engine": "0",
    }
    g = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(labels))
    g.add_metric(list(labels.values()), 1.0)
    return g


def _usage(total: int, free: int) -> float:
    return (total - free) / total if total > 0 else 0.0


class Metrics:
    """All series of one API server, on its own registry (tests can build many apps in one process)."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.engine = EngineStatsCollector(model_name)
        r.register(self.engine)
        self.processor_cache = ProcessorCacheCollector(model_name)
        r.register(self.processor_cache)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", labels, registry=r).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", labels, registry=r).labels(model_name)
        self.cached_prompt_tokens = Counter(
            "warmfleet:cached_prompt_tokens", "Prompt tokens served from the prefix cache, as reported in usage.",
            ["model_name", "tier"], registry=r,
        )
        self.request_success = Counter(
            "vllm:request_success", "Finished requests by finish reason.", ["model_name", "finished_reason"], registry=r
        )
        self.request_errors = Counter(
            "warmfleet:request_errors", "Requests answered with an error, by HTTP status.", ["model_name", "status"], registry=r
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", labels, buckets=_TTFT_BUCKETS, registry=r
        ).labels(model_name)
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds", "Time between consecutive output tokens.", labels, buckets=_ITL_BUCKETS, registry=r
        ).labels(model_name)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "Request latency from arrival to last token.", labels, buckets=_E2E_BUCKETS, registry=r
        ).labels(model_name)
        self.images = Counter("warmfleet:request_images", "Images in admitted requests.", labels, registry=r).labels(model_name)
        self.image_tokens = Counter(
            "warmfleet:image_tokens", "Prompt tokens that are image placeholders, in admitted requests.", labels, registry=r
        ).labels(model_name)
        self.image_hash_seconds = Histogram(
            "warmfleet:image_hash_seconds", "Time computing the mm_hash of one request's images (raw bytes).", labels,
            buckets=_HASH_BUCKETS, registry=r,
        ).labels(model_name)
        self.image_prepare_seconds = Histogram(
            "warmfleet:image_prepare_seconds",
            "Time preparing one request's images: load, hash, preprocess or processor-cache hit, prompt expansion.",
            labels, buckets=_PREPARE_BUCKETS, registry=r,
        ).labels(model_name)
        self.processor_cache_lookups = Counter(
            "warmfleet:processor_cache_lookups", "This frontend's processor-cache lookups, by result.",
            ["model_name", "result"], registry=r,
        )

    def set_cache_config(self, info: CacheConfigInfo) -> None:
        """Export `vllm:cache_config_info` from now on (with the pool size of each scrape's stats)."""
        self.engine.cache_config = info

    def finished(self, reason: str) -> None:
        self.request_success.labels(self.model_name, reason).inc()

    def error(self, status: int) -> None:
        self.request_errors.labels(self.model_name, str(status)).inc()

    def render(self, stats: Optional[EngineStats], processor_cache: Optional[ProcessorCacheView] = None) -> bytes:
        """Exposition text with engine and processor-cache series taken from the arguments (None leaves them out)."""
        self.engine.stats = stats
        self.processor_cache.view = processor_cache
        return generate_latest(self.registry)
